"""GEO-SGD (Paddle's a_sync k_steps, ``--mode geo``): a worker trains a local copy and sends
its deltas every K steps.

A sibling of ``mpips.worker.trainer.Trainer`` on the same ``StepMath`` (key plans, the
forward/backward, evaluation, the epoch's bookkeeping and TIMES).  Its step loop is its
own, for a reason: a Trainer step pulls rows, computes, and pushes gradients to the
servers' optimizer, with the dense weights a replica stepped by ``DenseStep`` from all
workers' gradients; a GEO step talks to no one (the local tables take the optimizer step,
the dense weights are this worker's alone), and the servers hear from it once per round
of K steps, with deltas added as they are (``Op.ADD``).  So there is no replica to check
and no per-step exchange to share: the pieces that are the same are in StepMath.
"""
import numpy as np

from mpips.comm.protocol import Op
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.worker.trainer import StepMath


class GeoTrainer(StepMath):
    """GEO-SGD (Paddle's a_sync k_steps): local training, deltas sent every K steps.

    The worker trains a local copy of the rows it touches and of the dense weights with
    the configured optimizer (Paddle requires SGD for GEO; `--optimizer sgd` is exactly
    Paddle's GEO-SGD, adam/adagrad keep their state locally on the worker).  Training runs
    in rounds of K batches (shorter before a `--save-every` point and at the end).  Before
    a round the worker reads its batches and pulls the servers' rows of the ids new to its
    local copy (after a resume, or ids another worker created, they are not the initial
    values).  After a round it sends, for the ids touched in it, `(local - base) / W`
    (base = the values at the last sync; W workers, as Paddle's GEO communicator scales)
    and the dense delta; servers add them; the worker pulls the fresh values (in the same
    request as the next round's new ids) and makes them its new local and base values
    (local optimizer state is kept).  With `--entry` the pull carries each touched id's
    occurrences in the round, so admission counts occurrences as in the other modes;
    until an id is admitted its deltas are dropped and it reads zeros.
    """

    def __init__(self, cfg, model, ps, plan_fn, log=None, n_workers=1):
        super().__init__(cfg, model, ps, plan_fn, np.zeros(model.n_params, np.float32), log)
        self.scale = np.float32(1.0 / n_workers)     # Paddle scales GEO deltas by 1/trainers
        self.opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr,
                                   initial_accumulator=cfg.adagrad_init)
        self.local = SparseTable(model.row_dim, self.opt, cfg.seed, cfg.init_range)
        self.base = SparseTable(model.row_dim, OptimizerConfig(name="sgd"), cfg.seed,
                                cfg.init_range)
        self.dense_local = None     # DenseTable with the local optimizer state
        self.dense_base = None      # (P,) dense values at the last sync
        self.touched = []           # [(unique keys, occurrences)] of the round's batches
        self._avg = None            # --dense-average: a DenseTable of the servers' state
        self.save_every = 0 if cfg.stream or not cfg.save_dir else cfg.save_steps

    def _round_length(self, done, max_steps):
        """Batches in the round starting after `done` batches of the epoch (0: stop)."""
        n = self.cfg.geo_steps
        if self.save_every:
            n = min(n, self.save_every - done % self.save_every)
        if max_steps:
            n = min(n, max_steps - done)
        return max(n, 0)

    def _new_ids(self, round_):
        """Unique ids of the round's batches that the local copy does not hold yet."""
        if not round_:
            return np.empty(0, np.int64)
        keys = np.unique(np.concatenate([p.plan.keys for p in round_]))
        return keys[self.local.rows_of(keys) < 0]

    def _sync(self, step, new_ids):
        """Send deltas of touched ids and dense, then rebase on the servers' values.

        The same pull fetches the servers' rows of `new_ids` (the next round's ids new to
        the local copy; they count no occurrence) and, the first time, the dense weights.
        """
        first = self.dense_local is None
        if not self.touched and not len(new_ids) and not first:
            return
        keys = [k for k, _ in self.touched]
        occ = [c for _, c in self.touched]
        self.touched = []
        sent = self.plan_fn(np.concatenate(keys)) if keys else self.plan_fn(
            np.empty(0, np.int64))
        params = self.params[0]
        h = None
        if keys:
            cur = np.empty((len(sent.keys), self.dim), np.float32)   # (u, dim)
            old = np.empty_like(cur)
            self.local.pull(sent.keys, cur, create=False)
            self.base.pull(sent.keys, old, create=False)
            h = self.ps.push(sent, (cur - old) * self.scale,
                             (params - self.dense_base) * self.scale, step=step, op=Op.ADD)
        plan = self.plan_fn(np.concatenate(keys + [new_ids]))
        counts = None
        if self.cfg.entry:
            w = np.concatenate(occ + [np.zeros(len(new_ids), np.float32)])
            counts = np.bincount(plan.inverse, weights=w, minlength=len(plan.keys)).astype(
                np.float32).reshape(-1, 1)
        fresh = np.empty((len(plan.keys), self.dim), np.float32)
        h2 = self.ps.pull(plan, fresh, params if keys or first else None, step=step,
                          create=True, counts=counts)
        if h is not None:
            h.wait()
        h2.wait()
        self.local.assign(plan.keys, fresh)
        self.base.assign(plan.keys, fresh)
        if first:
            self.dense_base = params.copy()
            self.dense_local = DenseTable(params, self.opt)
        elif keys:
            self.dense_local.assign(params)
            self.dense_base[:] = params

    def _read_round(self, it, n):
        out = []
        for batch in it:
            out.append(self._prepare(batch))
            if len(out) >= n:
                break
        return out

    def _epoch(self, it, epoch, st, max_steps, skip):
        """Rounds of local steps, each round's batches read (and their new ids pulled in
        the sync before it) ahead of it."""
        params = self.params[0]
        step = 0
        n = self._round_length(skip, max_steps)
        round_ = self._read_round(it, n) if n else []
        self._sync(step, self._new_ids(round_))        # (the first time: dense weights too)
        while round_:
            for prep in round_:
                self._local_step(prep, params, st)
                step += 1
                self._report(epoch, step, st)
            full = len(round_) == n
            n = self._round_length(skip + step, max_steps) if full else 0
            round_ = self._read_round(it, n) if n else []
            if round_ and self._stop_asked():
                round_, st.stopped = [], True      # this worker's own stop (GEO: not in step)
            self._sync(step, self._new_ids(round_))
            if self.on_step is not None:           # a save sees this round's deltas
                self.examples_done = (st.examples, None)
                self.on_step(skip + step, step)
        return step

    def _local_step(self, prep, params, st):
        """One optimizer step on the local copy (sparse rows and dense weights)."""
        self.local.pull(prep.plan.keys, prep.rows, create=True)
        self.base.pull(prep.plan.keys, np.empty_like(prep.rows), create=True)
        with self.watch("compute"):
            loss, probs, grads = self._step_math(prep, params)
            self.local.push(prep.plan.keys, grads)              # local optimizer step
            self.dense_local.push(self.grad_dense)
            self.dense_local.pull(params)
        occ = prep.counts[:, 0] if prep.counts is not None else np.ones(len(prep.plan.keys),
                                                                        np.float32)
        self.touched.append((prep.plan.keys, occ))
        n = len(prep.batch.label)
        st.examples += n
        st.loss_sum += loss * n
        st.metrics.update(probs, prep.batch.label)

    def eval_weights(self):
        """The servers' dense weights; with --dense-average their moving average first
        (fetched by :meth:`evaluate`)."""
        return [self.params[0]] if self._avg is None else [self._avg.averaged, self.params[0]]

    def evaluate(self, batches, max_steps=0):
        """Predict with the servers' dense weights (pulled with the first rows; with
        --dense-average their moving average, read with their optimizer state) and the
        rows read from the servers; the local dense copy is re-based on those weights."""
        if self.cfg.dense_average:
            if self._avg is None:
                self._avg = DenseTable(self.params[0], self.opt, self.cfg.dense_average)
            if hasattr(self.ps, "dense_get"):
                self.ps.dense_get(self._avg)        # every server's slice, with its average
            else:                                   # one process: the LocalPS's own table
                self._avg.import_state(self.ps.dense.export_state())
        m = self._evaluate(batches, max_steps, self.params[0])
        if self.dense_local is not None:
            self.dense_base[:] = self.params[0]
            self.dense_local.assign(self.params[0])
        return m
