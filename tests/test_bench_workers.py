"""bench/bench_workers.py's plot range: points beyond the default range on the side where runs
beat one process are drawn (the second shape's +0.013 AUC), diverged runs stay off the chart."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
spec = importlib.util.spec_from_file_location("bench_workers", ROOT / "bench" / "bench_workers.py")
bw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bw)


def test_y_range_grows_only_towards_better_runs():
    assert bw.y_range([-0.003, 0.004], -0.05, 0.01, "up") == (-0.05, 0.01)
    lo, hi = bw.y_range([0.013, -0.43, 0.0], -0.05, 0.01, "up")    # -0.43: a diverged run
    assert lo == -0.05 and hi == pytest.approx(0.015)
    lo, hi = bw.y_range([-0.0102, 0.31], -0.01, 0.05, "down")
    assert lo == pytest.approx(-0.0122) and hi == 0.05


def test_plot_holds_a_point_above_the_default_range(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [{"rule": "", "kind": "local", "W": 1, "flags": "", "seed": 0, "data": "/d/x",
             "test_auc": 0.76, "test_logloss": 0.48}]
    for W, auc, ll in ((16, 0.773, 0.4698), (32, 0.40, 0.9)):    # +0.013 / -0.0102; diverged
        recs.append({"rule": "G", "kind": "sim", "W": W, "flags": "", "seed": 0, "data": "/d/x",
                     "test_auc": auc, "test_logloss": ll})
    (auc_lo, auc_hi), (ll_lo, ll_hi) = bw.plot(recs, tmp_path / "p.png")
    assert auc_hi > 0.013 and auc_lo == -0.05
    assert ll_lo < -0.0102 and ll_hi == 0.05
    assert (tmp_path / "p.png").stat().st_size > 0
