"""Staleness of async pushes (mpips.tables.staleness) and the --stale-lr rules.

- the tracker against a plain-Python model (a dict of per-key update counts and a dict of
  pull records) on scripted sequences: two workers interleaving, a step pulled twice, a
  push without a pull, pushes in another order, shrinks, admission;
- each optimizer kernel's per-row learning-rate factor against numpy, and no factor ==
  factor 1 bit for bit;
- a 2-server x 2-worker async run reports a sane staleness summary.
"""
import numpy as np
import pytest

from mpips.kernels.optim import N_HYPER, adagrad_rows, adam_rows, sgd_rows
from mpips.tables.admission import AdmittedTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.tables.staleness import (HIST_BINS, MAX_PULLS, StalenessTracker, lr_factors,
                                    stale_rule, summarize)
from tests.conftest import run_cmd

DIM = 3


class Reference:
    """The tracker's definition in plain Python, per key (a key's row is the key)."""

    def __init__(self, max_pulls=MAX_PULLS):
        self.max_pulls = max_pulls
        self.updates = {}       # key -> pushes applied since the last reset
        self.pulls = {}         # worker -> {step: {key: updates at the first pull}}
        self.hist = [0] * HIST_BINS
        self.total = self.max = self.unmatched = 0

    def reset(self):
        self.updates, self.pulls = {}, {}

    def pulled(self, worker, step, keys, has_row=lambda k: True):
        recs = self.pulls.setdefault(worker, {})
        rec = recs.setdefault(step, {})
        for k in keys:
            if has_row(k) and k not in rec:
                rec[k] = self.updates.get(k, 0)
        for s in list(recs):
            if s <= step - self.max_pulls:
                del recs[s]
        while len(recs) > self.max_pulls:
            del recs[min(s for s in recs if s != step)]

    def pushed(self, worker, step, keys, has_row=lambda k: True):
        recs = self.pulls.get(worker, {})
        rec = recs.pop(step, {})
        for s in [s for s in recs if s < step]:
            del recs[s]
        out = []
        for k in keys:
            if has_row(k) and k in rec:
                s = self.updates.get(k, 0) - rec[k]
                self.hist[min(s, HIST_BINS - 1)] += 1
                self.total += s
                self.max = max(self.max, s)
            else:
                s = 0
                self.unmatched += 1
            out.append(s)
            if has_row(k):
                self.updates[k] = self.updates.get(k, 0) + 1
        return out


def new_table():
    return SparseTable(DIM, OptimizerConfig("sgd", lr=0.1), seed=1)


def check_same(tr, ref):
    assert tr.hist.tolist() == ref.hist
    assert (tr.total, tr.max, tr.unmatched) == (ref.total, ref.max, ref.unmatched)


def run_script(table, tracker, ref, script):
    """Apply (op, worker, step, keys) to the table and both trackers; compare each push."""
    for op, worker, step, keys in script:
        keys = np.asarray(keys, np.int64)
        if op == "pull":
            rows = table.pull(keys, np.empty((len(keys), DIM), np.float32), create=True)
            assert np.array_equal(rows, table.rows_of(keys))
            # the server hands the tracker its pull's rows; without them it looks them up
            tracker.pulled(worker, step, keys, rows if worker % 2 == 0 else None)
            ref.pulled(worker, step, keys.tolist())
        else:
            got = tracker.pushed(worker, step, keys)
            assert got.dtype == np.int64
            assert got.tolist() == ref.pushed(worker, step, keys.tolist()), (op, worker, step)
            table.push(keys, np.ones((len(keys), DIM), np.float32))
    check_same(tracker, ref)


def async_script(rng, workers=2, steps=30, pool=40):
    """Each worker: pull 0, then (pull t+1, push t) as the async trainer sends them, the
    workers' requests interleaved at random; keys are sorted unique draws from a pool."""
    todo = {w: [] for w in range(workers)}
    for w in range(workers):
        batches = [np.unique(rng.integers(0, pool, 12)) for _ in range(steps)]
        todo[w].append(("pull", w, 0, batches[0]))
        for t in range(steps):
            if t + 1 < steps:
                todo[w].append(("pull", w, t + 1, batches[t + 1]))
            todo[w].append(("push", w, t, batches[t]))
    script = []
    while any(todo.values()):
        w = rng.choice([w for w in todo if todo[w]])
        script.append(todo[w].pop(0))
    return script


