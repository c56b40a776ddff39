"""`python -m mpips.train`: parameter-server training of CTR-DNN.

    mpirun -n 4 python -m mpips.train            # 2 servers x 2 workers, async, synthetic data
    python -m mpips.train --local                # one process, same tables and kernels

Only this module touches COMM_WORLD.  A failure on any rank prints one line
`mpips: rank R: Error: message` and aborts the whole job with a non-zero exit.  SIGTERM,
SIGINT (Ctrl-C) and SIGUSR1, which mpiexec forwards to every rank, stop a batch run (or a
stream, inside its pass) at a step boundary with a checkpoint and exit code 75
(mpips.job.stop; docs/resume.md); Ctrl-C
a second time stops at once: one line for the job and exit code 130 on every rank, without
tracebacks.
"""
import os
import signal
import sys
import time
import traceback

from mpips import checkpoint as ck
from mpips.comm.backoff import COLLECTIVE, Backoff
from mpips.comm.cluster import check_servers, default_servers
from mpips.config import parse_args
from mpips.job import stop
from mpips.job.build import make_tables
from mpips.job.hooks import Hooks
from mpips.job.loop import LocalBackend, admission_of, inner_table, run_epochs
from mpips.job.plan import make_plan, make_trainer
from mpips.job.report import log_line, model_note, peak_rss_mb
from mpips.job.resume import resume_line
from mpips.job.stop import STOP
from mpips.job.stream import run_stream
from mpips.job.tracking import new_run
from mpips.job.warmup import report_new, signatures, warm
from mpips.models.zoo import network_text
from mpips.tables.staleness import StalenessTracker, stale_rule
from mpips.tables.tiered import tier_note
from mpips.worker.local import LocalPS


def run_local(plan):
    """Train a RunPlan in one process (the yardstick); returns the list of epoch/pass
    records."""
    plan = plan.with_data()
    seconds = warm(plan, plan.train_files[:1] or None, plan.width)
    log_line(f"mpips: kernels compiled or loaded from numba's cache in "
             f"{seconds:.1f} s (before training; in no rate)")
    jit0 = signatures()
    backend = local_backend(plan)
    trainer, ps = backend.trainer, backend.ps
    if plan.cfg.stream:
        records = run_stream(plan, backend, log_line)
    else:
        records = run_epochs(plan, backend)
    log_line(trainer.times_line("local"))
    log_line(f"PROFILE --> local compute_s={trainer.compute_s:.2f} rows={len(ps.sparse)} "
             f"peak_rss_mb={peak_rss_mb():.0f}{tier_note(ps.sparse)}")
    report_new(jit0, "local", plan.hooks)
    return records


def local_backend(plan):
    """The one-process LocalBackend of a RunPlan (its Trainer, LocalPS and tables), loaded
    from the checkpoint to resume when there is one: what ``--local`` trains with."""
    cfg, model, W = plan.cfg, plan.model, plan.width   # one dense step averages W batches
    sparse, dense = make_tables(cfg, model, dense_batches=W, cowclip=plan.cowclip)
    tracker = None                  # simulated async pushes: counted as async servers do
    if cfg.simulate_workers and cfg.sim_sparse == "async":
        tracker = StalenessTracker(sparse, max_pulls=cfg.sim_delay + 1)
    ps = LocalPS(sparse, dense, tracker, stale_rule(cfg.stale_lr, W))
    trainer = make_trainer(cfg, model, ps, 1, log=log_line, replica=ps.dense,
                           cowclip=plan.cowclip)
    if cfg.simulate_workers:
        log_line(f"mpips local: simulating {W} workers ({cfg.sim_sparse} sparse pushes, "
                 f"rows read {cfg.sim_delay} step(s) early)")
    log_line(f"mpips local: {W} worker(s), {model.n_params} dense parameters"
             f"{model_note(model)}")
    log_line(plan.batch_line())
    for line in (plan.rule_line(), plan.stale_line()):
        if line:
            log_line(line)
    log_line(plan.schema.describe())
    if plan.resume:
        ck.load_local(plan.resume, inner_table(ps.sparse), ps.dense, admission_of(ps.sparse))
        log_line(resume_line(plan.resume, plan.manifest))
    return LocalBackend(plan, trainer, ps, plan.resume)


def precheck(cfg, comm=None, hooks=None):
    """The RunPlan of ``cfg`` (``mpips.job.plan.make_plan``): the checks that need files,
    before any work, with ``--resume`` pinned to the checkpoint rank 0 of ``comm`` chose."""
    return make_plan(cfg, comm, hooks or Hooks())


