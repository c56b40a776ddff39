"""Stopping a job cleanly on a signal: SIGTERM, SIGINT, SIGUSR1.

The handlers (:func:`install`, on every rank) only raise a flag, ``STOP["flag"]``.  The job
reads it where stopping is safe:

* a batch run at a step boundary: every worker finishes its step, the workers agree to stop
  after the same step (each worker's flag travels with the step's dense gradient exchange,
  ``mpips.worker.dense_sync.DenseExchange``, so all learn it at once at no extra message;
  between epochs a sum over the workers; GEO's workers, not in step, each stop at their
  next round), the job saves a checkpoint there (``--save-mode``, into ``--save-dir``) and
  every rank exits with :data:`EXIT_STOPPED` after one line;
  ``--resume auto`` continues from it exactly as from any mid-epoch save;
* a stream the same way, inside its pass: at a step boundary, with a checkpoint recording the
  pass and the batches of it trained (or before the pass's training, when the signal came
  during its shrink or evaluation; or between passes, where the pass's own checkpoint is
  the position), exiting :data:`EXIT_STOPPED`; ``--resume auto`` (or the same command)
  continues inside that pass (``mpips.job.stream``).

Without ``--save-dir`` nothing can be saved: the run stops the same way and exits with 128 +
the signal's number (130 for SIGINT), as a process killed by it would.  A second SIGINT
(Ctrl-C again) stops at once, as before: ``KeyboardInterrupt`` (``mpips.train``).
Under MPICH's mpiexec (hydra), SIGTERM, SIGINT and SIGUSR1 sent to mpiexec are passed on to
every rank; Slurm's ``--signal=B:USR1@T`` signals the batch script, which passes it on
(``jobs/slurm/train.sbatch``).

Test aid: ``MPIPS_DEBUG_SIGNAL_AT="SIG:EPOCH:BATCH[:launcher]"`` makes the logging worker
(or the local process) send itself SIGSIG (TERM, INT or USR1) after batch BATCH of epoch
EPOCH (a stream: of its pass number EPOCH, counted from 0 over the whole stream); with
``:launcher``, to the mpiexec/mpirun above it instead (which passes it on).  A stream also
takes a phase for BATCH: ``shrink``, ``eval``, ``save`` (the pass's save) or ``wait`` (when
it asks for the next pass): the signal is sent as that phase of pass EPOCH begins.
"""
import os
import signal
from dataclasses import dataclass

EXIT_STOPPED = 75           # stopped on a signal, checkpoint saved: run again with --resume
                            # auto to continue (sysexits' EX_TEMPFAIL, "try again later")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP = {"flag": False, "signal": "", "stopped": None}
DEBUG_SIGNAL_AT = "MPIPS_DEBUG_SIGNAL_AT"
LAUNCHERS = ("mpiexec", "mpirun", "mpiexec.hydra", "srun")


@dataclass
class Stopped:
    """Where a run stopped, and the checkpoint it saved there (None: no --save-dir)."""
    signal: str
    epoch: int
    steps: int              # batches of the epoch done (per worker)
    path: str | None
    where: str = ""         # a stream's position ("in pass P after batch N"); "": the epoch's

    def exit_code(self):
        if self.path:
            return EXIT_STOPPED
        return 128 + int(getattr(signal, self.signal, signal.SIGTERM))

    def line(self, ranks=""):
        at = self.where or f"at epoch {self.epoch} after batch {self.steps}"
        where = f"{self.signal} {at}{ranks}"
        if self.path:
            return (f"mpips: stopped by {where}: checkpoint {self.path}; continue with "
                    f"--resume auto (exit code {EXIT_STOPPED})")
        return (f"mpips: stopped by {where}: nothing saved (no --save-dir; give one to "
                f"continue later) (exit code {self.exit_code()})")


def reset():
    STOP.update(flag=False, signal="", stopped=None)


def _handler(signum, frame):
    if signum == signal.SIGINT and STOP["signal"] == "SIGINT":
        raise KeyboardInterrupt          # Ctrl-C twice: stop now
    if not STOP["flag"]:
        STOP["signal"] = signal.Signals(signum).name
    STOP["flag"] = True


def install():
    """Install the handlers (main thread only); returns the previous ones for :func:`restore`."""
    reset()
    return {s: signal.signal(s, _handler) for s in SIGNALS}


def restore(previous):
    for s, h in previous.items():
        signal.signal(s, h)


def exit_code():
    """0, or the stopped run's code (:meth:`Stopped.exit_code`)."""
    return 0 if STOP["stopped"] is None else STOP["stopped"].exit_code()


def debug_hook(epoch, spec):
    """The MPIPS_DEBUG_SIGNAL_AT hook for ``epoch`` (a trainer's on_step), or None; ``spec``:
    the variable's value split at ':' (read at the entry point: ``mpips.job.hooks``)."""
    spec = list(spec)
    if len(spec) < 3 or not spec[2].isdigit() or int(spec[1]) != epoch:
        return None
    sig, at = getattr(signal, "SIG" + spec[0]), int(spec[2])
    target = _launcher() if spec[3:] == ["launcher"] else os.getpid()

    def hook(done, phase_steps):
        if done == at:
            os.kill(target, sig)
    return hook


def debug_phase(epoch, phase, spec):
    """The MPIPS_DEBUG_SIGNAL_AT signal when ``phase`` (shrink, eval, save, wait) of stream
    pass number ``epoch`` begins and ``spec`` names them; else nothing."""
    spec = list(spec)
    if len(spec) < 3 or spec[2] != phase or int(spec[1]) != epoch:
        return
    target = _launcher() if spec[3:] == ["launcher"] else os.getpid()
    os.kill(target, getattr(signal, "SIG" + spec[0]))


def _launcher():
    """The PID of the nearest mpiexec/mpirun/srun above this process (Linux /proc)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/comm") as fh:
            if fh.read().strip() in LAUNCHERS:
                return pid
        with open(f"/proc/{pid}/stat") as fh:
            pid = int(fh.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError(f"{DEBUG_SIGNAL_AT}=...:launcher: no {'/'.join(LAUNCHERS)} above "
                       f"process {os.getpid()}")