def test_two_workers_interleaved_async_count_exactly():
    rng = np.random.default_rng(0)
    table = new_table()
    tracker, ref = StalenessTracker(table), Reference()
    run_script(table, tracker, ref, async_script(rng, workers=2))
    assert tracker.hist.sum() > 0 and tracker.hist[1:].sum() > 0   # really stale rows
    assert tracker.unmatched == 0


def test_pulls_pushes_in_other_orders_and_without_pulls():
    """Pushes whose keys differ from the pull (other order, subset, new keys), a step pulled
    twice (the earlier pull counts for a key in both), a push without a pull."""
    table = new_table()
    tracker, ref = StalenessTracker(table), Reference()
    script = [
        ("pull", 0, 0, [5, 1, 9, 3]),
        ("pull", 1, 0, [1, 3, 7]),
        ("push", 1, 0, [7, 1, 3]),              # other order than its pull
        ("pull", 0, 0, [3, 7, 8]),              # step 0 again: 3 keeps its first version
        ("push", 1, 5, [1, 7]),                 # no pull of step 5: unmatched
        ("push", 0, 0, [9, 3, 7, 8, 1, 42]),    # subset + 42 never pulled (a new row)
        ("push", 0, 1, [5]),                    # no record (step 0 was used up)
        ("pull", 1, 2, [42, 5]),
        ("pull", 1, 3, [42]),
        ("pull", 1, 4, [5]),                    # drops the record of step 2 (max 2 kept)
        ("push", 1, 2, [42, 5]),                # unmatched
        ("push", 0, 9, [42]),
        ("push", 1, 3, [42]),                   # 42 pushed twice since the pull of step 3
        ("push", 1, 4, [5]),
    ]
    run_script(table, tracker, ref, script)
    assert tracker.unmatched > 0 and tracker.max >= 2


def test_high_staleness_goes_to_the_last_bin():
    table = new_table()
    tracker, ref = StalenessTracker(table), Reference()
    script = [("pull", 0, 0, [4, 6])]
    script += [("push", 1, i, [4]) for i in range(70)]      # 70 updates, no pulls of worker 1
    script += [("push", 0, 0, [4, 6])]
    run_script(table, tracker, ref, script)
    assert tracker.hist[HIST_BINS - 1] == 1 and tracker.hist[0] == 1 and tracker.max == 70
    s = tracker.summary()
    assert (s["pushed_rows"], s["max"], s["p50"], s["p99"], s["mean"]) == (2, 70, 0, 64, 35.0)


def test_repeated_random_scripts_with_more_pull_records():
    rng = np.random.default_rng(5)
    table = new_table()
    tracker, ref = StalenessTracker(table, max_pulls=3), Reference(max_pulls=3)
    script = []
    for _ in range(200):
        op = "pull" if rng.random() < 0.55 else "push"
        script.append((op, int(rng.integers(0, 3)), int(rng.integers(0, 6)),
                       rng.permutation(np.unique(rng.integers(0, 30, 6)))))
    run_script(table, tracker, ref, script)


def test_shrink_that_moves_rows_and_reset_forget_pulls():
    table = new_table()
    tracker, ref = StalenessTracker(table), Reference()
    run_script(table, tracker, ref, [("pull", 0, 0, [1, 2, 3]), ("push", 0, 0, [1, 2, 3]),
                                     ("pull", 0, 1, [10, 11]), ("push", 1, 0, [10, 11])])
    table.shrink(0)                     # marks all seen rows unseen: nothing removed yet
    run_script(table, tracker, ref, [("pull", 0, 2, [2, 3, 11]), ("push", 1, 3, [11])])
    assert table.shrink(0) == 2         # 1 and 10 go; 2, 3 and 11 move down
    ref.reset()
    run_script(table, tracker, ref, [("push", 0, 2, [2, 3, 11]),      # pulls forgotten
                                     ("pull", 1, 0, [2, 3]), ("push", 0, 7, [3]),
                                     ("push", 1, 0, [3, 2])])
    assert tracker.hist[1] == 1         # 3 was pushed once since worker 1 pulled it
    tracker.reset()
    ref.reset()
    run_script(table, tracker, ref, [("pull", 0, 0, [2]), ("push", 0, 0, [2])])


