"""--pull-after exchange (async, workers): a step's push goes out before the dense exchange
starts and the next step's pull once it ends, so that pull reads every worker's push of the
step; --pull-after push (the default) sends the pull in the push's message.

In one process: a LocalPS and a one-worker stand-in of the dense exchange record the order
of the calls; the trained weights and rows equal the default order's (one worker: the same
rows are read either way).  Real 2 x W runs: docs/studies/scaling-with-w.md."""
import numpy as np
import pytest

from mpips.config import Config
from mpips.data.reader import Batch
from mpips.job.plan import trainer_settings
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.ownership import plan_keys
from mpips.tables.sparse import SparseTable
from mpips.worker.local import LocalPS
from mpips.worker.trainer import Trainer
from tests.test_dense_lag import DIM, SIZES, Model, OneWorker


class Logged(OneWorker):
    def __init__(self, log):
        self.log = log

    def start(self, grad_sum, n, more, step, stop=False):
        self.log.append(("start", step))
        super().start(grad_sum, n, more, step)

    def finish(self, acc):
        self.log.append(("finish",))
        return super().finish(acc)


class LoggedPS(LocalPS):
    def __init__(self, log, *a):
        super().__init__(*a)
        self.log = log

    def pull(self, plan, out, dense_out=None, step=0, **kw):
        self.log.append(("pull", step))
        return super().pull(plan, out, dense_out, step, **kw)

    def push(self, plan, grads, dense_grad=None, step=0, **kw):
        self.log.append(("push", step))
        return super().push(plan, grads, dense_grad, step, **kw)

    def push_pull(self, push_plan, grads, pull_plan, out, step, counts=None):
        self.log.append(("push_pull", step))
        return super().push_pull(push_plan, grads, pull_plan, out, step, counts)


def run(**order):
    log, adam = [], OptimizerConfig(name="adam", lr=0.1)
    replica = DenseTable(np.linspace(-1, 1, Model.n_params).astype(np.float32), adam)
    ps = LoggedPS(log, SparseTable(DIM, adam, seed=0),
                  DenseTable(np.zeros(1, np.float32), adam))
    model = Model()
    model.forward_backward = lambda params, emb, dense, label, gd, ge, scale: (
        gd.__setitem__(slice(None), params[:Model.n_params] + 1.0),
        ge.__setitem__(slice(None), emb - 0.5), (0.5, np.full(len(label), 0.5, np.float32)))[-1]
    trainer = Trainer(trainer_settings(Config()), model, ps, lambda ids: plan_keys(ids, 1),
                      replica=replica, dense_sync=Logged(log), **order)
    rng = np.random.default_rng(0)
    batches = [Batch(dense=np.zeros((n, 1), np.float32),
                     sparse=rng.integers(0, 6, (n, 2)).astype(np.int64),
                     label=np.zeros(n, np.float32)) for n in SIZES]
    assert trainer.train_epoch(batches, 0).steps == len(SIZES)
    rows = ps.sparse.export_rows()
    return log, replica.values.copy(), rows["keys"], rows["values"]


def test_pull_late_pushes_before_the_exchange_and_pulls_after_it():
    log, dense, keys, values = run(pull_late=True)
    want = [("pull", 0)]
    for t in range(len(SIZES)):
        want += [("push", t), ("start", t), ("finish",)]
        want += [("pull", t + 1)] if t + 1 < len(SIZES) else []
    assert log == want
    log0, dense0, keys0, values0 = run(coalesce=True)          # the default order
    finishes = [i for i, e in enumerate(log0) if e == ("finish",)]
    for t in range(len(SIZES) - 1):             # there the pull goes with the push, in the
        assert log0.index(("push_pull", t)) < finishes[t]        # exchange, not after it
        assert log0.index(("pull", t + 1)) < finishes[t]
    np.testing.assert_array_equal(dense, dense0)
    np.testing.assert_array_equal(keys, keys0)
    np.testing.assert_array_equal(values, values0)


def test_pull_late_wants_workers_and_excludes_the_other_orders():
    with pytest.raises(ValueError, match="one at most"):
        run(pull_late=True, coalesce=True)
    adam = OptimizerConfig(name="adam", lr=0.1)
    ps = LocalPS(SparseTable(DIM, adam, seed=0), DenseTable(np.zeros(1, np.float32), adam))
    with pytest.raises(ValueError, match="workers only"):
        Trainer(trainer_settings(Config()), Model(), ps, lambda ids: plan_keys(ids, 1),
                replica=DenseTable(np.zeros(Model.n_params, np.float32), adam), pull_late=True)
    with pytest.raises(ValueError, match="--pull-after exchange is for --mode async"):
        Config(pull_after="exchange", mode="sync").validate()


def test_auto_pulls_after_the_exchange_from_four_async_workers():
    from mpips.job.plan import pull_after
    auto = Config()
    assert [pull_after(auto, W) for W in (1, 2, 3, 4, 8, 64)] == (
        ["push"] * 3 + ["exchange"] * 3)
    assert pull_after(Config(pull_after="exchange"), 2) == "exchange"
    assert pull_after(Config(pull_after="exchange"), 1) == "push"       # no exchange to wait for
    assert pull_after(Config(pull_after="push"), 8) == "push"
    for other in (Config(mode="sync"), Config(mode="ssp"), Config(overlap_pull=True),
                  Config(dense_lag=1)):
        assert pull_after(other, 8) == "push"


def test_the_start_line_says_which_order_is_in_force():
    import dataclasses
    from mpips.job.plan import make_plan
    plan = make_plan(Config(global_batch=4096, train="", test=""))
    line = dataclasses.replace(plan, workers=8).pull_line()
    assert "after the dense exchange" in line and "--pull-after auto at 8 workers" in line
    line = dataclasses.replace(plan, workers=2).pull_line()
    assert "in the push's message" in line and "auto at 2 workers" in line
    assert dataclasses.replace(plan, workers=1).pull_line() is None
    sync = make_plan(Config(mode="sync", train="", test=""))
    assert dataclasses.replace(sync, workers=8).pull_line() is None
