"""Dense weights replicated on the workers, updated synchronously every step.

The dense MLP is small and every example touches it, so staleness hurts it; the sparse rows
are huge and each is touched rarely.  So (as in PERSIA and Monolith) every worker keeps the
whole dense vector (a :class:`DenseTable` of all P weights, the servers' optimizer code),
and the W workers split the optimizer's work: worker k owns the contiguous shard
``[bounds[k], bounds[k+1])`` (:func:`shard_bounds`).  After each backward:

1. each worker starts ``Ialltoallv``: to worker k it sends ``[its example-summed dense
   gradient on shard k, its example count, whether it has another batch]`` on the workers'
   communicator; the sparse push and the next batch's pull go ahead meanwhile;
2. worker k adds the W gradients of its shard in worker-rank order, skipping workers without
   examples (:class:`DenseStep`), and applies its optimizer to its shard only, with scale
   1 / (the step's examples);
3. each worker starts ``Iallgatherv`` of its updated shard into everyone's weights; it is
   completed just before the next forward, after the next batch is read and its pull waited.

Adam (and Adagrad, SGD) is elementwise, so updating shard by shard gives the same bits as
updating the whole vector: the replicas are identical by construction, and a single process
(``--local --local-workers W``) computes exactly the same numbers by adding its W parts'
gradients in the same order with one whole-vector :class:`DenseStep`.  A sum in a fixed
order, not ``Iallreduce`` (whose result may depend on the algorithm MPI picks), is what
makes that exact.  The bytes moved equal one allreduce's (2 (W-1)/W x P floats a worker);
each worker runs 1/W of the optimizer.  Optimizer state (Adam's m, v) is only current on
its owner's shard; :meth:`DenseExchange.gather_state` makes every replica whole before a
checkpoint or a replica check.  Example weighting makes a short final batch (or a worker
that ran out of data) exact: the update is from the mean gradient over the step's examples.
"""
import time

import numpy as np
from mpi4py import MPI

from mpips.comm.backoff import SPIN
from mpips.comm.liveness import wait_collective, wait_requests
from mpips.tables.dense import dense_fields


NOISE_BLOCK = 20        # DenseStep: steps a block of noise-scale sums holds
NOISE_BLOCKS = 5        # DenseStep.noise(): the last blocks reported (about 100 steps)
ZERO = np.float32(0.0)