def test_admission_keys_without_rows_are_unmatched():
    table = AdmittedTable(new_table(), "count:2", seed=0)
    tracker, ref = StalenessTracker(table), Reference()
    out = np.empty((3, DIM), np.float32)
    for step, keys in enumerate(([1, 2, 3], [2, 3, 4])):
        keys = np.array(keys, np.int64)
        rows = table.pull(keys, out, create=True)
        assert np.array_equal(rows, table.rows_of(keys))       # -1: not admitted (yet)
        has = set(table.export_rows()["keys"].tolist())
        tracker.pulled(0, step, keys, rows)
        ref.pulled(0, step, keys.tolist(), has.__contains__)
        got = tracker.pushed(0, step, keys)
        assert got.tolist() == ref.pushed(0, step, keys.tolist(), has.__contains__)
        table.push(keys, np.ones((3, DIM), np.float32))
    check_same(tracker, ref)
    assert tracker.unmatched == 4 and tracker.hist[0] == 2   # 2, 3 admitted at step 1
    # id 9: no row at worker 0's pull, admitted by worker 1's pull before worker 0 pushes
    # the same keys: that push is unmatched but still one more update of the row
    one = np.empty((1, DIM), np.float32)
    k9 = np.array([9], np.int64)
    script = [(0, "pull", 5), (1, "pull", 5), (1, "push", 5), (1, "pull", 6),
              (0, "push", 5), (1, "push", 6)]
    for worker, op, step in script:
        if op == "pull":
            table.pull(k9, one, create=True)
        has = set(table.export_rows()["keys"].tolist())
        if op == "pull":
            tracker.pulled(worker, step, k9)
            ref.pulled(worker, step, [9], has.__contains__)
        else:
            got = tracker.pushed(worker, step, k9)
            assert got.tolist() == ref.pushed(worker, step, [9], has.__contains__)
            table.push(k9, one)
    check_same(tracker, ref)
    assert tracker.hist[1] == 1         # worker 0's push came between worker 1's pull and push


def test_summary_percentiles_from_histogram():
    hist = np.zeros(HIST_BINS, np.int64)
    hist[[0, 1, 2, 9]] = [50, 30, 15, 5]
    s = summarize(hist, 30 + 30 + 45, 9, 7)
    assert (s["pushed_rows"], s["p50"], s["p90"], s["p99"], s["max"]) == (100, 0, 2, 9, 9)
    assert s["mean"] == 1.05 and s["unmatched"] == 7 and s["hist"] == hist.tolist()
    assert summarize(np.zeros(HIST_BINS, np.int64), 0, 0, 0)["p90"] == 0


def test_lr_factors():
    s = np.array([0, 1, 3, 8], np.int64)
    assert lr_factors("none", s) is None
    inv, sq = lr_factors("inverse", s), lr_factors("sqrt", s)
    assert inv.dtype == sq.dtype == np.float32
    np.testing.assert_array_equal(inv, np.float32([1, 0.5, 0.25, 1 / 9]))
    np.testing.assert_array_equal(sq, np.float32([1, 1 / np.sqrt(2), 0.5, 1 / 3]))
    with pytest.raises(ValueError, match="none, inverse, sqrt"):
        lr_factors("linear", s)
    # power:P, (1 + s)^-P: the named rules are its P = 0, 0.5 and 1
    np.testing.assert_allclose(lr_factors("power:0.75", s),      # numpy's pow may be SIMD:
                               np.float32([1, 2 ** -0.75, 0.25 ** 0.75, 9 ** -0.75]),
                               rtol=2.4e-7)                        # one float32 step
    np.testing.assert_allclose(lr_factors("power:1", s), inv, rtol=1e-7)
    np.testing.assert_allclose(lr_factors("power:0.5", s), sq, rtol=1e-7)
    assert lr_factors("power:0", s) is None
    for bad in ("power:", "power:x", "power:-1", "power:5", "pow:0.5", "auto"):
        with pytest.raises(ValueError, match="power:P"):
            lr_factors(bad, s)


