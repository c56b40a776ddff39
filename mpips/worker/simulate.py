"""One process emulating W workers of a real 2-server run, deterministically.

``python -m mpips.train --local --simulate-workers W [--sim-delay D] [--sim-sparse async|sync]``
gives the figures of W workers (16, 32, 64, ...) that one machine cannot run.  The model:

- **Data**: read as W workers would, exactly as ``--local-workers W`` does: worker k reads
  ``worker_files(files, W, k)`` in its own batches; global step t takes batch t of every
  worker that still has one (a worker that ran out contributes nothing, as a real one).
- **Dense weights**: as in the real modes: one dense step per global step from the W
  workers' dense gradients added in worker order, at the dense learning rate of W workers
  (``mpips.job.build.dense_lr``); this is the Trainer's own ``DenseStep``.
- **Sparse rows**, ``--sim-sparse async`` (default): each worker's row gradients are scaled
  by 1 / its own examples and applied as a separate push, in worker order (an async server
  applies pushes on arrival).  Delay D (default 0: a real async worker sends its pull of
  step t+1 after its push of step t; 1: with ``--overlap-pull`` it sends it before it
  computes step t): at global step t the rows a worker
  computes with were read from the table before the pushes of steps t-D .. t-1 were applied
  (D = 0: after all pushes of step t-1).  The pulls of one step are issued in worker order,
  before that step's pushes when D >= 1 (:func:`run_schedule`).
- ``--sim-sparse sync``: the step's pushes as sync servers apply them under
  ``--sync-sparse-lr`` (``none``: the row gradients summed per id in worker order, scaled by
  1 / the step's examples, one push; ``each``, the default: as async with D = 0).  With
  D = 0 this is ``--local --local-workers W``, bit for bit.

Pulls and pushes carry ``worker=k`` and ``step=t``, so a LocalPS built with a staleness
tracker counts what the servers of a real run count (and applies ``--stale-lr``).
"""
import collections

from mpips.tables import push as push_rules
from mpips.worker.trainer import EpochStats

SPARSE = ("async", "sync")      # --sim-sparse: a push per worker on arrival, or summed per step


def run_schedule(steps, delay, pull, step):
    """Drive the global steps with each step's rows read ``delay`` steps early.

    steps: iterable of global steps (each a list of one worker's parts, in worker order);
    pull(t, parts): read step t's rows from the table as it is now; step(t, parts):
    compute step t from what was read and apply its pushes.  The pulls of step t are issued
    just before the pushes of step t - delay (for t < delay: before any push), so step t's
    rows miss the pushes of steps t - delay .. t - 1.  Returns the number of steps taken."""
    pending = collections.deque()       # (t, parts) pulled, not yet stepped: <= delay + 1
    it = iter(steps)
    done = read = 0
    while True:
        while len(pending) <= delay:
            parts = next(it, None)
            if parts is None:
                break
            pull(read, parts)
            pending.append(parts)
            read += 1
        if not pending:
            return done
        step(done, pending.popleft())
        done += 1


class SparseSchedule:
    """The simulated workers' sparse pulls and pushes against a ParamStore ``ps``.

    A part is ``(worker k, prep)``: prep has ``plan`` (KeyPlan), ``rows`` (u, dim) filled by
    the pull and ``counts`` (occurrences for admission, or None), like the Trainer's
    ``_Prepared``.  ``push_sum(parts, examples, step)`` is the sync push (the Trainer's
    ``_push``: parts' grads scaled, then summed per id in part order); ``clip(part, grads,
    n)`` is the Trainer's ``--row-clip`` of an async push (None: no clipping)."""

    def __init__(self, ps, delay=1, sparse="async", push_sum=None, clip=None):
        if sparse not in SPARSE or delay < 0 or (sparse == "sync" and push_sum is None):
            raise ValueError(f"SparseSchedule: sparse in {SPARSE} (sync with push_sum), "
                             f"delay >= 0; got {sparse!r}, {delay}")
        self.ps, self.delay, self.sparse, self.push_sum = ps, delay, sparse, push_sum
        self.clip = clip            # clip(part, grads, n): the Trainer's --row-clip, or None

    def pull(self, t, parts):
        for k, p in parts:
            self.ps.pull(p.plan, p.rows, None, step=t, create=True, counts=p.counts,
                         worker=k)

    def push(self, t, parts, grads, examples):
        """Apply step t's row grads (of each part's summed loss; scaled in place)."""
        if self.sparse == "sync":
            self.push_sum([(p, g) for (_, p), g in zip(parts, grads)], sum(examples), t)
            return
        for (k, p), g, n in zip(parts, grads, examples):    # as async servers apply them:
            if n:                                             # the "each" rule, on arrival
                push_rules.scale("each", g, n, sum(examples))
                if self.clip is not None:
                    self.clip(p, g, n)
                self.ps.push(p.plan, g, step=t, worker=k)

    def run(self, steps, grad, after=None):
        """Run the schedule; grad(t, parts) -> (row grads of each part's summed loss (u,
        dim), each part's examples), from the rows its pull read; after(t) once step t's
        pushes are applied.  Returns the number of steps."""
        def step(t, parts):
            self.push(t, parts, *grad(t, parts))
            if after is not None:
                after(t)
        return run_schedule(steps, self.delay, self.pull, step)


class Simulator:
    """Trains epochs of W simulated workers with a one-process ``Trainer`` (its model,
    LocalPS, dense replica and step maths): ``train_epoch`` takes steps of ``[(k, Batch)]``."""

    def __init__(self, trainer, delay=1, sparse="async"):
        if trainer.replica is None or trainer.dense_sync is not None:
            raise ValueError("Simulator needs a one-process Trainer with its dense replica")
        self.trainer = trainer
        self.sched = SparseSchedule(trainer.ps, delay, sparse, trainer._push, trainer.clip)

    def _prepared(self, steps, max_steps):
        """The steps' parts [(k, _Prepared)], at most max_steps of them (0: all)."""
        tr, it, t = self.trainer, iter(steps), 0
        while not (max_steps and t >= max_steps):
            with tr.watch("read"):
                group = next(it, None)
            if group is None:
                return
            yield [(k, tr._prepare(b)) for k, b in group]
            t += 1

    def train_epoch(self, steps, epoch, max_steps=0):
        """One epoch over ``steps`` (lists of (worker, Batch), worker order); EpochStats."""
        tr = self.trainer
        st = EpochStats(metrics=tr.new_metrics())
        params, acc = tr.params[0], tr.acc
        acc.noise_reset()                          # this epoch's noise scale (DenseStep)

        def grad(t, parts):
            with tr.watch("compute"):
                acc.reset()
                grads, examples = [], []
                for _, p in parts:
                    loss, probs, g = tr._step_math(p, params, 1.0)
                    n = len(p.batch.label)
                    st.loss_sum += loss * n
                    st.metrics.update(probs, p.batch.label)
                    acc.add(n, tr.grad_dense)
                    grads.append(g)
                    examples.append(n)
            st.examples += sum(examples)
            acc.apply()
            return grads, examples

        def after(t):
            if tr.on_step is not None:
                tr.on_step(t + 1, t + 1)
            tr._report(epoch, t + 1, st)

        with tr.watch("epoch"):
            st.steps = self.sched.run(self._prepared(steps, max_steps), grad, after)
            reset = getattr(getattr(tr.ps, "tracker", None), "reset", None)
            if reset is not None:                  # a phase ends: forget its pulls
                reset()
        st.seconds = tr.watch.last
        return st