def local_main(plan):
    """Train in this process; the exit code (0, or a stop's: mpips.job.stop) after its line."""
    run_local(plan)
    if STOP["stopped"] is not None:
        print(STOP["stopped"].line(), file=sys.stderr, flush=True)
    return stop.exit_code()


def main(argv=None):
    """Run a job; its exit code.  Stop signals are handled while it runs (mpips.job.stop)."""
    previous = stop.install()
    new_run()
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    finally:
        stop.restore(previous)


def print_model(argv):
    """``--print-model NAME``: print a built-in network's file (or a FILE.toml) and exit."""
    i = next(i for i, a in enumerate(argv) if a.split("=")[0] == "--print-model")
    name = argv[i].split("=", 1)[1] if "=" in argv[i] else \
        (argv[i + 1] if i + 1 < len(argv) else "")
    try:
        print(network_text(name), end="")
    except ValueError as e:
        print(f"mpips: error: --print-model: {e}", file=sys.stderr)
        return 2
    return 0


def _main(argv):
    if any(a.split("=")[0] == "--print-model" for a in argv):
        return print_model(argv)
    hooks = Hooks.from_env()    # test and benchmark aids: the environment is read here only
    if "--local" in argv:       # no MPI at all
        try:
            plan = precheck(parse_args(argv), None, hooks)
        except ValueError as e:
            print(f"mpips: error: {e}", file=sys.stderr)
            return 2
        return _guarded(None, lambda: local_main(plan))
    from mpi4py import MPI      # here, not at the top: --local runs without MPI
    comm = MPI.COMM_WORLD
    icomm = comm.Dup()          # for the interrupt barrier only: never out of order
    if comm.rank != 0:       # usage errors and --help print once
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        cfg = parse_args(argv)
        if comm.size > 1:
            check_servers(cfg.servers or default_servers(comm.size), comm.size)
        plan = precheck(cfg, comm, hooks)
    except ValueError as e:
        if comm.rank == 0:
            print(f"mpips: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if comm.size == 1:
        return _guarded(None, lambda: local_main(plan))
    from mpips.job.distributed import run_distributed     # imports mpi4py.MPI (see above)
    return _guarded(comm, lambda: run_distributed(plan, comm), icomm)


INTERRUPT_GRACE = 3.0   # seconds an interrupted rank waits for every rank to be interrupted


def _interrupted(comm, icomm):
    """After SIGINT: the exit code 130, with one line on stderr for the job.

    mpiexec (and srun) forward Ctrl-C to every rank: all meet in a barrier on `icomm`
    and rank 0 says so, and every rank leaves normally (MPI_Finalize, whose notes about
    requests left pending are not shown; the launcher prints no failure banner).  A rank
    interrupted alone (the others not in the barrier within INTERRUPT_GRACE s) names
    itself and aborts the job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second Ctrl-C is for the launcher
    if comm is None or comm.size == 1:
        print("mpips: interrupted (SIGINT); stopping", file=sys.stderr, flush=True)
        return 130
    req, deadline, backoff = icomm.Ibarrier(), time.monotonic() + INTERRUPT_GRACE, \
        Backoff(*COLLECTIVE)
    while not req.Test():
        if time.monotonic() > deadline:
            print(f"mpips: interrupted (SIGINT) on rank {comm.rank}; stopping the job",
                  file=sys.stderr, flush=True)
            time.sleep(0.2)   # let the line reach the launcher before the job is torn down
            comm.Abort(130)
        backoff.sleep()
    if comm.rank == 0:
        print(f"mpips: interrupted (SIGINT) on all {comm.size} ranks; stopping",
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)     # MPI_Finalize's notes on the requests
    os.dup2(devnull, 2)                            # the interruption left pending: noise here
    return 130


def _guarded(comm, fn, icomm=None):
    """Run fn; on any exception print one line naming the rank and abort every rank."""
    try:
        return fn() or 0
    except KeyboardInterrupt:
        return _interrupted(comm, icomm)
    except Exception as e:  # noqa: BLE001 - the boundary of the program
        rank = "local" if comm is None else f"rank {comm.rank}"
        print(f"mpips: {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("MPIPS_TRACEBACK"):
            traceback.print_exc()
        if comm is not None and comm.size > 1:
            time.sleep(0.2)   # let the line reach the launcher before the job is torn down
            comm.Abort(1)
        return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:      # before training started (parsing, MPI start-up)
        print("mpips: interrupted (SIGINT) while starting; stopping", file=sys.stderr)
        sys.exit(130)