def test_stale_lr_auto_is_the_default_and_damps_only_beyond_16_workers():
    from mpips.config import parse_args
    from mpips.job.plan import make_plan
    from mpips.train import local_backend
    assert parse_args([]).stale_lr == "auto"
    assert [stale_rule("auto", w) for w in (1, 2, 8, 16, 17, 64)] == \
        ["none"] * 4 + ["power:0.75"] * 2
    assert [stale_rule(r, 64) for r in ("none", "inverse", "power:2")] == ["none", "inverse", "power:2"]
    for bad in ("power:9", "cube"):
        with pytest.raises(ValueError, match="--stale-lr must be one of"):
            parse_args(["--stale-lr", bad])
    sim = ["--local", "--global-batch", "4096", "--simulate-workers"]
    cases = [(sim + ["16"], "none"), (sim + ["17"], "power:0.75"),
             (sim + ["32", "--stale-lr", "none"], "none"),
             (sim + ["32", "--stale-lr", "power:0"], "power:0"),        # no damping either
             (sim + ["8", "--stale-lr", "inverse"], "inverse"),
             (sim + ["8", "--stale-lr", "sqrt"], "sqrt"),
             (["--local", "--local-workers", "32"], None)]      # sync: nothing is stale
    for args, rule in cases:
        plan = make_plan(parse_args(args))
        line = plan.stale_line()
        if rule in ("none", "power:0", None):
            assert line is None, (args, line)
        else:                                   # the start line names what the run applies
            assert {"sqrt": "1 / sqrt(1 + s)", "inverse": "1 / (1 + s)",
                    "power:0.75": "(1 + s)^-0.75"}[rule] in line, line
            assert ("auto: 17 workers, more than 16" in line) == ("17" in args), line
        if rule is not None:                    # and the simulator's LocalPS applies it
            assert local_backend(plan).ps.rule == rule, args


# ---- the kernels' per-row learning-rate factor
R = 10


def setup_rows(seed):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(R, 4)).astype(np.float32)
    pushes = []
    for _ in range(5):
        rows = np.sort(rng.choice(R, 6, replace=False)).astype(np.int64)
        pushes.append((rows, rng.normal(size=(6, 4)).astype(np.float32),
                       rng.uniform(0.1, 1.0, 6).astype(np.float32)))
    return w, pushes


def test_sgd_lr_scale():
    w, pushes = setup_rows(0)
    ref = w.astype(np.float64)
    for rows, g, f in pushes:
        sgd_rows(w, rows, g, 0.1, 0.5, f)
        ref[rows] -= (0.1 * f.astype(np.float64) * 0.5)[:, None] * g
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7)


def test_adagrad_lr_scale():
    w, pushes = setup_rows(1)
    acc = np.full_like(w, 0.1)
    ref_w, ref_a = w.astype(np.float64), acc.astype(np.float64)
    for rows, g, f in pushes:
        adagrad_rows(w, acc, rows, g, 0.05, 1e-6, 2.0, f)
        gs = 2.0 * g.astype(np.float64)
        ref_a[rows] += gs * gs
        ref_w[rows] -= (0.05 * f.astype(np.float64))[:, None] * gs / (np.sqrt(ref_a[rows]) + 1e-6)
    np.testing.assert_allclose(acc, ref_a, rtol=1e-6)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6, atol=1e-7)


