"""The worker's training and evaluation loops, the same for local and distributed runs.

`ps` is a PSClient (MPI) or a LocalPS (one process); the loop does not know which: both
follow ``mpips.worker.interfaces.ParamStore``.

A step takes one *group* of batches: a distributed worker's own batch (or none, when it ran
out of data before the others), or, in one process with ``--local-workers W``, the W
batches that W workers would take.  Each batch gets its own forward/backward (gradients of
its summed loss); the step's update is from the mean over all the step's examples:
- dense weights: a replica on every worker (mpips.worker.dense_sync), updated every step
  from the workers' gradients added in worker order (each worker updates its shard, then
  the shards are shared; one process adds its parts in the same order);
- sparse rows: on the servers; a batch's rows are scaled by 1 / (examples they average over)
  and pushed.  async/ssp: scaled by the worker's own examples, applied on arrival; sync:
  by the step's examples over all workers, which the servers sum in worker order.
So ``--local --local-workers W`` computes exactly what W sync workers and the servers do.

Step ordering (step t uses batch t):
- async with --overlap-pull (distributed): the pull of batch t+1 is sent before batch t is
  computed, so the next rows arrive while this batch computes (sparse rows one step stale
  per worker);
- async (default), sync, ssp, local: the pull of batch t+1 is sent after the push of batch
  t; the servers decide when to answer it (sync: after step t was applied by all workers).
Every worker takes part in every step until no worker has data left (a worker without a
batch contributes no examples, and sends empty pushes; in sync mode empty pulls too).
"""
import time
from dataclasses import dataclass, field

import numpy as np

from mpips.kernels.embedding import gather_rows, scatter_add_rows, sum_duplicates
from mpips.kernels.pooling import pool_backward, pool_forward
from mpips.metrics import BinaryMetrics
from mpips.tables.ownership import KeyPlan
from mpips.comm.protocol import Op
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.tables.staleness import parts_holding
from mpips.worker.dense_sync import DenseStep


@dataclass
class EpochStats:
    examples: int = 0
    steps: int = 0
    loss_sum: float = 0.0          # sum over examples of the loss
    seconds: float = 0.0
    compute_s: float = 0.0
    metrics: BinaryMetrics = field(default_factory=BinaryMetrics)
    extra: dict = field(default_factory=dict)   # facts of the run for the record (the backend's)
    stopped: bool = False          # ended early at a step boundary: should_stop() said so


TIMES = ("read", "plan", "gather", "fwd_bwd", "scatter", "metrics", "send", "dense_wait",
         "dense_opt")


class _Prepared:
    """A batch with its key plan and a buffer for its pulled rows."""
    __slots__ = ("batch", "plan", "rows", "counts")

    def __init__(self, batch, plan, dim, with_counts):
        self.batch, self.plan = batch, plan
        self.rows = np.empty((len(plan.keys), dim), dtype=np.float32)   # (u, dim)
        self.counts = None                                                # (u, 1) occurrences
        if with_counts:
            self.counts = np.bincount(plan.inverse, minlength=len(plan.keys)).astype(
                np.float32).reshape(-1, 1)


def check_bags(batch, n_slots):
    """Raise ValueError unless a CSR batch's offsets fit its ids and ``n_slots`` slots (the
    pooling kernels index with them unchecked)."""
    off, n = batch.offsets, len(batch.label)
    if (off.shape != (n * n_slots + 1,) or off[0] != 0 or off[-1] != batch.sparse.shape[0]
            or batch.sparse.ndim != 1 or (n and np.any(off[1:] < off[:-1]))):
        raise ValueError(f"a batch of {n} examples over {n_slots} slots needs offsets "
                         f"({n * n_slots + 1},) from 0 to len(ids), non-decreasing; got "
                         f"offsets {off.shape} ending at {off[-1] if len(off) else None} "
                         f"for ids {batch.sparse.shape}")


def clip_rows(grads, rows, counts, n, ratio, floor):
    """CowClip-style: clip in place each row of ``grads`` (u, dim), the gradient of a loss
    averaged over ``n`` examples, so that its mean over the row's ``counts`` occurrences
    (u,) (that is, grads x n / counts) has norm at most ``ratio x max(|rows|, floor)``;
    ``rows`` (u, dim) are the values the gradient was computed at.  Returns the number of
    rows clipped."""
    if ratio <= 0 or not len(grads):
        return 0
    gn = np.sqrt(np.einsum("ij,ij->i", grads, grads, dtype=np.float64))
    wn = np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))
    limit = ratio * np.maximum(wn, floor) * counts / n
    over = gn > limit
    if over.any():
        grads[over] *= (limit[over] / gn[over]).astype(np.float32)[:, None]
    return int(over.sum())


