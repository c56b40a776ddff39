"""`python -m mpips.train`: parameter-server training of CTR-DNN.

    mpirun -n 4 python -m mpips.train            # 2 servers x 2 workers, async, synthetic data
    python -m mpips.train --local                # one process, same tables and kernels

Only this module touches COMM_WORLD.  A failure on any rank prints one line
`mpips: rank R: Error: message` and aborts the whole job with a non-zero exit.
"""
import json
import os
import resource
import sys
import time

from mpips.config import parse_args


def log_line(text):
    print(text, flush=True)


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def resolve_data(cfg):
    """(train_files, test_files) from the config; the embedded synthetic set if none given."""
    from mpips.data.files import resolve_paths
    if not cfg.train:
        from data_prep.synth import ensure_default_dataset
        train_dir, test_dir = ensure_default_dataset(
            os.path.expanduser(cfg.cache_dir), rows=cfg.synth_rows,
            test_rows=cfg.synth_test_rows, parts=8, seed=0)
        return resolve_paths(train_dir), resolve_paths(test_dir)
    return resolve_paths(cfg.train), (resolve_paths(cfg.test) if cfg.test else [])


def make_reader(cfg, files, batch_size, warn):
    from mpips.data.reader import DataReader
    cont_min = cont_diff = None
    if cfg.stats:
        from mpips.data.shards import load_stats
        cont_min, cont_diff = load_stats(cfg.stats)
    return DataReader(files, batch_size, fmt=cfg.data_format, strict=cfg.strict,
                      hash_bucket=cfg.hash_bucket, prefetch=cfg.prefetch, warn=warn,
                      cont_min=cont_min, cont_diff=cont_diff)


def make_tables(cfg, model, lo=0, hi=None):
    """The sparse table and the dense slice [lo:hi) of the initial parameters."""
    from mpips.server.dense_table import DenseTable
    from mpips.server.optim import OptimizerConfig
    from mpips.server.sparse_table import SparseTable
    opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr, initial_accumulator=cfg.adagrad_init)
    sparse = SparseTable(cfg.embedding_dim, opt, seed=cfg.seed, init_range=cfg.init_range)
    if cfg.entry:
        from mpips.server.admission import AdmittedTable
        sparse = AdmittedTable(sparse, cfg.entry, cfg.seed)
    dense = DenseTable(model.init_params(cfg.seed)[lo:hi].copy(), opt)
    return sparse, dense


def make_model(cfg):
    from mpips.models.ctr_dnn import CTRDNN
    return CTRDNN(dim=cfg.embedding_dim, hidden=cfg.hidden)


def epoch_record(cfg, epoch, n_ex, seconds, loss_sum, train_m, test_m, extra):
    rec = {"epoch": epoch, "mode": cfg.mode, "train_examples": int(n_ex),
           "train_seconds": round(seconds, 4),
           "examples_per_sec": round(n_ex / seconds, 1) if seconds > 0 else 0.0,
           "train_loss": loss_sum / max(n_ex, 1), "train_auc": train_m.auc()}
    if cfg.mode == "geo":
        rec["geo_steps"] = cfg.geo_steps
    if cfg.mode == "ssp":
        rec["staleness"] = cfg.staleness
    if cfg.mode == "async":
        rec["dense_every"] = cfg.dense_every
    if test_m is not None:
        rec.update(test_examples=int(test_m.count), test_auc=test_m.auc(),
                   test_logloss=test_m.logloss(), test_mean_pred=test_m.mean_pred(),
                   test_ctr=test_m.observed_ctr())
    rec.update(extra)
    return rec


def write_metrics(path, rec):
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def summary_line(rec):
    s = (f"EPOCH {rec['epoch']} --> examples: {rec['train_examples']} "
         f"seconds: {rec['train_seconds']:.2f} examples/s: {rec['examples_per_sec']:.0f} "
         f"loss: {rec['train_loss']:.6f} auc: {rec['train_auc']:.6f}")
    if "test_auc" in rec:
        s += (f" | TEST examples: {rec['test_examples']} auc: {rec['test_auc']:.6f} "
              f"logloss: {rec['test_logloss']:.6f}")
    return s


def run_local(cfg):
    """Train in one process (the yardstick); returns the list of epoch/pass records."""
    from mpips import checkpoint as ck
    from mpips.runner import LocalBackend, inner_table, run_epochs
    from mpips.stream import resume_point, run_stream
    from mpips.worker.client import plan_keys
    from mpips.worker.local import LocalPS
    from mpips.worker.trainer import GeoTrainer, Trainer
    train_files, test_files = ([], []) if cfg.stream else resolve_data(cfg)
    model = make_model(cfg)
    ps = LocalPS(*make_tables(cfg, model))
    cls = GeoTrainer if cfg.mode == "geo" else Trainer
    trainer = cls(cfg, model, ps, lambda ids: plan_keys(ids, 1), log=log_line)
    log_line(f"mpips local: batch {cfg.local_workers} x {cfg.batch_size}, "
             f"{model.n_params} dense parameters")
    path = resume_point(cfg)[0]
    if path:
        ck.load_local(path, inner_table(ps.sparse), ps.dense)
        log_line(f"RESUME --> {path}")
    backend = LocalBackend(cfg, trainer, ps)
    if cfg.stream:
        records = run_stream(cfg, backend, log_line)
    else:
        records = run_epochs(cfg, backend, train_files, test_files)
    log_line(f"PROFILE --> local compute_s={trainer.compute_s:.2f} rows={len(ps.sparse)} "
             f"peak_rss_mb={peak_rss_mb():.0f}")
    return records


def precheck(cfg):
    """Checks that need files: the --resume checkpoint exists and fits this config.

    Also: a stream run stops after its current pass on SIGTERM.
    """
    if cfg.stream:
        from mpips.stream import install_sigterm
        install_sigterm()
    from mpips.stream import resume_point
    path = resume_point(cfg)[0]
    if path:
        from mpips import checkpoint as ck
        ck.check_compatible(ck.read_manifest(path), cfg)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--local" in argv:       # no MPI at all
        try:
            cfg = parse_args(argv)
            precheck(cfg)
        except ValueError as e:
            print(f"mpips: error: {e}", file=sys.stderr)
            return 2
        return _guarded(None, lambda: run_local(cfg))
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.rank != 0:       # usage errors and --help print once
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        cfg = parse_args(argv)
        if comm.size > 1:
            from mpips.cluster import check_servers, default_servers
            check_servers(cfg.servers or default_servers(comm.size), comm.size)
        precheck(cfg)
    except ValueError as e:
        if comm.rank == 0:
            print(f"mpips: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if comm.size == 1:
        return _guarded(None, lambda: run_local(cfg))
    from mpips.distributed import run_distributed
    return _guarded(comm, lambda: run_distributed(cfg, comm))


def _guarded(comm, fn):
    """Run fn; on any exception print one line naming the rank and abort every rank."""
    try:
        fn()
        return 0
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - the boundary of the program
        rank = "local" if comm is None else f"rank {comm.rank}"
        print(f"mpips: {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("MPIPS_TRACEBACK"):
            import traceback
            traceback.print_exc()
        if comm is not None and comm.size > 1:
            time.sleep(0.2)   # let the line reach the launcher before the job is torn down
            comm.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
