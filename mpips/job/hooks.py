"""Test and benchmark aids, and the stop request: read once, at the entry point.

Nothing below ``mpips.train`` reads the environment.  ``python -m mpips.train`` makes
``Hooks.from_env()`` once and the run plan (``mpips.job.plan.RunPlan.hooks``) carries it to
the parts that act on it.  Each aid is off unless its variable is set:

    MPIPS_DEBUG_SLOW_WORKER=I:SECONDS   worker I sleeps SECONDS per step (tests)
    MPIPS_BENCH_SLOW_WORKER=I:F         worker I sleeps F x its compute time (benchmarks)
    MPIPS_DEBUG_KILL_AT=PASS:N          SIGKILL the logging worker (or the local process)
                                        after its N-th batch of stream pass PASS (tests)
    MPIPS_DEBUG_PROGRESS_STEPS=N        a PROGRESS line every N steps, not seconds (tests)
    MPIPS_DEBUG_JIT=1                   each rank lists the kernels compiled after warm-up
    MPIPS_DEBUG_SIGNAL_AT=SIG:E:N[:launcher]  send SIGSIG after batch N of epoch E (a
                                        stream: pass number E), or N a stream's phase:
                                        shrink, eval, save, wait (mpips.job.stop; tests)
"""
import os
import signal
from dataclasses import dataclass

from mpips.job import stop

ENV = {"slow_worker": "MPIPS_DEBUG_SLOW_WORKER", "stretch_worker": "MPIPS_BENCH_SLOW_WORKER",
       "kill_at": "MPIPS_DEBUG_KILL_AT", "progress_steps": "MPIPS_DEBUG_PROGRESS_STEPS",
       "list_jit": "MPIPS_DEBUG_JIT", "signal_at": stop.DEBUG_SIGNAL_AT}


def _worker_value(text):
    """'I:X' -> (I, X) or None for ''."""
    if not text:
        return None
    who, _, value = text.partition(":")
    return int(who), float(value)


@dataclass(frozen=True)
class Hooks:
    slow_worker: tuple = None      # (worker, seconds slept per step)
    stretch_worker: tuple = None   # (worker, fraction of its compute time slept per step)
    kill_at: tuple = None          # (pass name, batch after which it is SIGKILLed)
    progress_steps: int = 0        # a PROGRESS line every N steps (0: by --progress-every)
    list_jit: bool = False         # list the kernels compiled after warm-up
    signal_at: tuple = ()          # (SIG, epoch, batch[, "launcher"]): a stop signal sent

    @classmethod
    def from_env(cls, env=None):
        """The hooks the environment (default ``os.environ``) sets."""
        env = os.environ if env is None else env
        get = {k: env.get(v, "") for k, v in ENV.items()}
        where, _, batch = get["kill_at"].rpartition(":")
        return cls(slow_worker=_worker_value(get["slow_worker"]),
                   stretch_worker=_worker_value(get["stretch_worker"]),
                   kill_at=(where, int(batch)) if where else None,
                   progress_steps=int(get["progress_steps"] or 0),
                   list_jit=bool(get["list_jit"]),
                   signal_at=tuple(get["signal_at"].split(":")) if get["signal_at"] else ())

    def step_delay(self, worker):
        """Seconds worker ``worker`` sleeps per step."""
        return self.slow_worker[1] if self.slow_worker and self.slow_worker[0] == worker else 0.0

    def stretch(self, worker):
        """The fraction of its compute time worker ``worker`` sleeps per step."""
        s = self.stretch_worker
        return s[1] if s and s[0] == worker else 0.0

    def killer(self, name):
        """The step hook that SIGKILLs this process after batch N of pass ``name``, or None."""
        if self.kill_at is None or self.kill_at[0] != name:
            return None
        batch = self.kill_at[1]

        def hook(done, phase_steps):
            if done == batch:
                os.kill(os.getpid(), signal.SIGKILL)
        return hook

    def signaller(self, epoch):
        """The step hook that sends the MPIPS_DEBUG_SIGNAL_AT signal in ``epoch``, or None."""
        return stop.debug_hook(epoch, self.signal_at)

    def signal_phase(self, epoch, phase):
        """Send the MPIPS_DEBUG_SIGNAL_AT signal if it names ``phase`` of stream pass
        number ``epoch`` (mpips.job.stop.debug_phase)."""
        stop.debug_phase(epoch, phase, self.signal_at)


NONE = Hooks()