def shard_bounds(n, W):
    """Bounds of W contiguous shards of n weights: shard k is [b[k], b[k+1])."""
    return [n * k // W for k in range(W + 1)]


def sq_mean(grad_sum, n):
    """|grad_sum / n|^2: the squared norm of a mean gradient, from its sum over n examples."""
    return float(np.dot(grad_sum, grad_sum)) / float(n) ** 2


def noise_pair(small, big, b, B):
    """McCandlish et al.'s unbiased (|G|^2, tr(Sigma)) from mean |G_b|^2 over batches of b
    examples (``small``; batches of unequal sizes: b their harmonic mean) and |G_B|^2 of
    their union of B examples (``big``)."""
    return (B * big - b * small) / (B - b), (small - big) / (1.0 / b - 1.0 / B)


class DenseStep:
    """Accumulates one step's dense gradient sums on weights [lo, hi) in a fixed order,
    then applies them to that range of the table (the whole table by default).

    It also measures the gradient noise scale (McCandlish et al. 2018, appendix A; why it
    matters: docs/modes.md, "Scaling with W") with no message per step: a step of k >= 2 parts
    of b examples each gives the parts' mean gradients (batch b) and the step's (batch
    B = k b), and from their squared norms the unbiased estimates
    ``|G|^2 = (B |G_B|^2 - b mean|G_b|^2) / (B - b)`` and
    ``tr(Sigma) = (mean|G_b|^2 - |G_B|^2) / (1/b - 1/B)``.  Both are sums over the
    weights, so the workers' shards add up to the whole vector's.  They are summed over
    blocks of NOISE_BLOCK counted steps on [lo, hi) (parts of unequal sizes b_i: b is
    their harmonic mean, which keeps both unbiased);
    :meth:`noise` gives the last NOISE_BLOCKS blocks, and B_noise is the median of the
    blocks' tr(Sigma) / |G|^2 (:func:`mpips.job.report.noise_scale`; a median, so that a few
    steps with a large mean gradient cannot pull it down).  B_noise is the batch beyond
    which more examples per step buy little."""

    warmup = 0          # --large-batch: the dense lr rises linearly over this many steps

    def __init__(self, table, lo=0, hi=None):
        self.table = table                      # DenseTable of all dense weights
        self.applied = 0                        # steps applied (the warm-up's clock)
        self.lo, self.hi = lo, table.size if hi is None else hi
        self.total = np.zeros(self.hi - self.lo, np.float32)
        self.examples = 0
        self._blocks = []                       # per block: [|G|^2, tr(Sigma)] estimate sums
        self._in_block = 0                      # steps counted in the last block
        self._parts = []                        # this step's (n, |mean gradient|^2)

    def reset(self):
        self.examples = 0               # (the step's first part overwrites total)
        self._parts = []

    def add(self, n, grad_sum):
        """Add one part's gradient (on [lo, hi)) of its summed loss over n examples
        (n = 0: nothing)."""
        if n:
            if len(self._parts) == 1:    # a second part: the total so far is the first one
                self._parts[0] = (self._parts[0][0], sq_mean(self.total, self._parts[0][0]))
            if self.examples:
                self.total += grad_sum
            else:                        # 0 + part: the bits of zeroing then adding, one pass
                np.add(ZERO, grad_sum, out=self.total)
            self.examples += int(n)
            # (a step of one part, as every step of one process, takes no dot product)
            self._parts.append((int(n), sq_mean(grad_sum, n) if self._parts else None))

    def apply(self):
        """One optimizer step from the mean gradient; returns the step's examples."""
        if self.examples:
            self._count_noise()
            if self.applied < self.warmup:      # step t = 1..N of a warm-up of N: lr x t / N
                self.table.scale_lr((self.applied + 1) / self.warmup)
            self.applied += 1
            self.table.push_range(self.total, 1.0 / self.examples, self.lo, self.hi)
        return self.examples

    def _count_noise(self):
        k = len(self._parts)
        if k < 2:
            return
        # parts of unequal size (a --global-batch remainder, a short last batch): the mean
        # of |G_bi|^2 has expectation |G|^2 + tr(Sigma) mean(1 / b_i), so b is their
        # harmonic mean and the estimates stay unbiased
        B = sum(n for n, _ in self._parts)
        b = k / sum(1.0 / n for n, _ in self._parts)
        small = sum(sq for _, sq in self._parts) / k
        big = sq_mean(self.total, B)
        if not self._blocks or self._in_block == NOISE_BLOCK:
            self._blocks.append(np.zeros(2, np.float64))
            del self._blocks[:-NOISE_BLOCKS]        # only the last ones are reported
            self._in_block = 0
        self._blocks[-1] += noise_pair(small, big, b, B)
        self._in_block += 1

    def noise_reset(self):
        """Forget the noise-scale sums (an epoch starts)."""
        self._blocks, self._in_block = [], 0

    def noise(self):
        """The last NOISE_BLOCKS blocks' sums, float64 (k, 2): [|G|^2, tr(Sigma)] on
        [lo, hi); every worker counts the same steps, so every worker has the same k."""
        return np.array(self._blocks[-NOISE_BLOCKS:], np.float64).reshape(-1, 2)


class DenseExchange:
    """Worker side of steps 1 and 3: the gradient shards out, the updated weights back."""

    def __init__(self, comm, n_params, timeout):
        self.comm, self.timeout = comm, timeout
        W, me = comm.size, comm.rank
        self.bounds = b = shard_bounds(n_params, W)
        self.lo, self.hi = b[me], b[me + 1]
        m = self.hi - self.lo
        sizes = [b[k + 1] - b[k] + 2 for k in range(W)]            # shard + count + flags
        offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        self.send = np.zeros(n_params + 2 * W, np.float32)        # W blocks, one per owner
        self.blocks = [self.send[o:o + z] for o, z in zip(offs, sizes)]
        self.send_spec = [self.send, (sizes, offs), MPI.FLOAT]
        self.recv = np.zeros((W, m + 2), np.float32)               # my shard from each worker
        self.recv_spec = [self.recv, ([m + 2] * W, [k * (m + 2) for k in range(W)]), MPI.FLOAT]
        self.counts = [b[k + 1] - b[k] for k in range(W)]          # weights allgather
        self.req = self.wreq = None
        self.step = 0
        self.wait_s = 0.0              # seconds spent waiting for the other workers
        self.stopping = False          # some worker asked to stop after the last step

    def start(self, grad_sum, n, more, step, stop=False):
        """Send each owner its shard of this worker's gradient sum over n examples (not
        read when n = 0), whether this worker has a batch for the next step, and whether
        it asks to stop after this step (a stop signal: every worker learns it with this
        step's exchange, so all stop after the same step at no extra message)."""
        for k, blk in enumerate(self.blocks):
            m = len(blk) - 2
            if n:
                blk[:m] = grad_sum[self.bounds[k]:self.bounds[k + 1]]
            blk[m] = n
            blk[m + 1] = (1.0 if more else 0.0) + (2.0 if stop else 0.0)
        self.step = step
        self.req = self.comm.Ialltoallv(self.send_spec, self.recv_spec)

    def _describe(self, what):
        return lambda: (f"dense {what} of step {self.step} among the {self.comm.size} "
                        f"workers (a worker that is slow or stopped holds the others here)")

    def _wait(self, reqs, what):
        t0 = time.perf_counter()
        wait_requests(reqs, self.timeout, self._describe(what), spin=SPIN)
        self.wait_s += time.perf_counter() - t0

    def finish(self, acc):
        """Wait, then add every worker's gradient on my shard into `acc` (a DenseStep of
        [lo, hi), reset here) in rank order; returns whether any worker has another batch."""
        self._wait([self.req], "Ialltoallv of the gradients")
        self.req = None
        acc.reset()
        m = self.hi - self.lo
        for w in range(self.comm.size):
            acc.add(int(self.recv[w, m]), self.recv[w, :m])
        flags = self.recv[:, m + 1].astype(np.int64)
        self.stopping = bool((flags & 2).any())
        return bool((flags & 1).any())

    def share(self, values):
        """Start sending my updated shard of `values` (the live weights) to every worker;
        the other shards arrive in place."""
        self.wreq = self.comm.Iallgatherv(MPI.IN_PLACE,
                                          [values, (self.counts, self.bounds[:-1]), MPI.FLOAT])

    def wait_shared(self):
        """Complete :meth:`share`: every worker's weights are whole again."""
        if self.wreq is not None:
            self._wait([self.wreq], "Iallgatherv of the updated weights")
            self.wreq = None

    def start_late(self, grad_sum, n, more, step, stop, values):
        """``--dense-lag 1``: :meth:`start` and :meth:`share` of ``values`` at once (my
        shard, updated from the last step's gradients); :meth:`finish_late` completes both
        with one wait."""
        self.start(grad_sum, n, more, step, stop)
        self.share(values)

    def finish_late(self, acc):
        """Complete :meth:`start_late` (every worker's weights whole), then as :meth:`finish`."""
        self._wait([self.req, self.wreq], "Ialltoallv and Iallgatherv of a late step")
        self.wreq = None
        return self.finish(acc)

    def gather_state(self, table):
        """Make `table`'s per-weight optimizer state (and its moving average, when it keeps
        one) whole from every shard's owner (a collective of all workers: before a
        checkpoint or a replica check)."""
        self.wait_shared()
        for name, per_el in dense_fields(table):
            if per_el and name != "values":
                self.gather(table, name)

    def gather(self, table, name):
        """Make field `name` of `table` (``mpips.tables.dense.dense_fields``) whole from
        every shard's owner (a collective of all workers; ``average`` before evaluation)."""
        wait_collective(self.comm.Iallgatherv(
            MPI.IN_PLACE, [table.array(name), (self.counts, self.bounds[:-1]), MPI.FLOAT]),
            f"Iallgatherv of the dense {name}")
