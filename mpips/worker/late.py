"""``--dense-lag 1`` (async over MPI): the dense exchange off the critical path, one step late.

The ``Trainer``'s step waits twice for all workers: for their gradients (``Ialltoallv``)
before it updates its shard, and for their updated shards (``Iallgatherv``) before the next
forward.  Here the weights a step computes with miss the last step's gradients:

    step t:  wait for the rows of batch t, then for step t-1's exchange (every shard of
             the weights after step t-2's gradients, and step t-1's gradients on mine);
             forward/backward of batch t on those weights;
             update my shard from step t-1's gradients; start step t's exchange: its
             gradients to their owners and my updated shard to everyone, together;
             push batch t's rows with batch t+1's pull (one message a server).

So each step has one wait for the other workers instead of two, with a batch's read and
pull between its start and its end, and the dense step's optimizer work leaves the path
between them.  Every gradient is still applied once, in worker order, with the same
optimizer and the same example weighting; only the weights a gradient is computed at are
one step older (a dense staleness of 1, as in PERSIA's asynchronous dense mode).  The
replicas stay identical bit for bit; :meth:`LateTrainer.settle` applies the step in flight
(before a save or a replica check, and at the epoch's end), after which every replica holds
every step's gradients.  Sync mode never uses it (it must equal one process).
"""
import time

from mpips.worker.trainer import Trainer, _Done


class LateTrainer(Trainer):
    """A ``Trainer`` of async workers whose dense steps apply one step late (above)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.dense_sync is None or self.sync or self.overlap:
            raise ValueError("--dense-lag 1 is for async workers with a dense exchange "
                             "(2 or more workers, --mode async, no --overlap-pull)")
        self.in_flight = False      # a step's exchange started, not completed
        self.collected = False      # the acc holds a step's gradients, not applied yet
        self.flags = (True, False)  # from the last completed exchange: (any worker has a
                                    # next batch, some worker asked to stop)

    def _collect(self):
        """Complete the exchange in flight: every shard of the weights, and its gradients
        on my shard into the acc."""
        with self.watch("dense_wait"):
            more = self.dense_sync.finish_late(self.acc)
        self.flags = (more, self.dense_sync.stopping)
        self.in_flight, self.collected = False, True

    def _apply(self):
        with self.watch("dense_opt"):
            self.acc.apply()
        self.collected = False

    def settle(self):
        """Apply the step in flight: every replica whole, with every step's gradients."""
        if self.in_flight:
            self._collect()
        if self.collected:
            self._apply()
            self.dense_sync.share(self.params[0])
            with self.watch("dense_wait"):
                self.dense_sync.wait_shared()

    def _epoch(self, it, epoch, st, max_steps, skip):
        params, tm = self.params[0], self.watch
        self.acc.noise_reset()
        if max_steps and skip >= max_steps:
            return 0
        cur = self._group(it, skip, max_steps)
        h = self._pull_group(cur, 0, True)
        push, step = _Done(), 0
        self.flags = (True, False)
        while True:
            nxt = self._group(it, skip + step + 1, max_steps)
            h.wait()
            if self.in_flight:
                self._collect()
            more, stopping = self.flags
            if step and (not more or stopping):
                st.stopped = more and stopping
                break
            parts, n_here = self._timed_compute(cur, params, st, tm)
            push.wait()
            if self.collected:                      # step t-1's gradients, on my shard
                self._apply()
            with tm("send"):
                self.dense_sync.start_late(self.grad_dense, n_here, bool(nxt), step,
                                           self._stop_asked(), params)
                push = self._push(parts, n_here, step, nxt if self.coalesce else ())
            self.in_flight = True
            if self.coalesce and len(parts) == 1 and len(nxt) == 1:
                h = push                            # the next rows come with the push
            else:
                h = self._pull_group(nxt, step + 1, True)
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.on_step is not None:            # (a save settles the step in flight)
                self.examples_done = (st.examples, None)
                self.on_step(skip + step + 1, step + 1)
            step += 1
            self._report(epoch, step, st)
            cur = nxt
        self.settle()
        push.wait()
        return step