class _Done:
    def wait(self):
        return self


class _Handles:
    """Several handles waited for together."""

    def __init__(self, handles):
        self.handles = handles

    def wait(self):
        for h in self.handles:
            h.wait()
        return self


class Trainer:
    """Runs epochs of CTR-DNN training against a parameter store `ps`.

    replica: DenseTable of all dense weights (this worker's replica; in one process the
    table itself); dense_sync: a DenseAllgather among the workers, or None in one process
    (or with one worker); overlap: async --overlap-pull (pull t+1 before computing t);
    sync: the servers apply steps BSP (sync mode, ssp with staleness 0).
    """

    def __init__(self, cfg, model, ps, plan_fn, log=None, overlap=False, replica=None,
                 dense_sync=None, sync=False):
        self.cfg, self.model, self.ps = cfg, model, ps
        self.plan_fn = plan_fn                    # ids -> KeyPlan for ps's servers
        self.log = log                            # callable(str) on the logging worker, else None
        self.overlap, self.sync = overlap, sync
        self.dim = model.row_dim                  # table row width (dim, or dim + 1 with w)
        P = model.n_params
        self.replica, self.dense_sync = replica, dense_sync
        if replica is not None:
            self.params = [replica.values]        # the live weights: every update lands there
            self.acc = (DenseStep(replica) if dense_sync is None else
                        DenseStep(replica, dense_sync.lo, dense_sync.hi))
        else:                                     # GEO keeps its own dense copy
            self.params = [np.zeros(P, np.float32)]
        self.grad_dense = np.zeros(P, np.float32)
        self.compute_s = 0.0       # gather + fwd_bwd + scatter
        # seconds per phase of a training step (with ps.wait_s, the whole loop): reading
        # and parsing a batch, dedup + key plan, embedding gather, forward/backward,
        # gradient scatter-add, AUC buckets, pull/push calls (message packing and sends,
        # or the table work itself for a LocalPS)
        self.times = dict.fromkeys(TIMES, 0.0)
        self.step_delay = 0.0      # seconds slept per step: slows one worker in tests
        self.stretch = 0.0         # benchmarks: sleep this fraction of each step's compute
        self.on_step = None        # callable(done, phase_steps) after each step (mid-epoch saves)
        self.examples_done = None  # at on_step: (this process's examples in the phase, all
                                   # workers' when a summed dense step counts them, else None)
        self.should_stop = None    # callable() -> bool: this worker was asked to stop (a
                                   # signal); with a dense exchange every worker hears of it
                                   # with the step's gradients, and all end the epoch there
        self.progress = None       # mpips.job.progress.Progress of this phase (first worker) or None
        self.on_report = None      # callable(step, loss, auc) at each TRAIN line (TensorBoard)
        self._emb = self._grad_emb = None
        self._empty = None
        self.clipped = [0, 0]      # --row-clip: rows clipped, rows pushed

    def _stop_asked(self):
        return self.should_stop is not None and bool(self.should_stop())

    def times_line(self, who):
        """One line with this worker's seconds per step phase (``self.times``) and wait."""
        parts = " ".join(f"{k}_s: {v:.2f}" for k, v in self.times.items())
        return f"TIMES --> {who} {parts} wait_s: {self.ps.wait_s:.2f}"

    def _report(self, epoch, step, st):
        """TRAIN line every --print-every steps; the PROGRESS line when it is due."""
        if self.progress is not None:
            self.progress.tick(st.examples, st.loss_sum)
        if self.log and st.examples and step % self.cfg.print_every == 0:
            if self.progress is not None:
                self.progress.clear()
            self.log(f"TRAIN --> pass: {epoch} batch: {step} loss: {st.loss_sum / st.examples:.6f}"
                     f" auc: {st.metrics.auc():.6f}")
            if self.on_report is not None:
                self.on_report(step, st.loss_sum / st.examples, st.metrics.auc())

    def _prepare(self, batch):
        if batch is None:
            return None
        t0 = time.perf_counter()
        if batch.offsets is not None:
            check_bags(batch, self.model.n_sparse)
        prep = _Prepared(batch, self.plan_fn(batch.sparse), self.dim, bool(self.cfg.entry))
        self.times["plan"] += time.perf_counter() - t0
        return prep

    def _pull(self, prep, step, dense_buf, create=True):
        counts = prep.counts if create else None
        t0 = time.perf_counter()
        h = self.ps.pull(prep.plan, prep.rows, dense_buf, step=step, create=create,
                         counts=counts)
        self.times["send"] += time.perf_counter() - t0
        return h

    def _buffers(self, n_rows):
        """Reused (n_rows, dim) buffers for the gathered embeddings and their gradients."""
        if self._emb is None or self._emb.shape[0] < n_rows:
            self._emb = np.empty((n_rows, self.dim), np.float32)
            self._grad_emb = np.empty((n_rows, self.dim), np.float32)
        return self._emb[:n_rows], self._grad_emb[:n_rows]

    def _slots(self, b):
        return b.sparse.shape[1] if b.offsets is None else self.model.n_sparse

    def _embed(self, prep, emb):
        """The model input's embedding part into emb (B*slots, dim): one row per slot
        (one-hot batch) or each slot's bag pooled (CSR batch)."""
        b = prep.batch
        if b.offsets is None:
            gather_rows(prep.rows, prep.plan.inverse, emb)
        else:
            pool_forward(prep.rows, prep.plan.inverse, b.offsets, self.model.pooling,
                         emb.reshape(len(b.label), -1))

    def _step_math(self, prep, params, scale=None):
        """Forward/backward of one batch; returns (mean loss, probs, row grads (u, dim)).

        Gradients of the mean loss (scale None), or of scale x the summed loss."""
        b = prep.batch
        n = len(b.label)
        tm = self.times
        t0 = time.perf_counter()
        emb, grad_emb = self._buffers(n * self._slots(b))                  # (B*slots, dim)
        self._embed(prep, emb)
        t1 = time.perf_counter()
        loss, probs = self.model.forward_backward(params, emb.reshape(n, -1), b.dense, b.label,
                                                  self.grad_dense, grad_emb.reshape(n, -1),
                                                  scale)
        t2 = time.perf_counter()
        grads = np.empty_like(prep.rows)                                    # (u, dim)
        if b.offsets is None:                                               # zero grads first
            scatter_add_rows(grad_emb, prep.plan.inverse, grads)
        else:
            pool_backward(grad_emb.reshape(n, -1), prep.plan.inverse, b.offsets,
                          self.model.pooling, grads)
        tm["scatter"] += time.perf_counter() - t2
        tm["fwd_bwd"] += t2 - t1
        tm["gather"] += t1 - t0
        return loss, probs, grads

    # ---- one step's pieces
    def _group(self, it, done, max_steps):
        """The next step's batches (a list: one per part; empty when this worker is done),
        after `done` batches of the epoch (--max-steps counts batches skipped on resume)."""
        if max_steps and done >= max_steps:
            return []
        t0 = time.perf_counter()
        item = next(it, None)
        self.times["read"] += time.perf_counter() - t0
        if item is None:
            return []
        return [self._prepare(b) for b in (item if isinstance(item, list) else [item])]

    def _empty_prep(self):
        if self._empty is None:
            self._empty = _Prepared(None, self.plan_fn(np.empty(0, np.int64)), self.dim, False)
        return self._empty

    def _pull_group(self, group, step, more):
        """Pull the rows of every part (in part order: admission counts in worker order).
        A sync worker without a batch sends an empty pull while others go on."""
        if not group and self.sync and self.dense_sync is not None and more:
            group = [self._empty_prep()]
        if not group:
            return _Done()
        return _Handles([self._pull(p, step, None) for p in group])

    def clip(self, p, g, n):
        """--row-clip on a part's row gradients g (averaged over n examples), counted."""
        if self.cfg.row_clip > 0:
            counts = np.bincount(p.plan.inverse, minlength=len(p.plan.keys))
            self.clipped[0] += clip_rows(g, p.rows, counts, n, self.cfg.row_clip,
                                         self.cfg.row_clip_floor)
            self.clipped[1] += len(g)

    def clip_summary(self):
        """{"row_clip_frac": the share of this trainer's pushed rows --row-clip clipped}, or
        {} when it is off: for the epoch record."""
        if self.cfg.row_clip <= 0:
            return {}
        return {"row_clip_frac": self.clipped[0] / max(self.clipped[1], 1)}

    def _push(self, parts, examples, step):
        """Scale each part's row gradients by 1 / examples and push them (one process: the
        parts' rows summed per id in part order, as the servers sum the workers'; with
        --sync-sparse-lr each, every part is scaled by its own examples and pushed on its
        own, in part order, as sync servers apply the workers' pushes)."""
        if not parts:
            if self.dense_sync is None:
                return _Done()
            p = self._empty_prep()                 # keeps sync/ssp servers' step count
            return self.ps.push(p.plan, p.rows, step=step)
        if self.cfg.sync_sparse_lr == "each":      # (one part: the same as the sum below)
            for p, g in parts:
                g *= np.float32(1.0 / len(p.batch.label))
                self.clip(p, g, len(p.batch.label))
                done = self.ps.push(p.plan, g, step=step)
            return done
        inv = np.float32(1.0 / examples)
        for p, g in parts:
            g *= inv
            self.clip(p, g, examples)
        if len(parts) == 1:
            return self.ps.push(parts[0][0].plan, parts[0][1], step=step)
        every = np.concatenate([p.plan.keys for p, _ in parts])
        keys, grads = sum_duplicates(every, np.concatenate([g for _, g in parts]))
        plan = KeyPlan(keys, None, np.array([0, len(keys)], np.int64))
        if self.cfg.sync_sparse_lr == "count":          # as the sync servers do
            return self.ps.push(plan, grads, step=step, lr_scale=parts_holding(every, keys))
        return self.ps.push(plan, grads, step=step)

    def train_epoch(self, batches, epoch, max_steps=0, skip=0):
        """Train over an iterable of Batch, or of lists of Batch (one per part), after
        skipping `skip` of them (trained before a resume); return this worker's EpochStats."""
        if self.replica is None:
            raise ValueError("Trainer.train_epoch needs the dense weights it trains: pass "
                             "replica= (a DenseTable of all of them; in one process ps.dense)")
        st = EpochStats()
        it = iter(batches)
        for _ in range(skip):
            next(it, None)
        t_start = time.perf_counter()
        params, sync_d, acc = self.params[0], self.dense_sync, self.acc
        acc.noise_reset()                          # this epoch's noise scale (DenseStep)
        # sync servers sum a step's pushes (rows scaled by the step's examples) unless
        # --sync-sparse-lr each: then each push is a step of its own (rows scaled by the
        # worker's examples), as async pushes are
        summed = self.sync and self.cfg.sync_sparse_lr != "each"
        if max_steps and skip >= max_steps:        # --max-steps counts the skipped batches
            return st
        cur = self._group(it, skip, max_steps)
        h = self._pull_group(cur, 0, True)
        push = _Done()
        step = 0
        every = 0 if sync_d is not None else None  # all workers' examples (dense steps sum them)
        while True:
            nxt = self._group(it, skip + step + 1, max_steps)
            h.wait()
            if self.overlap and nxt:
                h = self._pull_group(nxt, step + 1, True)
            if sync_d is not None:                 # the last step's weights, whole again
                td0 = time.perf_counter()
                sync_d.wait_shared()
                self.times["dense_wait"] += time.perf_counter() - td0
            t0 = time.perf_counter()
            parts, n_here = [], 0
            if sync_d is None:
                acc.reset()
            for p in cur:
                loss, probs, grads = self._step_math(p, params, 1.0)
                n = len(p.batch.label)
                n_here += n
                st.loss_sum += loss * n
                tm0 = time.perf_counter()
                st.metrics.update(probs, p.batch.label)
                self.times["metrics"] += time.perf_counter() - tm0
                parts.append((p, grads))
                if sync_d is None:
                    acc.add(n, self.grad_dense)
            dt = time.perf_counter() - t0
            self.compute_s += dt
            if self.stretch:
                time.sleep(self.stretch * dt)
            st.examples += n_here
            push.wait()
            ts0 = time.perf_counter()
            if sync_d is None:
                more = bool(nxt)
                push = self._push(parts, n_here, step)
            else:
                sync_d.start(self.grad_dense, n_here, bool(nxt), step, self._stop_asked())
                if not summed:                     # rows averaged over this worker
                    push = self._push(parts, n_here, step)
                td0 = time.perf_counter()
                self.times["send"] += td0 - ts0
                more = sync_d.finish(acc)
                every += acc.examples
                ts0 = time.perf_counter()
                self.times["dense_wait"] += ts0 - td0
                if summed:                         # sync: over the step's examples
                    push = self._push(parts, acc.examples, step)
            self.times["send"] += time.perf_counter() - ts0
            td0 = time.perf_counter()
            acc.apply()
            if sync_d is not None:
                sync_d.share(params)
            self.times["dense_opt"] += time.perf_counter() - td0
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.on_step is not None:           # (batches done in the epoch, in this phase)
                self.examples_done = (st.examples, every)
                self.on_step(skip + step + 1, step + 1)
            if more and (sync_d.stopping if sync_d is not None else self._stop_asked()):
                more, st.stopped = False, True
                if self.overlap and nxt:           # the next step's rows, pulled ahead
                    h.wait()
            if not self.overlap and more:
                h = self._pull_group(nxt, step + 1, more)
            step += 1
            self._report(epoch, step, st)
            cur = nxt
            if not more:
                break
        if sync_d is not None:
            sync_d.wait_shared()
        push.wait()
        st.steps = step
        st.seconds = time.perf_counter() - t_start
        return st

    def evaluate(self, batches, max_steps=0):
        """Predict over an iterable of Batch with the current parameters (no rows created).

        With a dense replica its weights are used; otherwise (GEO) the servers' are pulled."""
        m = BinaryMetrics()
        params = self.params[0]
        it = iter(batches)
        cur = self._prepare(next(it, None))
        if cur is None:
            return m
        h = self._pull(cur, 0, params if self.replica is None else None, create=False)
        step = 0
        while cur is not None:
            step += 1
            nxt = None if max_steps and step >= max_steps else self._prepare(next(it, None))
            h.wait()
            if nxt is not None:
                h = self._pull(nxt, 0, None, create=False)
            b = cur.batch
            n = len(b.label)
            emb = np.empty((n * self._slots(b), self.dim), np.float32)
            self._embed(cur, emb)
            probs = np.empty(n, np.float32)
            self.model.predict(params, emb.reshape(n, -1), b.dense, probs)
            m.update(probs, b.label)
            cur = nxt
        return m


