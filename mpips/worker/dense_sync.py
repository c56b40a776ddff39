"""Dense weights replicated on the workers, updated synchronously every step.

The dense MLP is small and every example touches it, so staleness hurts it; the sparse rows
are huge and each is touched rarely.  So (as in PERSIA and Monolith) every worker keeps the
whole dense vector with its optimizer state (a :class:`DenseTable` of all P weights, the
servers' optimizer code), and after each backward:

1. each worker starts ``Iallgather`` of ``[sum over its examples of the dense gradient, its
   example count, whether it has another batch]`` (P + 2 float32) on the workers'
   communicator; the sparse push and the next batch's pull go ahead meanwhile;
2. every worker adds the W gradients in worker-rank order, skipping workers without examples
   (:class:`DenseStep`), and applies its optimizer with scale 1 / (the step's examples).

A sum in a fixed order, not ``Iallreduce`` (whose result may depend on the algorithm MPI
picks), makes the replicas identical bit for bit by construction, and lets a single process
(``--local --local-workers W``) compute exactly the same numbers: it adds its W parts'
gradients in the same order with the same :class:`DenseStep`.  With W = 2 the bytes moved
equal an allreduce's.  Example weighting makes a short final batch (or a worker that ran out
of data) exact: the update is from the mean gradient over the step's examples.
"""
import time

import numpy as np

from mpips.liveness import wait_requests


class DenseStep:
    """Accumulates the dense gradient sums of one step in a fixed order, then applies them."""

    def __init__(self, table):
        self.table = table                      # DenseTable of all dense weights
        self.total = np.zeros(table.size, np.float32)
        self.examples = 0

    def reset(self):
        self.total[:] = 0.0
        self.examples = 0

    def add(self, n, grad_sum):
        """Add one part's gradient of its summed loss over n examples (n = 0: nothing)."""
        if n:
            self.total += grad_sum
            self.examples += int(n)

    def apply(self):
        """One optimizer step from the mean gradient; returns the step's examples."""
        if self.examples:
            self.table.push(self.total, 1.0 / self.examples)
        return self.examples


class DenseAllgather:
    """Worker side of step 1: a non-blocking allgather of the P + 2 floats per worker."""

    def __init__(self, comm, n_params, timeout):
        self.comm, self.P, self.timeout = comm, n_params, timeout
        self.send = np.zeros(n_params + 2, np.float32)
        self.recv = np.zeros((comm.size, n_params + 2), np.float32)
        self.req = None
        self.step = 0
        self.wait_s = 0.0              # seconds spent waiting for the other workers

    def start(self, grad_sum, n, more, step):
        """Share this worker's gradient sum over n examples (ignored when n = 0) and
        whether it has a batch for the next step."""
        if n:
            self.send[:self.P] = grad_sum
        self.send[self.P] = n
        self.send[self.P + 1] = 1.0 if more else 0.0
        self.step = step
        self.req = self.comm.Iallgather(self.send, self.recv)

    def _describe(self):
        return (f"dense Iallgather of step {self.step} among the {self.comm.size} workers "
                f"(a worker that is slow or stopped holds the others here)")

    def finish(self, acc):
        """Wait, then add every worker's gradient into `acc` (a DenseStep, reset here) in
        rank order; returns whether any worker has another batch."""
        t0 = time.perf_counter()
        wait_requests([self.req], self.timeout, self._describe)
        self.wait_s += time.perf_counter() - t0
        self.req = None
        acc.reset()
        P = self.P
        for w in range(self.comm.size):
            acc.add(int(self.recv[w, P]), self.recv[w, :P])
        return bool(self.recv[:, P + 1].any())

