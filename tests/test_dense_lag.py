"""--dense-lag 1 (mpips.worker.late): each step computes at the weights that miss the last
step's dense gradients, every gradient is applied once, and the epoch ends with all of them.

In one process, against a closed form: a stand-in model records the weights each step
computes with and returns known dense gradients; plain SGD on the dense weights gives the
weights after each step exactly.  The exchange among workers is a one-worker stand-in with
the interface of ``DenseExchange`` (the real one runs in the 2x2 job of
tests/test_modes.py, whose replicas are checked equal every epoch)."""
import numpy as np

from mpips.config import Config
from mpips.data.reader import Batch
from mpips.job.plan import trainer_settings
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.ownership import plan_keys
from mpips.tables.sparse import SparseTable
from mpips.worker.late import LateTrainer
from mpips.worker.local import LocalPS
from mpips.worker.trainer import Trainer

P, DIM, LR = 6, 4, 0.25
SIZES = (3, 5, 2, 4, 3)           # examples of each step's batch


class Model:
    """Records the weights of each forward/backward; dense gradient of step t: (t + 1) g."""
    row_dim, n_sparse, n_params, pooling = DIM, 2, P, "sum"
    n_tasks, task_names, head = 1, (), None          # one label
    g = np.array([1.0, -2.0, 0.5, 3.0, -1.0, 0.25], np.float32)

    def __init__(self):
        self.seen = []

    def forward_backward(self, params, emb, dense, label, grad_dense, grad_emb, scale):
        grad_dense[:] = (len(self.seen) + 1) * self.g
        grad_emb[:] = 0.0
        self.seen.append(params.copy())
        return 0.5, np.full(len(label), 0.5, np.float32)


class OneWorker:
    """A DenseExchange of one worker: its gradient comes back to it."""
    lo, hi, stopping = 0, P, False

    def start(self, grad_sum, n, more, step, stop=False):
        self.sent = (grad_sum.copy(), n, more)

    def finish(self, acc):
        grads, n, more = self.sent
        acc.reset()
        acc.add(n, grads)
        return more

    def start_late(self, grad_sum, n, more, step, stop, values):
        self.start(grad_sum, n, more, step)

    finish_late = finish

    def share(self, values):
        pass

    def wait_shared(self):
        pass


def run(cls, settle_after=None):
    model, sgd = Model(), OptimizerConfig(name="sgd", lr=LR)
    init = np.linspace(-1, 1, P).astype(np.float32)
    replica = DenseTable(init, sgd)
    ps = LocalPS(SparseTable(DIM, sgd, seed=0), DenseTable(np.zeros(1, np.float32), sgd))
    trainer = cls(trainer_settings(Config()), model, ps, lambda ids: plan_keys(ids, 1),
                  replica=replica, dense_sync=OneWorker(), coalesce=True)
    if settle_after is not None:         # a save mid-epoch: the step in flight applied
        trainer.on_step = lambda done, _: trainer.settle() if done == settle_after else None
    rng = np.random.default_rng(0)
    batches = [Batch(dense=np.zeros((n, 1), np.float32),
                     sparse=rng.integers(0, 20, (n, 2)).astype(np.int64),
                     label=np.zeros(n, np.float32)) for n in SIZES]
    st = trainer.train_epoch(batches, 0)
    return init, model.seen, replica.values.copy(), st


def sgd_steps(init):
    """The weights after 0, 1, ..., len(SIZES) steps: the kernel's SGD in float64, stored
    as float32 (what mpips.kernels.optim.sgd_rows does)."""
    out = [init]
    for t, n in enumerate(SIZES):
        step = LR * (1.0 / n)
        g = ((t + 1) * Model.g).astype(np.float64)
        out.append((out[-1].astype(np.float64) - step * g).astype(np.float32))
    return out


def test_late_steps_compute_at_weights_one_step_old_and_apply_every_gradient():
    init, seen, final, st = run(LateTrainer)
    after = sgd_steps(init)
    assert st.steps == len(SIZES) and st.examples == sum(SIZES)
    want = [after[0]] + [after[t - 1] for t in range(1, len(SIZES))]   # one step late
    for t, (got, w) in enumerate(zip(seen, want)):
        np.testing.assert_array_equal(got, w, err_msg=f"step {t}")
    np.testing.assert_array_equal(final, after[-1])      # every gradient, once


def test_a_save_mid_epoch_applies_the_step_in_flight():
    """Settled after step 1 (two steps done), step 2 computes at the weights of every
    gradient so far; from step 3 the weights are one step late again."""
    init, seen, final, st = run(LateTrainer, settle_after=2)
    after = sgd_steps(init)
    for t, w in enumerate([after[0], after[0], after[2], after[2], after[3]]):
        np.testing.assert_array_equal(seen[t], w, err_msg=f"step {t}")
    np.testing.assert_array_equal(final, after[-1])


def test_the_plain_trainer_computes_at_the_last_steps_weights():
    init, seen, final, st = run(Trainer)
    after = sgd_steps(init)
    for t, got in enumerate(seen):
        np.testing.assert_array_equal(got, after[t], err_msg=f"step {t}")
    np.testing.assert_array_equal(final, after[-1])