def test_adam_lr_scale_scales_the_step_only():
    w, pushes = setup_rows(2)
    lr, b1, b2, eps, scale = 0.01, 0.9, 0.99, 1e-8, 0.5
    m, v = np.zeros_like(w), np.zeros_like(w)
    b1p, b2p = np.full(R, b1, np.float32), np.full(R, b2, np.float32)
    ref_w = w.astype(np.float64)
    ref_m, ref_v, t = np.zeros_like(ref_w), np.zeros_like(ref_w), np.zeros(R)
    for rows, g, f in pushes:
        adam_rows(w, m, v, b1p, b2p, rows, g, np.array([lr, b1, b2, eps, scale]), f)
        gs = scale * g.astype(np.float64)
        t[rows] += 1
        ref_m[rows] = b1 * ref_m[rows] + (1 - b1) * gs
        ref_v[rows] = b2 * ref_v[rows] + (1 - b2) * gs * gs
        mhat = ref_m[rows] / (1 - b1 ** t[rows])[:, None]
        vhat = ref_v[rows] / (1 - b2 ** t[rows])[:, None]
        ref_w[rows] -= (lr * f.astype(np.float64))[:, None] * mhat / (np.sqrt(vhat) + eps)
    np.testing.assert_allclose(m, ref_m, rtol=1e-5, atol=1e-7)      # moments: unscaled
    np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_no_factor_equals_factor_one_bit_for_bit(name):
    """push() (no factor: the kernels' code before the factor existed) == push(lr_scale=
    ones): each row's lr is multiplied by exactly 1.0 or not at all; and the kernels
    called without the argument agree with both."""
    rng = np.random.default_rng(3)
    opt = OptimizerConfig(name, lr=0.02, initial_accumulator=0.1)
    tables = [SparseTable(4, opt, seed=7) for _ in range(2)]
    for _ in range(4):
        keys = np.unique(rng.integers(0, 50, 20))
        g = rng.normal(size=(len(keys), 4)).astype(np.float32)
        tables[0].push(keys, g, 0.5)
        tables[1].push(keys, g, 0.5, lr_scale=np.ones(len(keys), np.float32))
    a, b = (t.export_rows() for t in tables)
    for field in a:
        assert np.array_equal(a[field], b[field]), field
    w, pushes = setup_rows(4)
    state = [np.full_like(w, 0.1), np.zeros_like(w), np.full(R, 0.9, np.float32),
             np.full(R, 0.99, np.float32)]
    copies = [[w.copy()] + [x.copy() for x in state] for _ in range(2)]
    hyper = np.array([0.01, 0.9, 0.99, 1e-8, 0.5])
    assert hyper.shape == (N_HYPER,)
    for rows, g, _ in pushes:
        for (w_, acc, m, b1p, b2p), f in zip(copies, ((), (np.ones(6, np.float32),))):
            if name == "sgd":
                sgd_rows(w_, rows, g, 0.1, 0.5, *f)
            elif name == "adagrad":
                adagrad_rows(w_, acc, rows, g, 0.05, 1e-6, 2.0, *f)
            else:
                adam_rows(w_, acc, m, b1p, b2p, rows, g, hyper, *f)
    for x, y in zip(*copies):
        assert np.array_equal(x, y)


def test_push_lr_scale_follows_dropped_keys():
    """Admission drops gradients of ids without a row: their factors go with them."""
    table = SparseTable(2, OptimizerConfig("sgd", lr=1.0), seed=0, init_range=0.0)
    table.pull(np.array([1, 3], np.int64), np.empty((2, 2), np.float32), create=True)
    g = np.ones((3, 2), np.float32)
    table.push(np.array([1, 2, 3], np.int64), g, create=False,
               lr_scale=np.float32([0.5, 0.25, 0.125]))
    out = np.empty((3, 2), np.float32)
    table.pull(np.array([1, 2, 3], np.int64), out)
    np.testing.assert_array_equal(out, np.float32([[-0.5, -0.5], [0, 0], [-0.125, -0.125]]))
    with pytest.raises(ValueError, match="lr_scale"):
        table.push(np.array([1], np.int64), g[:1], lr_scale=np.ones(2, np.float32))


