"""The W-worker simulator (mpips.worker.simulate), against references.

- with no delay and summed (sync) pushes it is ``--local --local-workers W`` bit for bit
  (every sparse row, every dense weight, the metrics), W = 3 over 8 files (3, 3, 2: the
  third worker runs out first), with admission (the pulls' counts in worker order);
- with one worker and no delay it is plain ``--local`` bit for bit (async pushes);
- the sparse schedule on a hand-checked case: two workers, two steps, SGD on the loss
  0.5 ||row - target||^2 per example, delay 0, 1 and 2, against closed-form rows;
- the flags are refused where the simulator cannot run, with the fix.
"""
import re
import types

import numpy as np
import pytest

from mpips.config import parse_args
from mpips.tables.ownership import plan_keys
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.tables.staleness import StalenessTracker
from mpips.worker.local import LocalPS
from mpips.worker.simulate import SparseSchedule, run_schedule
from tests.test_dense_replica import assert_identical
from tests.test_modes import train


def same_run(a, b):
    """The training and test metrics of two one-process runs are the same numbers."""
    for key in ("train_examples", "train_loss", "train_auc", "test_examples", "test_auc",
                "test_logloss"):
        assert a[key] == b[key], (key, a[key], b[key])


@pytest.mark.parametrize("sim_sparse,rule", [("sync", "none"), ("async", "each")])
def test_no_delay_equals_local_workers_bit_for_bit(tiny_data, tmp_path, sim_sparse, rule):
    """--sim-sparse sync (the sync servers' step, here --sync-sparse-lr none: the step's
    pushes summed) is --local-workers W; --sim-sparse async with no delay (each worker's
    push a step of its own, in worker order, on rows read after the last step's pushes) is
    --local-workers W with --sync-sparse-lr each (the default)."""
    # 16000 rows in 8 files, batch 64: workers read 3, 3 and 2 files, end on short batches
    common = ("--batch-size", "64", "--lr", "0.003", "--entry", "count:2",
              "--sync-sparse-lr", rule)
    sim = train(tiny_data, tmp_path, "sim", "--local", "--simulate-workers", "3",
                "--sim-delay", "0", "--sim-sparse", sim_sparse, *common)[0]
    ref = train(tiny_data, tmp_path, "ref", "--local", "--local-workers", "3", *common)[0]
    assert_identical(tmp_path / "sim", tmp_path / "ref")
    same_run(sim, ref)
    assert (sim["simulate_workers"], sim["sim_delay"], sim["sim_sparse"]) == (3, 0, sim_sparse)
    assert "simulate_workers" not in ref


def test_one_worker_no_delay_equals_local(tiny_data, tmp_path):
    common = ("--batch-size", "256", "--lr", "0.003")
    sim = train(tiny_data, tmp_path, "sim", "--local", "--simulate-workers", "1",
                "--sim-delay", "0", *common)[0]
    ref = train(tiny_data, tmp_path, "ref", "--local", *common)[0]
    assert_identical(tmp_path / "sim", tmp_path / "ref")
    same_run(sim, ref)
    # every push is from rows read just before it: staleness 0, each pushed row counted
    st = sim["push_staleness"]
    assert (st["max"], st["unmatched"]) == (0, 0) and st["hist"][0] == st["pushed_rows"] > 0
    assert "push_staleness" not in ref


@pytest.mark.parametrize("delay,real_flags", [(0, ()), (1, ("--overlap-pull",))])
def test_one_worker_delay_equals_real_async(tiny_data, tmp_path, delay, real_flags):
    """A real async worker sends the pull of step t+1 after its push of step t (delay 0);
    with --overlap-pull before it computes step t (and after its push of step t-1): with
    one worker those are delays 0 and 1 exactly, over 2 servers too."""
    common = ("--batch-size", "256", "--lr", "0.003")
    sim = train(tiny_data, tmp_path, "sim", "--local", "--simulate-workers", "1",
                "--sim-delay", str(delay), *common)[0]
    real = train(tiny_data, tmp_path, "real", "--mode", "async", "--servers", "2", *common,
                 *real_flags, n=3)[0]
    assert_identical(tmp_path / "sim", tmp_path / "real")
    assert sim["push_staleness"]["hist"] == real["push_staleness"]["hist"]


LR = 0.5
TARGET = {0: 1.0, 1: 3.0}       # worker k pulls its rows toward TARGET[k]
EXAMPLES = {0: 1, 1: 2}         # its batches' examples: its push is scaled by 1 / these