class GeoTrainer(Trainer):
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
        super().__init__(cfg, model, ps, plan_fn, log, overlap=False)
        self.scale = np.float32(1.0 / n_workers)     # Paddle scales GEO deltas by 1/trainers
        self.opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr,
                                   initial_accumulator=cfg.adagrad_init)
        self.local = SparseTable(model.row_dim, self.opt, cfg.seed, cfg.init_range)
        self.base = SparseTable(model.row_dim, OptimizerConfig(name="sgd"), cfg.seed,
                                cfg.init_range)
        self.dense_local = None     # DenseTable with the local optimizer state
        self.dense_base = None      # (P,) dense values at the last sync
        self.touched = []           # [(unique keys, occurrences)] of the round's batches
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

    def train_epoch(self, batches, epoch, max_steps=0, skip=0):
        st = EpochStats()
        t_start = time.perf_counter()
        params = self.params[0]
        step = 0
        it = iter(batches)
        for _ in range(skip):
            next(it, None)
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
        st.steps = step
        st.seconds = time.perf_counter() - t_start
        return st

    def _local_step(self, prep, params, st):
        """One optimizer step on the local copy (sparse rows and dense weights)."""
        self.local.pull(prep.plan.keys, prep.rows, create=True)
        self.base.pull(prep.plan.keys, np.empty_like(prep.rows), create=True)
        t0 = time.perf_counter()
        loss, probs, grads = self._step_math(prep, params)
        self.local.push(prep.plan.keys, grads)                  # local optimizer step
        self.dense_local.push(self.grad_dense)
        self.dense_local.pull(params)
        self.compute_s += time.perf_counter() - t0
        occ = prep.counts[:, 0] if prep.counts is not None else np.ones(len(prep.plan.keys),
                                                                        np.float32)
        self.touched.append((prep.plan.keys, occ))
        n = len(prep.batch.label)
        st.examples += n
        st.loss_sum += loss * n
        st.metrics.update(probs, prep.batch.label)

    def evaluate(self, batches, max_steps=0):
        m = super().evaluate(batches, max_steps)
        if self.dense_local is not None:      # evaluate pulled the servers' dense weights
            self.dense_base[:] = self.params[0]
            self.dense_local.assign(self.params[0])
        return m
