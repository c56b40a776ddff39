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

GEO-SGD trains locally and sends deltas every K steps: ``mpips.worker.geo.GeoTrainer``, a
sibling of ``Trainer`` on the same ``StepMath`` (key plans, forward/backward, evaluation,
the epoch's bookkeeping).
"""
import time
from dataclasses import dataclass, field

import numpy as np

from mpips.kernels.embedding import gather_rows, scatter_add_rows
from mpips.metrics import BinaryMetrics, Stopwatch
from mpips.models.zoo import metrics_for
from mpips.tables import push as push_rules
from mpips.tables.ownership import KeyPlan
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


# phases of a training step, in seconds on the TIMES line (with ps.wait_s, the whole loop):
# reading and parsing a batch, dedup + key plan, embedding gather, forward/backward,
# gradient scatter-add, AUC buckets, pull/push calls (message packing and sends, or the
# table work itself for a LocalPS), waiting for the workers' dense gradients or weights,
# the dense optimizer step
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


def cowclip_rows(grads, rows, counts, n, rule):
    """``--large-batch cowclip`` on a push's row gradients ``grads`` (u, dim), the gradient
    of a loss averaged over ``n`` examples, in place: add the gradient of the L2 penalty
    ``rule.l2 x |row|^2`` (2 l2 row; ``rows`` (u, dim) the values the gradient was computed
    at), then clip each row so that its norm is at most ``counts x max(rule.r |row|,
    rule.zeta)``, ``counts`` (u,) its occurrences in the batch (CowClip's column-wise clip,
    on the batch's mean loss as its authors' code takes it).  Returns the rows clipped."""
    if rule.l2:
        grads += np.float32(2.0 * rule.l2) * rows
    return clip_rows(grads, rows, counts, n, rule.r * n, rule.zeta / rule.r)


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


class StepMath:
    """What the trainers share: a batch's key plan and pull, its forward/backward against
    the pulled rows, evaluation, the TRAIN/PROGRESS lines and an epoch's bookkeeping.

    params: (P,) float32, the dense weights the model computes with.  A subclass trains an
    epoch in ``_epoch``.
    """
    replica = dense_sync = None   # Trainer: the dense replica and its exchange (None: GEO)

    def __init__(self, cfg, model, ps, plan_fn, params, log=None):
        self.cfg, self.model, self.ps = cfg, model, ps
        self.plan_fn = plan_fn                    # ids -> KeyPlan for ps's servers
        self.log = log                            # callable(str) on the logging worker, else None
        self.dim = model.row_dim                  # table row width (dim, or dim + 1 with w)
        self.params = [params]                    # the live weights: every update lands there
        self.grad_dense = np.zeros(model.n_params, np.float32)
        # seconds per phase (TIMES), "compute" (the steps' forward/backward, metrics and
        # local updates: gather + fwd_bwd + scatter + metrics and more) and "epoch"
        self.watch = Stopwatch(TIMES + ("compute", "epoch"))
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
        self.clipped = [0, 0]      # --row-clip, --large-batch: rows clipped, rows pushed

    def settle(self):
        """Complete what a step left in flight (``LateTrainer``: the dense step applied one
        step late), before a save or a replica check; nothing here."""

    def _stop_asked(self):
        return self.should_stop is not None and bool(self.should_stop())

    @property
    def compute_s(self):
        """Seconds of the steps' computation so far."""
        return self.watch.seconds["compute"]

    def times_line(self, who):
        """One line with this worker's seconds per step phase (TIMES) and wait."""
        parts = " ".join(f"{k}_s: {self.watch.seconds[k]:.2f}" for k in TIMES)
        return f"TIMES --> {who} {parts} wait_s: {self.ps.wait_s:.2f}"

    def clip_summary(self):
        """{"row_clip_frac": the share of this trainer's pushed rows --row-clip (or
        --large-batch cowclip) clipped, and with cowclip its "large_batch_k" and the power
        of k its dense rate takes, "large_batch_dense"}, or {} when neither is on: for the
        epoch record."""
        if self.cfg.row_clip <= 0 and self.cfg.cowclip is None:
            return {}
        rule = self.cfg.cowclip
        k = {} if rule is None else {"large_batch_k": rule.k, "large_batch_dense": rule.dense}
        return {"row_clip_frac": self.clipped[0] / max(self.clipped[1], 1), **k}

    def train_epoch(self, batches, epoch, max_steps=0, skip=0):
        """Train over an iterable of Batch (Trainer: or of lists of Batch, one per part),
        after skipping `skip` of them (trained before a resume); return this worker's
        EpochStats.  max_steps: stop after this many batches of the epoch (the skipped
        ones count)."""
        st = EpochStats(metrics=self.new_metrics())
        it = iter(batches)
        for _ in range(skip):
            next(it, None)
        with self.watch("epoch"):
            st.steps = self._epoch(it, epoch, st, max_steps, skip)
        st.seconds = self.watch.last
        return st

    def _epoch(self, it, epoch, st, max_steps, skip):
        """Train the epoch's batches from `it` into `st`; return the steps taken."""
        raise NotImplementedError

    def _report(self, epoch, step, st):
        """TRAIN line every --print-every steps; the PROGRESS line when it is due."""
        if self.progress is not None:
            self.progress.tick(st.examples, st.loss_sum)
        if self.log and st.examples and step % self.cfg.print_every == 0:
            if self.progress is not None:
                self.progress.clear()
            tasks = "".join(f" {n} auc: {m.auc():.6f}"
                            for n, m in getattr(st.metrics, "tasks", {}).items())
            self.log(f"TRAIN --> pass: {epoch} batch: {step} loss: {st.loss_sum / st.examples:.6f}"
                     f" auc: {st.metrics.auc():.6f}" + (f" |{tasks}" if tasks else ""))
            if self.on_report is not None:
                self.on_report(step, st.loss_sum / st.examples, st.metrics.auc())

    def _prepare(self, batch):
        if batch is None:
            return None
        with self.watch("plan"):
            if batch.offsets is not None:
                check_bags(batch, self.model.n_sparse)
            return _Prepared(batch, self.plan_fn(batch.sparse), self.dim, bool(self.cfg.entry))

    def _pull(self, prep, step, dense_buf, create=True):
        counts = prep.counts if create else None
        with self.watch("send"):
            return self.ps.pull(prep.plan, prep.rows, dense_buf, step=step, create=create,
                                counts=counts)

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
            self.model.pool(prep.rows, prep.plan.inverse, b.offsets,
                            emb.reshape(len(b.label), -1))

    def _step_math(self, prep, params, scale=None):
        """Forward/backward of one batch; returns (mean loss, probs, row grads (u, dim)).

        Gradients of the mean loss (scale None), or of scale x the summed loss."""
        b = prep.batch
        n = len(b.label)
        tm = self.watch
        with tm("gather"):
            emb, grad_emb = self._buffers(n * self._slots(b))              # (B*slots, dim)
            self._embed(prep, emb)
        with tm("fwd_bwd"):
            loss, probs = self.model.forward_backward(params, emb.reshape(n, -1), b.dense,
                                                      b.label, self.grad_dense,
                                                      grad_emb.reshape(n, -1), scale)
        with tm("scatter"):
            grads = np.empty_like(prep.rows)                                # (u, dim)
            if b.offsets is None:                                           # zero grads first
                scatter_add_rows(grad_emb, prep.plan.inverse, grads)
            else:
                self.model.unpool(grad_emb.reshape(n, -1), prep.plan.inverse, b.offsets,
                                  grads)
        return loss, probs, grads

    def new_metrics(self):
        """Empty metrics for this model's predictions (per task with several labels)."""
        return metrics_for(self.model)

    def evaluate(self, batches, max_steps=0):
        """Predict over an iterable of Batch with the current parameters (no rows created):
        with --dense-average, the dense weights' moving average, the trained weights'
        metrics beside them in the result's ``raw``."""
        return self._evaluate(batches, max_steps, None)

    def eval_weights(self):
        """The dense weights to evaluate: [the moving average (whole on this worker: see
        ``DistBackend.evaluate``), the trained weights] with --dense-average, else
        [the trained weights]."""
        rep = self.replica
        if rep is None or not rep.average:
            return [self.params[0]]
        return [rep.averaged, self.params[0]]

    def _evaluate(self, batches, max_steps, dense_out):
        """evaluate(), the first pull also filling ``dense_out`` (the servers' dense
        weights) when it is not None."""
        ms = [self.new_metrics() for _ in self.eval_weights()]
        self.eval_metrics = ms             # one per eval_weights() vector (bench_average.py)
        if len(ms) > 1:
            ms[0].raw = ms[1]
        it = iter(batches)
        cur = self._prepare(next(it, None))
        if cur is None:
            return ms[0]
        h = self._pull(cur, 0, dense_out, create=False)
        weights = self.eval_weights()      # (after the pull: GEO's are the servers')
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
            for params, m in zip(weights, ms):
                probs = np.empty(b.label.shape, np.float32)              # (B,) or (B, T)
                self.model.predict(params, emb.reshape(n, -1), b.dense, probs)
                m.update(probs, b.label)
            cur = nxt
        return ms[0]


class Trainer(StepMath):
    """Runs epochs of CTR-DNN training against a parameter store `ps`, a step at a time.

    replica: DenseTable of all dense weights (this worker's replica; in one process the
    table itself); dense_sync: a DenseAllgather among the workers, or None in one process
    (or with one worker); overlap: async --overlap-pull (pull t+1 before computing t);
    sync: the servers apply steps BSP (sync mode, ssp with staleness 0); coalesce: async
    and ssp over MPI, the pull of t+1 goes in the push of t's message (``ps.push_pull``);
    pull_late: async with workers (``--pull-after exchange``), the push of t goes out before
    the dense exchange starts and the pull of t+1 once it ends, so that pull reads every
    worker's push of t (the exchange waits for all of them) at a second message a server.
    """

    def __init__(self, cfg, model, ps, plan_fn, log=None, overlap=False, replica=None,
                 dense_sync=None, sync=False, coalesce=False, pull_late=False):
        if replica is None:
            raise ValueError("Trainer needs the dense weights it trains: pass replica= (a "
                             "DenseTable of all of them; in one process ps.dense)")
        super().__init__(cfg, model, ps, plan_fn, replica.values, log)
        if (coalesce or pull_late) and (overlap or sync or (coalesce and pull_late)):
            raise ValueError("Trainer: coalesce and pull_late are two orders of async and ssp's "
                             "pull after the push; one at most, not with overlap or sync")
        if pull_late and dense_sync is None:
            raise ValueError("Trainer: pull_late waits for the dense exchange: workers only")
        self.overlap, self.sync, self.pull_late = overlap, sync, pull_late
        self.coalesce = coalesce        # async/ssp over MPI: step t's push and step t+1's
                                        # pull in one message a server (ps.push_pull)
        self.replica, self.dense_sync = replica, dense_sync
        self.acc = (DenseStep(replica) if dense_sync is None else
                    DenseStep(replica, dense_sync.lo, dense_sync.hi))
        if cfg.cowclip is not None:                     # --large-batch: the dense warm-up
            self.acc.warmup = cfg.cowclip.warmup
        self._empty = None

    # ---- one step's pieces
    def _group(self, it, done, max_steps):
        """The next step's batches (a list: one per part; empty when this worker is done),
        after `done` batches of the epoch (--max-steps counts batches skipped on resume)."""
        if max_steps and done >= max_steps:
            return []
        with self.watch("read"):
            item = next(it, None)
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

    def _timed_compute(self, group, params, st, tm):
        """`_compute` under the "compute" stopwatch, stretched by the slow-worker debug hook
        (sleep `stretch` x its time), its examples counted into `st`."""
        with tm("compute"):
            parts, n_here = self._compute(group, params, st)
        if self.stretch:
            time.sleep(self.stretch * tm.last)
        st.examples += n_here
        return parts, n_here

    def _compute(self, group, params, st):
        """Forward/backward of the step's parts: ([(part, row grads of its summed loss)],
        the step's examples here); loss and metrics into `st`; in one process (no dense
        exchange) the parts' dense gradients into the dense step."""
        parts, n_here = [], 0
        one_process = self.dense_sync is None
        if one_process:
            self.acc.reset()
        for p in group:
            loss, probs, grads = self._step_math(p, params, 1.0)
            n = len(p.batch.label)
            n_here += n
            st.loss_sum += loss * n
            with self.watch("metrics"):
                st.metrics.update(probs, p.batch.label)
            parts.append((p, grads))
            if one_process:
                self.acc.add(n, self.grad_dense)
        return parts, n_here

    def clip(self, p, g, n):
        """--row-clip, or --large-batch cowclip's L2 and clip, on a part's row gradients g
        (averaged over n examples), counted."""
        rule = self.cfg.cowclip
        if self.cfg.row_clip > 0 or rule is not None:
            counts = np.bincount(p.plan.inverse, minlength=len(p.plan.keys))
            self.clipped[0] += (cowclip_rows(g, p.rows, counts, n, rule) if rule is not None
                                else clip_rows(g, p.rows, counts, n, self.cfg.row_clip,
                                               self.cfg.row_clip_floor))
            self.clipped[1] += len(g)

    def _push(self, parts, examples, step, ahead=()):
        """Push the step's parts' row gradients (of each part's summed loss), scaled and
        combined by the --sync-sparse-lr rule (``mpips.tables.push``; one part alone is
        pushed with its own key plan).  `examples`: the step's examples.  `ahead`: the
        next step's group, pulled in the same message as a one-part push (``coalesce``:
        the handle then stands for both)."""
        if not parts:
            if self.dense_sync is None:
                return _Done()
            p = self._empty_prep()                 # keeps sync/ssp servers' step count
            return self.ps.push(p.plan, p.rows, step=step)
        rule = self.cfg.sync_sparse_lr
        for p, g in parts:
            self.clip(p, g, push_rules.scale(rule, g, len(p.batch.label), examples))
        if len(parts) == 1 and len(ahead) == 1:
            [(p, g)], [q] = parts, ahead
            return self.ps.push_pull(p.plan, g, q.plan, q.rows, step, counts=q.counts)
        if push_rules.apart(rule) or len(parts) == 1:
            for p, g in parts:
                done = self.ps.push(p.plan, g, step=step)
            return done
        [(keys, grads, lr_scale)] = push_rules.merge(rule, [(p.plan.keys, g) for p, g in parts])
        plan = KeyPlan(keys, None, np.array([0, len(keys)], np.int64))   # one process
        return self.ps.push(plan, grads, step=step, lr_scale=lr_scale)

    def _exchange(self, parts, n_here, nxt, step):
        """Send the step's pushes and, among workers, its dense gradient (reduced in
        shards: mpips.worker.dense_sync); returns (the last push's handle, whether any
        worker has a next step).  Sync servers that sum the step's pushes want rows scaled
        by the step's examples over all workers, known once the dense exchange is done.
        ``coalesce``: the next step's group ``nxt`` is pulled with the push (the push's
        handle is its pull's too)."""
        sync_d, tm, more = self.dense_sync, self.watch, bool(nxt)
        ahead = nxt if self.coalesce else ()
        if sync_d is None:
            with tm("send"):
                return self._push(parts, n_here, step, ahead), more
        summed = self.sync and not push_rules.apart(self.cfg.sync_sparse_lr)
        push = _Done()
        with tm("send"):
            if self.pull_late:                     # out before the exchange can end
                push = self._push(parts, n_here, step)
            sync_d.start(self.grad_dense, n_here, more, step, self._stop_asked())
            if not (summed or self.pull_late):     # rows averaged over this worker
                push = self._push(parts, n_here, step, ahead)
        with tm("dense_wait"):
            more = sync_d.finish(self.acc)
        if summed:                                 # sync: over the step's examples
            with tm("send"):
                push = self._push(parts, self.acc.examples, step)
        return push, more

    def _epoch(self, it, epoch, st, max_steps, skip):
        params, sync_d, acc, tm = self.params[0], self.dense_sync, self.acc, self.watch
        acc.noise_reset()                          # this epoch's noise scale (DenseStep)
        if max_steps and skip >= max_steps:        # --max-steps counts the skipped batches
            return 0
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
                with tm("dense_wait"):
                    sync_d.wait_shared()
            parts, n_here = self._timed_compute(cur, params, st, tm)
            push.wait()
            push, more = self._exchange(parts, n_here, nxt, step)
            ahead = self.coalesce and len(parts) == 1 and len(nxt) == 1
            if ahead:                              # the next rows come with the push
                h = push
            elif self.pull_late and more:          # every worker's push of this step sent
                h = self._pull_group(nxt, step + 1, more)
            ahead = ahead or self.pull_late
            if sync_d is not None:
                every += acc.examples
            with tm("dense_opt"):
                acc.apply()
                if sync_d is not None:
                    sync_d.share(params)
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.on_step is not None:           # (batches done in the epoch, in this phase)
                self.examples_done = (st.examples, every)
                self.on_step(skip + step + 1, step + 1)
            if more and (sync_d.stopping if sync_d is not None else self._stop_asked()):
                more, st.stopped = False, True
                if (self.overlap or ahead) and nxt:     # the next step's rows, pulled ahead
                    h.wait()
            if not (self.overlap or ahead) and more:
                h = self._pull_group(nxt, step + 1, more)
            step += 1
            self._report(epoch, step, st)
            cur = nxt
            if not more:
                break
        if sync_d is not None:
            sync_d.wait_shared()
        push.wait()
        return step