def test_local_ps_tracks_and_damps():
    """LocalPS with a tracker: the staleness of worker 0's push damps its lr (inverse)."""
    from mpips.tables.ownership import plan_keys
    from mpips.tables.dense import DenseTable
    from mpips.worker.local import LocalPS
    opt = OptimizerConfig("sgd", lr=1.0)
    sparse = SparseTable(2, opt, seed=0, init_range=0.0)
    ps = LocalPS(sparse, DenseTable(np.zeros(1, np.float32), opt),
                 StalenessTracker(sparse), "inverse")
    plan = plan_keys(np.array([4, 9], np.int64), 1)
    out = np.empty((2, 2), np.float32)
    g = np.ones((2, 2), np.float32)
    ps.pull(plan, out, step=0, worker=0)
    ps.pull(plan, out, step=0, worker=1)
    ps.push(plan, g, step=0, worker=1)            # staleness 0: w = -1
    ps.push(plan, g, step=0, worker=0)            # staleness 1: w = -1 - 1/2
    ps.pull(plan, out, step=1, create=False, worker=0)    # evaluation: not recorded
    np.testing.assert_array_equal(out, np.full((2, 2), -1.5, np.float32))
    assert ps.tracker.hist[:2].tolist() == [2, 2]
    ps.push(plan, g, step=1, worker=0)            # no training pull of step 1: factor 1
    assert ps.tracker.unmatched == 2
    with pytest.raises(ValueError, match="stale-lr"):
        LocalPS(sparse, None, None, "cubic")


