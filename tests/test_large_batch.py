"""--large-batch cowclip (CowClip, Zheng et al. 2022): k = G / --large-batch-base, the rows'
lr unchanged, the dense lr --lr x k^dense (default x k) warmed up linearly over its first N
dense steps, an L2 of l2 x k on each pushed row and each row's gradient (of the batch's mean loss)
clipped to norm count x max(r |row|, zeta).

The update of a one-process Trainer under the rule is checked step by step against a
reference in numpy and a Python dict of rows: a stand-in model returns known dense and
per-occurrence embedding gradients, and plain SGD makes every update a closed form."""
import math

import numpy as np
import pytest

from mpips.config import parse_args, parse_large_batch
from mpips.data.reader import Batch
from mpips.job.build import dense_lr, large_batch_rule, make_tables
from mpips.job.plan import make_plan, trainer_settings
from mpips.job.tracking import identity
from mpips.tables.ownership import plan_keys
from mpips.worker.local import LocalPS
from mpips.worker.trainer import Trainer, cowclip_rows

P, DIM, SLOTS = 6, 4, 2
SIZES = (3, 5, 2, 4, 3, 5)                # examples of each step's batch
LR, BASE, G = 0.5, 2, 8                   # k = 4: dense lr LR x 2
RULE = "cowclip:r=5,zeta=0.01,l2=0.02,warmup=3,dense=0.75"     # dense lr LR x 4^0.75


def reference_rows(grad_sum, ids, counts, rows, n, r, zeta, l2):
    """CowClip per id, a loop over a dict of rows: the mean-loss gradient (the sum over
    the id's ``counts`` occurrences / n) plus 2 l2 w, clipped to count x max(r |w|, zeta)."""
    out = {}
    for j, key in enumerate(ids):
        w = rows[key].astype(np.float64)
        g = grad_sum[j].astype(np.float64) / n + 2 * l2 * w
        limit = counts[j] * max(r * np.linalg.norm(w), zeta)
        norm = np.linalg.norm(g)
        out[key] = g * (limit / norm if norm > limit else 1.0)
    return out


def test_cowclip_rows_against_a_loop_over_ids():
    rng = np.random.default_rng(1)
    n, u = 6, 7
    rows = rng.uniform(-0.05, 0.05, (u, DIM)).astype(np.float32)
    rows[3] = 0.0                                     # |w| = 0: the floor zeta decides
    counts = np.array([1, 3, 2, 1, 5, 1, 2])
    grad_sum = (rng.normal(size=(u, DIM)) * counts[:, None]).astype(np.float32)
    rule = large_batch_rule(parse_args(["--large-batch", "cowclip:r=2,zeta=0.05,l2=0.1",
                                        "--large-batch-base", "4", "--global-batch", "8",
                                        "--local"]), [8])
    assert (rule.k, rule.l2, rule.r, rule.zeta) == (2.0, pytest.approx(0.2), 2.0, 0.05)
    assert rule.dense_scale == 2.0                    # k^1
    g = grad_sum / np.float32(n)
    clipped = cowclip_rows(g, rows, counts, n, rule)
    want = reference_rows(grad_sum, range(u), counts, dict(enumerate(rows)), n, 2.0, 0.05,
                          0.2)
    np.testing.assert_allclose(g, np.array([want[j] for j in range(u)]), rtol=2e-6,
                               atol=1e-9)
    limits = counts * np.maximum(2.0 * np.linalg.norm(rows, axis=1), 0.05)
    norms = np.linalg.norm(grad_sum / n + 2 * 0.2 * rows, axis=1)
    assert clipped == int((norms > limits).sum()) and 0 < clipped < u
    assert np.linalg.norm(g[3]) == pytest.approx(counts[3] * 0.05, rel=1e-6)   # the floor


class Model:
    """Dense gradient of step t: (t + 1) g; per-occurrence embedding gradients: a fixed
    random draw per step (rows of the batch's (n x slots, dim) in example order)."""
    row_dim, n_sparse, n_params, pooling = DIM, SLOTS, P, "sum"
    n_tasks, task_names, head = 1, (), None          # one label
    g = np.array([1.0, -2.0, 0.5, 3.0, -1.0, 0.25], np.float32)

    def __init__(self):
        self.t = 0
        self.emb_grads = []

    def init_params(self, seed):
        return np.linspace(-1, 1, P).astype(np.float32)

    def forward_backward(self, params, emb, dense, label, grad_dense, grad_emb, scale):
        grad_dense[:] = (self.t + 1) * self.g
        draw = np.random.default_rng(100 + self.t).normal(size=grad_emb.shape)
        grad_emb[:] = draw.astype(np.float32)
        self.emb_grads.append(grad_emb.reshape(-1, DIM).copy())
        self.t += 1
        return 0.5, np.full(len(label), 0.5, np.float32)