def hand_case(delay, rule="none"):
    """Two workers, two steps, SGD at LR from rows 0: worker 0 uses id 7, worker 1 ids 7
    and 9 (both steps).  Returns ({id: value} after the schedule, the rows each part
    read, the staleness counts)."""
    table = SparseTable(1, OptimizerConfig(name="sgd", lr=LR), seed=0, init_range=0.0)
    tracker = StalenessTracker(table, max_pulls=delay + 1)
    ps = LocalPS(table, DenseTable(np.zeros(1, np.float32), OptimizerConfig(name="sgd")),
                 tracker, rule)

    def part(k, ids):
        plan = plan_keys(np.array(ids, np.int64), 1)
        return k, types.SimpleNamespace(plan=plan, counts=None,
                                        rows=np.empty((len(plan.keys), 1), np.float32))

    steps = [[part(0, [7]), part(1, [7, 9])] for _ in range(2)]
    seen = []

    def grad(t, parts):
        # gradient of the summed loss: each of n examples adds row - target
        seen.append([p.rows[:, 0].tolist() for _, p in parts])
        return ([EXAMPLES[k] * (p.rows - np.float32(TARGET[k])) for k, p in parts],
                [EXAMPLES[k] for k, _ in parts])

    assert SparseSchedule(ps, delay, "async").run(steps, grad) == 2
    out = np.empty((2, 1), np.float32)
    table.pull(np.array([7, 9], np.int64), out)
    return dict(zip((7, 9), out[:, 0].tolist())), seen, tracker.summary()


def test_schedule_hand_checked_no_delay():
    # step 0 reads 0 everywhere; pushes in worker order: worker 0 moves id 7 by
    # -LR (0 - 1) = +0.5 -> 0.5, worker 1 (from its read 0) by -LR (0 - 3) = +1.5 -> 2.0;
    # id 9: +1.5 -> 1.5.  Step 1 reads 7 = 2.0, 9 = 1.5: worker 0 -> 2.0 - 0.5 (2 - 1) =
    # 1.5, worker 1 -> 1.5 - 0.5 (2 - 3) = 2.0; id 9: 1.5 - 0.5 (1.5 - 3) = 2.25
    rows, seen, stale = hand_case(0)
    assert seen == [[[0.0], [0.0, 0.0]], [[2.0], [2.0, 1.5]]]
    assert rows == {7: 2.0, 9: 2.25}
    # staleness (updates since the pusher's pull): id 7 is 0 for worker 0 and 1 for
    # worker 1 (worker 0's push came between), id 9 is 0, in both steps
    assert stale["hist"][:3] == [4, 2, 0] and (stale["max"], stale["unmatched"]) == (1, 0)


def test_schedule_hand_checked_stale_lr():
    # --stale-lr inverse, delay 0: worker 1's push of id 7 (staleness 1) at LR / 2.
    # Step 0: 7 -> 0 + 0.5 = 0.5, then + 0.25 * 3 = 1.25; 9 -> 1.5.  Step 1 reads 1.25,
    # 1.5: 7 -> 1.25 - 0.5 (0.25) = 1.125, then - 0.25 (1.25 - 3) = 1.5625;
    # 9 -> 1.5 - 0.5 (1.5 - 3) = 2.25
    rows, seen, _ = hand_case(0, "inverse")
    assert seen == [[[0.0], [0.0, 0.0]], [[1.25], [1.25, 1.5]]]
    assert rows == {7: 1.5625, 9: 2.25}


@pytest.mark.parametrize("delay", [1, 2])
def test_schedule_hand_checked_delayed(delay):
    # both steps' rows are read before any push (step 1's pull comes before step 0's
    # pushes): every push is from rows 0, so id 7 takes +0.5 +1.5 per step -> 4.0 and id 9
    # +1.5 per step -> 3.0 (delay 2 reads no earlier than the start: the same)
    rows, seen, stale = hand_case(delay)
    assert seen == [[[0.0], [0.0, 0.0]], [[0.0], [0.0, 0.0]]]
    assert rows == {7: 4.0, 9: 3.0}
    # step 0 as with no delay (7: 0 and 1, 9: 0); step 1 read before step 0's pushes:
    # id 7 took 2 updates before worker 0's push and 3 before worker 1's, id 9 took 1
    assert stale["hist"][:5] == [2, 2, 1, 1, 0]
    assert (stale["max"], stale["unmatched"], stale["mean"]) == (3, 0, round(7 / 6, 4))


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_schedule_order(delay):
    """Step t's pull comes after the pushes of steps < t - delay and before the others."""
    log = []
    n = run_schedule(range(6), delay, lambda t, s: log.append(("pull", t)),
                     lambda t, s: log.append(("step", t)))
    assert n == 6
    for t in range(6):
        pos = log.index(("pull", t))
        assert all(log.index(("step", u)) < pos for u in range(t - delay))
        assert all(log.index(("step", u)) > pos for u in range(max(t - delay, 0), 6))


@pytest.mark.parametrize("argv,says", [
    (["--simulate-workers", "4"], "--local is missing"),
    (["--local", "--simulate-workers", "4", "--local-workers", "2"], "--local-workers 2"),
    (["--local", "--simulate-workers", "4", "--mode", "geo"], "--mode geo"),
    (["--local", "--simulate-workers", "4", "--save-every", "10"], "--save-every 10"),
    (["--local", "--sim-delay", "2"], "give --local --simulate-workers"),
    (["--local", "--simulate-workers", "4", "--sim-delay", "-1"], "--sim-delay in [0, 64]"),
])
def test_refused_with_the_fix(argv, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_args(argv)
    assert parse_args(["--local", "--simulate-workers", "4"]).sim_delay == 0