def test_async_2x2_reports_staleness(tiny_data, tmp_path):
    import json
    train_dir, test_dir = tiny_data
    out = tmp_path / "m.jsonl"
    proc = run_cmd(["-m", "mpips.train", "--train", train_dir, "--test", test_dir,
                    "--fc", "16", "--batch-size", "256", "--max-steps", "20",
                    "--print-every", "100000", "--progress-every", "0", "--servers", "2",
                    "--stale-lr", "sqrt", "--overlap-pull", "--metrics-out", str(out)], n=4,
                   timeout=300,
                   env={"MPIPS_DEBUG_JIT": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = [x for x in proc.stderr.splitlines() if x.startswith("JIT --> ") and "after" in x]
    assert len(after) == 4 and all(" 0 kernel signature(s) compiled after" in x for x in after), \
        proc.stderr[-3000:]                 # the warm-up compiled the counting and the rule
    s = json.loads(out.read_text().splitlines()[-1])["push_staleness"]
    assert len(s["hist"]) == HIST_BINS and s["pushed_rows"] == sum(s["hist"]) > 0
    assert s["max"] >= s["p99"] >= s["p90"] >= s["p50"] >= 0
    assert s["hist"][1] > 0             # a worker's own previous push: at least 1
    assert 0 < s["mean"] <= s["max"] and s["unmatched"] == 0


def test_count_push_kernel_wraps_modulo_2_32():
    from mpips.kernels.staleness import count_push
    version = np.array([2**32 - 1, 5, 0, 70], np.uint32)
    rows = np.array([0, 1, -1, 2, 3], np.int64)
    then = np.array([2**32 - 3, 5, 0, 0, 1], np.uint32)
    for hit, want_stale, want_acc in ((np.zeros(0, np.bool_), [2, 0, 0, 0, 69], [4, 71, 69]),
                                      (np.array([1, 0, 1, 1, 0], np.bool_), [2, 0, 0, 0, 0],
                                       [2, 2, 2])):
        v = version.copy()
        stale, hist = np.full(5, -1, np.int64), np.zeros(HIST_BINS, np.int64)
        acc = np.zeros(3, np.int64)
        count_push(v, rows, then, hit, stale, hist, acc)
        assert stale.tolist() == want_stale and acc.tolist() == want_acc
        want_hist = np.bincount(np.minimum([s for s, r, h in zip(
            want_stale, rows, hit if len(hit) else [1] * 5) if r >= 0 and h], 64),
            minlength=HIST_BINS)
        assert hist.tolist() == want_hist.tolist()
        assert v.tolist() == [0, 6, 1, 71]          # every row with a row: one more update


def test_parts_holding_counts_the_workers_whose_batch_held_each_row():
    """--sync-sparse-lr count: a summed row's lr factor is the number of parts (workers'
    unique key lists) that hold it; against a plain-Python count."""
    from collections import Counter

    from mpips.tables.push import parts_holding
    rng = np.random.default_rng(5)
    parts = [np.unique(rng.integers(-50, 50, size=rng.integers(0, 60))) for _ in range(5)]
    every = np.concatenate(parts).astype(np.int64)
    keys = np.unique(every)
    want = Counter(int(k) for p in parts for k in p)
    got = parts_holding(every, keys)
    assert got.dtype == np.float32
    assert got.tolist() == [float(want[int(k)]) for k in keys]


def test_sync_sparse_lr_count_steps_rows_by_the_parts_holding_them():
    """A step's summed push (one process, --local-workers): with --sync-sparse-lr count a
    row moves lr x (parts holding it) x its summed gradient / the step's examples; without,
    lr x the same.  SGD from zero rows, against numpy."""
    from types import SimpleNamespace

    from mpips.tables.ownership import KeyPlan
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    from mpips.worker.local import LocalPS
    from mpips.worker.trainer import Trainer
    lr, examples = 0.1, 4
    k1, k2 = np.array([3, 5], np.int64), np.array([5, 8], np.int64)
    g1 = np.array([[1, 2], [3, 4]], np.float32)
    g2 = np.array([[5, 6], [7, 8]], np.float32)
    summed = {3: g1[0], 5: g1[1] + g2[0], 8: g2[1]}
    for rule, held in (("none", {3: 1, 5: 1, 8: 1}), ("count", {3: 1, 5: 2, 8: 1})):
        table = SparseTable(2, OptimizerConfig(name="sgd", lr=lr), seed=0, init_range=0.0)
        me = SimpleNamespace(cfg=SimpleNamespace(sync_sparse_lr=rule), ps=LocalPS(table, None),
                             dense_sync=None, clip=lambda p, g, n: None)   # no --row-clip
        parts = [(SimpleNamespace(plan=KeyPlan(k, None, np.array([0, len(k)], np.int64)),
                                  batch=SimpleNamespace(label=np.zeros(n))), g.copy())
                 for k, g, n in ((k1, g1, 3), (k2, g2, 1))]     # 3 + 1 = examples
        Trainer._push(me, parts, examples, 0)
        out = np.empty((3, 2), np.float32)
        table.pull(np.array([3, 5, 8], np.int64), out)
        want = np.array([-lr * held[k] * summed[k] / examples for k in (3, 5, 8)])
        np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=rule)


def test_sync_sparse_lr_each_steps_a_row_once_per_part_holding_it():
    """--sync-sparse-lr each (one process, --local-workers): every part's rows are averaged
    over that part's examples and take an Adam step of their own, in part order, so a row
    in two parts takes two steps.  Against a numpy Adam from zero rows."""
    from types import SimpleNamespace

    from mpips.tables.ownership import KeyPlan
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    from mpips.worker.local import LocalPS
    from mpips.worker.trainer import Trainer
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    k1, k2 = np.array([3, 5], np.int64), np.array([5, 8], np.int64)
    g1 = np.array([[1, -2], [3, 4]], np.float32)
    g2 = np.array([[-5, 6], [7, 8]], np.float32)
    n1, n2 = 3, 1                               # the parts' examples
    table = SparseTable(2, OptimizerConfig(name="adam", lr=lr), seed=0, init_range=0.0)
    me = SimpleNamespace(cfg=SimpleNamespace(sync_sparse_lr="each"), ps=LocalPS(table, None),
                         dense_sync=None, clip=lambda p, g, n: None)       # no --row-clip
    parts = [(SimpleNamespace(plan=KeyPlan(k, None, np.array([0, len(k)], np.int64)),
                              batch=SimpleNamespace(label=np.zeros(n))), g.copy())
             for k, g, n in ((k1, g1, n1), (k2, g2, n2))]
    Trainer._push(me, parts, n1 + n2, 0)
    out = np.empty((3, 2), np.float32)
    table.pull(np.array([3, 5, 8], np.int64), out)
    ref = {k: [np.zeros(2), np.zeros(2), np.zeros(2), 0] for k in (3, 5, 8)}   # w, m, v, t
    for keys, g, n in ((k1, g1, n1), (k2, g2, n2)):
        for k, row in zip(keys.tolist(), g.astype(np.float64) / n):
            w, m, v, t = ref[k]
            t += 1
            m = b1 * m + (1 - b1) * row
            v = b2 * v + (1 - b2) * row * row
            w = w - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
            ref[k] = [w, m, v, t]
    want = np.array([ref[k][0] for k in (3, 5, 8)])
    np.testing.assert_allclose(out, want, rtol=1e-5)     # row 5 (in both parts): 2 steps
    # one Adam step from the summed gradient (what none does) would be lr x its sign
    assert not np.allclose(out[1], -lr * np.sign(g1[1] / n1 + g2[0] / n2), rtol=1e-3)


def test_row_clip_against_a_per_row_reference():
    """--row-clip (CowClip-style): each row's gradient, averaged over n examples, is
    clipped so that its mean over the row's occurrences has norm <= ratio x max(|row|,
    floor); checked row by row in plain Python, rows under the limit untouched."""
    from mpips.worker.trainer import clip_rows
    rng = np.random.default_rng(3)
    u, n, ratio, floor = 40, 16, 2.0, 0.05
    rows = rng.normal(0, 0.1, (u, DIM)).astype(np.float32)
    rows[:5] = 0.0                                           # new rows: the floor decides
    grads = rng.normal(0, 0.05, (u, DIM)).astype(np.float32)
    counts = rng.integers(1, 5, u)
    want, clipped = grads.copy(), 0
    for i in range(u):
        g = [float(x) for x in grads[i]]
        norm = sum(x * x for x in g) ** 0.5
        limit = ratio * max(sum(float(x) ** 2 for x in rows[i]) ** 0.5, floor) * counts[i] / n
        if norm > limit:
            want[i] = [x * limit / norm for x in g]
            clipped += 1
    got = grads.copy()
    assert clip_rows(got, rows, counts, n, ratio, floor) == clipped
    assert 5 < clipped < u - 5                               # both kinds of rows are here
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    keep = got.copy()
    assert clip_rows(got, rows, counts, n, 0.0, floor) == 0  # off: untouched
    np.testing.assert_array_equal(got, keep)


def test_push_rules_merge_and_scale_against_plain_python():
    """mpips.tables.push (shared by servers, trainer and simulator): ``each`` keeps the parts
    apart and scales each by its own examples; ``none``/``count`` scale by the step's
    examples and sum per id, ``count`` with each row's lr factor = the parts holding it.
    Against a plain-Python dict of sums."""
    from mpips.tables import push
    rng = np.random.default_rng(3)
    keys = [np.unique(rng.integers(0, 40, size=rng.integers(1, 25))) for _ in range(4)]
    grads = [rng.normal(size=(len(k), 3)).astype(np.float32) for k in keys]
    own = [5, 2, 7, 1]
    for rule in push.RULES:
        parts = [(k, g.copy()) for k, g in zip(keys, grads)]
        for (_, g), n in zip(parts, own):
            assert push.scale(rule, g, n, sum(own)) == (n if rule == "each" else sum(own))
        out = push.merge(rule, parts)
        if rule == "each":
            assert len(out) == 4
            for (k, g, lr), k0, g0, n in zip(out, keys, grads, own):
                assert lr is None and k is k0
                np.testing.assert_array_equal(g, g0 * np.float32(1.0 / n))
            continue
        want, held = {}, {}
        for k0, g0 in zip(keys, grads):
            for key, row in zip(k0.tolist(), g0 * np.float32(1.0 / sum(own))):
                want[key] = want.get(key, 0) + row.astype(np.float64)
                held[key] = held.get(key, 0) + 1
        [(k, g, lr)] = out
        assert k.tolist() == sorted(want)
        np.testing.assert_allclose(g, [want[x] for x in k.tolist()], rtol=1e-6)
        if rule == "count":
            assert lr.tolist() == [float(held[x]) for x in k.tolist()]
        else:
            assert lr is None
    assert push.merge("none", []) == [] and push.merge("each", []) == []
