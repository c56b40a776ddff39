"""bench/cost_model.py: its arithmetic against the closed forms of its docstring, and its
2x2 figure from the inputs measured on this machine against the 2x2 runs measured there
(bench/cost_inputs.json; nothing is timed here)."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cost_model", ROOT / "bench" / "cost_model.py")
cm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cm)

INP = {"alpha": 1e-5, "beta": 1e9, "req_s": 1e-4, "req_row_s": 1e-7, "w_step": 1e-3,
       "w_example": 2e-5, "row_s": 2e-7, "opt_weight_s": 1e-9, "x_cpu": 3e-3,
       "rows": {"64": 1000.0, "1024": 8000.0}}


def test_rows_are_interpolated_and_extended_in_log_log():
    assert cm.rows_at(INP, 64) == pytest.approx(1000)
    assert cm.rows_at(INP, 1024) == pytest.approx(8000)
    # slope log 8 / log 16 = 0.75 over the segment, and beyond it
    assert cm.rows_at(INP, 256) == pytest.approx(1000 * 4 ** 0.75)
    assert cm.rows_at(INP, 4096) == pytest.approx(8000 * 4 ** 0.75)
    assert cm.rows_at(INP, 16) == pytest.approx(1000 / 4 ** 0.75)


def test_step_and_throughput_follow_the_closed_forms():
    S, W, b, P = 2, 4, 256, 1000
    u = 1000 * 4 ** 0.75
    p = cm.step_parts(INP, S, W, b, P)
    cw = 1e-3 + 256 * 2e-5 + 250 * 1e-9 + 3 * 1000 * 4 / 1e9
    cs = 2 * 1e-4 / 2 + u * 2e-7
    td = 2 * (2 * 1e-5 + 0.75 * 4000 / 1e9)
    tp = 1e-4 + u / 2 * 1e-7 + u * (8 + 80 + 4) / 2 / 1e9
    assert (p["cw"], p["cs"], p["td"], p["tp"], p["x"]) == pytest.approx((cw, cs, td, tp, 3e-3))
    # sharing cores: the job's CPU an example, the exchange's waiting CPU counted
    assert cm.cpu_per_example(INP, S, W, b, P) == pytest.approx((cw + 3e-3 + cs) / b)
    assert cm.one_node(INP, S, W, b, 2, P) == pytest.approx(2 * b / (cw + 3e-3 + cs))
    # several nodes: the workers' step and what of the exchanges shows, or the servers
    assert cm.nodes(INP, S, W, b, 1e-5, 1e9, False, P) == pytest.approx(
        W * b / max(cw + td + max(0.0, tp - td / 2), W * cs / S))
    assert cm.nodes(INP, S, W, b, 1e-5, 1e9, True, P) == pytest.approx(
        W * b / max(cw + max(td, tp), W * cs / S))
    # a slower network moves the exchange, not the CPU
    slow = cm.step_parts(INP, S, W, b, P, alpha=1e-4, beta=1e8)
    assert slow["cw"] == pytest.approx(cw) and slow["td"] == pytest.approx(
        2 * (2 * 1e-4 + 0.75 * 4000 / 1e8))
    assert cm.step_parts(INP, S, 1, b, P)["x"] == 0.0
    assert cm.step_parts(INP, S, 1, b, P)["td"] == 0.0 and math.isfinite(
        cm.nodes(INP, 1, 1, b, 1e-5, 1e9))


def test_the_measured_2x2_run_is_within_the_stated_tolerance():
    """The model's CPU an example for 2x2 at batch 512, from the inputs measured on this
    machine, against the same job's measured CPU an example (bench/cost_inputs.json)."""
    inp = json.loads((ROOT / "bench" / "cost_inputs.json").read_text())
    got = cm.check(inp)
    assert [(S, W, b) for S, W, b, *_ in got] == [(2, 2, 512)]
    for S, W, b, measured, model, ratio in got:
        assert model == pytest.approx(cm.cpu_per_example(inp, S, W, b))
        assert abs(ratio - 1) <= cm.TOLERANCE, (S, W, b, measured, model)