def test_a_local_epoch_under_the_rule_against_numpy():
    cfg = parse_args(["--local", "--optimizer", "sgd", "--lr", str(LR), "--global-batch",
                      str(G), "--large-batch", RULE, "--large-batch-base", str(BASE)])
    rule = make_plan(cfg).cowclip                 # resolved once, at the run's G
    assert rule.k == G / BASE
    model = Model()
    sparse, dense = make_tables(cfg, model, cowclip=rule)
    assert dense.opt.lr == pytest.approx(LR * 4 ** 0.75) and sparse.opt.lr == LR   # k^0.75, 1
    fresh, _ = make_tables(cfg, model, cowclip=rule)   # the same seed: the rows' first values
    ps = LocalPS(sparse, dense)
    trainer = Trainer(trainer_settings(cfg, rule), model, ps, lambda ids: plan_keys(ids, 1),
                      replica=ps.dense)
    rng = np.random.default_rng(0)
    batches = [Batch(dense=np.zeros((n, 1), np.float32),
                     sparse=rng.integers(0, 12, (n, SLOTS)).astype(np.int64),
                     label=np.zeros(n, np.float32)) for n in SIZES]
    init = model.init_params(0).astype(np.float64)
    st = trainer.train_epoch(batches, 0)
    assert st.steps == len(SIZES)

    rows, w = {}, init.copy()
    k, spec = G / BASE, parse_large_batch(RULE)
    for t, (b, n) in enumerate(zip(batches, SIZES)):
        ids = b.sparse.reshape(-1)
        for key in np.unique(ids):
            if key not in rows:
                out = np.empty((1, DIM), np.float32)
                fresh.pull(np.array([key], np.int64), out, create=True)
                rows[key] = out[0].astype(np.float64)
        uniq, inverse, cnt = np.unique(ids, return_inverse=True, return_counts=True)
        grad_sum = np.zeros((len(uniq), DIM))
        np.add.at(grad_sum, inverse, model.emb_grads[t])
        upd = reference_rows(grad_sum, uniq, cnt, rows, n, spec["r"], spec["zeta"],
                             spec["l2"] * k)
        for key, g in upd.items():
            rows[key] = rows[key] - LR * g
        warm = min(1.0, (t + 1) / spec["warmup"])
        w = w - LR * k ** spec["dense"] * warm * (t + 1) * Model.g.astype(np.float64) / n
    np.testing.assert_allclose(dense.values, w, rtol=1e-5)
    keys = np.array(sorted(rows), np.int64)
    got = np.empty((len(keys), DIM), np.float32)
    sparse.pull(keys, got, create=False)
    np.testing.assert_allclose(got, np.array([rows[key] for key in sorted(rows)]),
                               rtol=1e-4, atol=1e-6)
    clipped, pushed = trainer.clipped
    assert 0 < clipped < pushed                   # the clip both bit and let rows through
    assert trainer.clip_summary() == {"row_clip_frac": clipped / pushed, "large_batch_k": 4.0,
                                     "large_batch_dense": 0.75}


