"""Polling with back-off: every wait in mpips sleeps between looks instead of spinning.

On an oversubscribed node (4 ranks on 2 cores) a rank that spins on ``Test``/``Iprobe``
takes a core from the ranks that compute, so each poll loop sleeps between looks:
``b = Backoff(*REPLY)``; after a look that found nothing, ``b.sleep()`` sleeps the current
delay and doubles it up to the ceiling; after one that found work, ``b.reset()``.  (The
shape of mpi4py.futures' ``Backoff``.)  ``mpips.comm.liveness.wait_for`` is the loop itself
for waits that also answer status requests and can time out.

The (first, longest) sleeps in seconds of every wait, in one place:
"""
import time

IDLE = (1e-5, 5e-4)         # an idle server between looks for a request (longest: --idle-sleep)
REPLY = (1e-5, 2e-4)        # a worker waiting for replies, a barrier's release, a save's confirm
COLLECTIVE = (1e-3, 1e-3)   # a non-blocking collective; collecting a status dump
PASS = (0.05, 2.0)          # a stream waiting for its next pass to be ready
# Seconds a worker polls without sleeping in the workers' dense exchange before it backs off:
# every worker waits there every step, and a sleeping worker gives its core (and its cache)
# to another rank until the scheduler returns it, milliseconds later.  Alternated 2x2 async
# runs on 1M rows (docs/modes.md): 17.8k ex/s sleeping at once, 44.3k spinning up to 10 ms.
SPIN = 0.01


class Backoff:
    """Sleeps that start at ``first`` and double up to ``longest`` (0: never sleep)."""

    def __init__(self, first, longest):
        self.first, self.longest = first, longest
        self.delay = first

    def reset(self):
        """Work was found: the next sleep is short again."""
        self.delay = self.first

    def sleep(self, at_most=None):
        """Sleep the current delay (no longer than ``at_most`` s), then double it."""
        if self.longest <= 0:
            return
        time.sleep(self.delay if at_most is None else max(0.0, min(self.delay, at_most)))
        self.delay = min(2 * self.delay, self.longest)
