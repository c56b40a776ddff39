"""`python -m mpips.train`: parameter-server training of CTR-DNN.

    mpirun -n 4 python -m mpips.train            # 2 servers x 2 workers, async, synthetic data
    python -m mpips.train --local                # one process, same tables and kernels

Only this module touches COMM_WORLD.  A failure on any rank prints one line
`mpips: rank R: Error: message` and aborts the whole job with a non-zero exit.  SIGTERM,
SIGINT (Ctrl-C) and SIGUSR1, which mpiexec forwards to every rank, stop a batch run at a
step boundary with a checkpoint and exit code 75 (mpips.job.stop; docs/resume.md); Ctrl-C
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
from mpips.job.build import batch_line, make_model, make_schema, make_tables, resolve_data
from mpips.comm.cluster import check_servers, default_servers
from mpips.checkpoint.manifest import chain_manifests
from mpips.checkpoint.compat import check_chain, check_compatible
from mpips.config import parse_args, split_batch
from mpips.job.report import log_line, model_note, peak_rss_mb
from mpips.data.files import resolve_paths
from mpips.job.resume import (check_kind, choose_at_start, first_rank_decides, pin, resume_line, resume_point,
                          start_point)
from mpips.tables.ownership import plan_keys
from mpips.job.loop import LocalBackend, admission_of, inner_table, run_epochs
from mpips.schema import check_same, stored_schema
from mpips.tables.staleness import StalenessTracker, stale_rule
from mpips.job import stop
from mpips.job.stop import STOP
from mpips.job.stream import run_stream
from mpips.job.tracking import new_run
from mpips.job.warmup import report_new, signatures, warm
from mpips.worker.local import LocalPS
from mpips.worker.trainer import GeoTrainer, Trainer


def run_local(cfg):
    """Train in one process (the yardstick); returns the list of epoch/pass records."""
    train_files, test_files = ([], []) if cfg.stream else resolve_data(cfg)
    W = cfg.simulate_workers or cfg.local_workers       # one dense step averages W batches
    seconds = warm(cfg, train_files[:1] or None, W)
    log_line(f"mpips: kernels compiled or loaded from numba's cache in "
             f"{seconds:.1f} s (before training; in no rate)")
    jit0 = signatures()
    backend = local_backend(cfg)
    trainer, ps = backend.trainer, backend.ps
    if cfg.stream:
        records = run_stream(cfg, backend, log_line)
    else:
        records = run_epochs(cfg, backend, train_files, test_files)
    log_line(trainer.times_line("local"))
    log_line(f"PROFILE --> local compute_s={trainer.compute_s:.2f} rows={len(ps.sparse)} "
             f"peak_rss_mb={peak_rss_mb():.0f}")
    report_new(jit0, "local")
    return records


def local_backend(cfg):
    """The one-process LocalBackend of ``cfg`` (its Trainer, LocalPS and tables), loaded from
    the checkpoint to resume when there is one: what ``--local`` trains with."""
    W = cfg.simulate_workers or cfg.local_workers       # one dense step averages W batches
    schema = make_schema(cfg)
    model = make_model(cfg, schema)
    sparse, dense = make_tables(cfg, model, dense_batches=W)
    tracker = None                  # simulated async pushes: counted as async servers do
    if cfg.simulate_workers and cfg.sim_sparse == "async":
        tracker = StalenessTracker(sparse, max_pulls=cfg.sim_delay + 1)
    ps = LocalPS(sparse, dense, tracker, stale_rule(cfg.stale_lr, W))
    plan = lambda ids: plan_keys(ids, 1)  # noqa: E731
    if cfg.mode == "geo":
        trainer = GeoTrainer(cfg, model, ps, plan, log=log_line)
    else:
        trainer = Trainer(cfg, model, ps, plan, log=log_line, replica=ps.dense)
    if cfg.simulate_workers:
        log_line(f"mpips local: simulating {W} workers ({cfg.sim_sparse} sparse pushes, "
                 f"rows read {cfg.sim_delay} step(s) early)")
    log_line(f"mpips local: {W} worker(s), {model.n_params} dense parameters"
             f"{model_note(model)}")
    log_line(batch_line(cfg, W))
    log_line(schema.describe())
    path = resume_point(cfg)[0]
    if path:
        ck.load_local(path, inner_table(ps.sparse), ps.dense, admission_of(ps.sparse))
        log_line(resume_line(path, ck.read_manifest(path)))
    return LocalBackend(cfg, trainer, ps, path)


def precheck(cfg, comm=None):
    """Checks that need files, before any work; returns ``cfg`` with ``--resume`` pinned.

    The checkpoint to continue from is chosen once (on rank 0 of ``comm``: the newest in a
    root whose whole chain verifies) and pinned as ``cfg.resume``, so every rank loads that
    one; its chain must agree with itself and with this config on every setting that
    changes what its numbers mean, and its position must lie in this run.
    """
    schema = make_schema(cfg)                 # a bad --schema file fails here, before any work
    if not schema.label:
        raise ValueError(f"{cfg.schema or 'the schema'}: label = \"\" (no label): training "
                         f"needs each example's 0/1 label; name its column or slot (scoring "
                         f"without labels is for python -m mpips.infer and serving)")
    path = first_rank_decides(comm, lambda: choose_at_start(cfg))
    if path:
        elements = chain_manifests(path)       # read once: its last is path's manifest
        check_kind(cfg, path, elements[-1][1])  # before pinning: --resume naming it allows it
    cfg = pin(cfg, path)
    if cfg.resume:
        check_chain(elements)
        check_compatible(elements[-1][1], cfg, schema=schema)   # its --stats width
        check_same(stored_schema(elements[-1][1]), schema, f"checkpoint {cfg.resume}")
        resume_point(cfg)                      # its position, checked against the run
        start_point(cfg, _train_files(cfg), _workers(cfg, comm))   # (and the data, if given)
    return cfg


def _workers(cfg, comm):
    """The run's workers: the ranks less the servers, or one process's W."""
    if comm is not None and comm.size > 1:
        return comm.size - (cfg.servers or default_servers(comm.size))
    return cfg.simulate_workers or cfg.local_workers


def _train_files(cfg):
    """The --train files, or None (the embedded dataset, a stream, a path that the run
    itself will report)."""
    try:
        return resolve_paths(cfg.train) if cfg.train else None
    except OSError:
        return None


def local_main(cfg):
    """Train in this process; the exit code (0, or a stop's: mpips.job.stop) after its line."""
    run_local(cfg)
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


def _main(argv):
    if "--local" in argv:       # no MPI at all
        try:
            cfg = precheck(parse_args(argv))
        except ValueError as e:
            print(f"mpips: error: {e}", file=sys.stderr)
            return 2
        return _guarded(None, lambda: local_main(cfg))
    from mpi4py import MPI      # here, not at the top: --local runs without MPI
    comm = MPI.COMM_WORLD
    icomm = comm.Dup()          # for the interrupt barrier only: never out of order
    if comm.rank != 0:       # usage errors and --help print once
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        cfg = parse_args(argv)
        if comm.size > 1:
            servers = cfg.servers or default_servers(comm.size)
            check_servers(servers, comm.size)
            if cfg.global_batch:
                split_batch(cfg.global_batch, comm.size - servers)
        cfg = precheck(cfg, comm)
    except ValueError as e:
        if comm.rank == 0:
            print(f"mpips: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if comm.size == 1:
        return _guarded(None, lambda: local_main(cfg))
    from mpips.job.distributed import run_distributed     # imports mpi4py.MPI (see above)
    return _guarded(comm, lambda: run_distributed(cfg, comm), icomm)


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