def test_the_flag_its_forms_and_the_runs_it_refuses():
    assert parse_large_batch("none") is None
    assert parse_large_batch("cowclip") == {"r": 1.0, "zeta": 1e-5, "l2": 1e-5, "warmup": 20,
                                            "dense": 1.0}
    assert parse_large_batch("cowclip:l2=0,warmup=5")["warmup"] == 5
    for bad in ("lamb", "auto:r=1", "cowclip:r=0", "cowclip:q=1", "cowclip:warmup=1.5", "none:r=1",
                "cowclip:l2=-1", "cowclip:r=x", "cowclip:dense=-1", "cowclip:dense=3"):
        with pytest.raises(ValueError, match="--large-batch must be"):
            parse_large_batch(bad)
    for extra, why in ((["--mode", "geo"], "geo"), (["--row-clip", "3"], "--row-clip"),
                       (["--dense-lr-scale", "2"], "--dense-lr-scale"),
                       (["--sync-sparse-lr", "none"], "use each"),
                       (["--large-batch-base", "0"], ">= 1")):
        with pytest.raises(ValueError, match=why):
            parse_args(["--large-batch", "cowclip"] + extra)
    # the plan resolves k once from the global batch in force: --global-batch, or W x
    # --batch-size; the dense rate, the start line and the trainer read its rule
    plan = make_plan(parse_args(["--local", "--fc", "8", "--local-workers", "8",
                                 "--large-batch", "cowclip", "--global-batch", "32768"]))
    assert plan.cowclip.k == 8 and dense_lr(plan.cfg, 8, plan.cowclip) == pytest.approx(8e-3)
    for power, scale in ((0.5, math.sqrt(8)), (0, 1.0), (0.75, 8 ** 0.75)):    # dense: k's power
        rule = large_batch_rule(parse_args(["--large-batch", f"cowclip:dense={power}"]), [32768])
        assert rule.dense_scale == pytest.approx(scale) and rule.dense == power
        assert dense_lr(plan.cfg, 8, rule) == pytest.approx(1e-3 * scale)
    plan = make_plan(parse_args(["--local", "--fc", "8", "--local-workers", "8",
                                 "--large-batch", "cowclip", "--batch-size", "2048"]))
    assert plan.cowclip == large_batch_rule(plan.cfg, [2048] * 8)
    assert dense_lr(plan.cfg, 8, plan.cowclip) == pytest.approx(1e-3 * 4)
    assert plan.cowclip.l2 == pytest.approx(4e-5)
    assert plan.rule_line() == (
        "mpips: large batch: cowclip at k = 16384 / 4096 = 4: dense lr 0.004 (--lr x k^1) "
        "warmed up over 20 dense steps, rows' lr 0.001, rows' L2 4e-05, rows clipped to "
        "count x max(1 |row|, 1e-05)")
    assert trainer_settings(plan.cfg, plan.cowclip).cowclip is plan.cowclip
    for unresolved in (lambda: dense_lr(plan.cfg, 8), lambda: trainer_settings(plan.cfg)):
        with pytest.raises(ValueError, match="pass the rule the run's plan resolved"):
            unresolved()
    assert large_batch_rule(parse_args(["--large-batch", "none"]), [32768]) is None
    assert make_plan(parse_args(["--local", "--fc", "8"])).cowclip is None
    cfg = plan.cfg
    assert (identity(cfg)["large_batch"], identity(cfg)["large_batch_base"]) == ("cowclip", 4096)
    assert "large_batch" not in identity(parse_args([]))       # every record names the rule


def test_auto_applies_the_rule_from_8_x_the_base_where_it_was_measured():
    """--large-batch auto (the default): CowClip with its defaults from a global batch of
    AUTO_K x --large-batch-base on, with --global-batch or one worker, and flags that allow
    it; off elsewhere, and the start line says why where the batch alone would call for it."""
    from mpips.config import AUTO_K, Config
    assert Config().large_batch == "auto" and parse_large_batch("auto") is None and AUTO_K == 8

    def plan(*flags):
        return make_plan(parse_args(["--local", "--fc", "8", *flags]))
    one = plan("--batch-size", "32768")                         # one worker at 8 x 4096
    assert one.cowclip == large_batch_rule(parse_args(["--large-batch", "cowclip"]), [32768])
    assert one.cowclip.k == 8 and dense_lr(one.cfg, 1, one.cowclip) == pytest.approx(8e-3)
    assert one.rule_line().startswith("mpips: large batch: cowclip (auto: the global batch is "
                                      "at least 8 x --large-batch-base) at k = 32768 / 4096 = 8")
    assert trainer_settings(one.cfg, one.cowclip).cowclip is one.cowclip
    assert "large_batch" not in identity(one.cfg)     # the record: large_batch_k, per epoch
    shared = plan("--local-workers", "8", "--global-batch", "65536")
    assert shared.cowclip.k == 16
    small = plan("--batch-size", "16384")                       # below 8 x the base
    assert small.cowclip is None and small.rule_line() is None
    assert dense_lr(small.cfg, 1, None) == 1e-3 and trainer_settings(small.cfg).cowclip is None
    assert plan("--batch-size", "8192", "--large-batch-base", "1024").cowclip.k == 8
    for flags, why in ((["--local-workers", "8", "--batch-size", "4096"],
                        "8 workers x --batch-size 4096"),
                       (["--batch-size", "32768", "--row-clip", "3"], "--row-clip"),
                       (["--batch-size", "32768", "--dense-lr-scale", "2"], "--dense-lr-scale")):
        off = plan(*flags)
        assert off.cowclip is None
        assert off.rule_line().startswith("mpips: large batch: auto leaves cowclip off: ")
        assert why in off.rule_line()
