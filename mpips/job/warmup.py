"""Compile the numba kernels before training starts, so no clock counts compilation.

numba compiles a kernel at its first call, for the types of that call, and (``cache=True``)
keeps the machine code in ``mpips/kernels/__pycache__`` (or ``NUMBA_CACHE_DIR``).  On a
fresh install that is tens of seconds per process; lazily, it landed inside the first
training step, so the first PROGRESS line showed ~18 ex/s and an ETA of hours.

``warm(plan, files)`` runs a miniature of the run in this process: a few steps of training
and an evaluation with the run's model, optimizer, admission and mode, on the first rows of
the run's own first file (or, for the Criteo schema, on a few synthetic lines when there is
none yet, e.g. a stream with no ready pass; other schemas then compile at their first
step), so every kernel the run calls is compiled, or loaded from the
cache, for exactly the types the run calls it with (``MPIPS_DEBUG_JIT=1`` makes each rank
list any kernel compiled after it: ``mpips.job.hooks``; the end-to-end tests expect none).  Under mpirun
``mpips.job.distributed.staged`` runs it on rank 0 first and, if that found the cache cold, on
one rank per node next, then on the others: a cold cache directory is compiled once and
read by the rest, instead of every rank compiling the same code on the same cores at once.
(numba writes each cache file to a temporary name and renames it into place, so concurrent
writers never leave a torn file; the stages also keep two processes from giving the same
file number to different signatures of one kernel, which numba's index does not guard.)

    python -m mpips.job.warmup [train flags]     # the same, ahead of time (e.g. after install)
"""
import dataclasses
import importlib
import os
import pkgutil
import sys
import tempfile
import time

import numpy as np
from numba.core.registry import CPUDispatcher

import mpips.kernels
from mpips.job.build import make_model, make_reader, make_tables, resolve_data
from mpips.job.plan import make_plan, make_trainer
from mpips.config import parse_args
from mpips.data.reader import DataError
from mpips.data.sources import PipeError
from mpips.tables.staleness import StalenessTracker, counts_staleness, stale_rule
from mpips.tables.tiered import tier_of
from mpips.job.stream import ready_passes
from mpips.worker.local import LocalPS

WARM_BATCH = 64     # rows per step of the miniature run (types, not sizes, pick the code)
WARM_STEPS = 3      # steps: the first, one with a pull in flight, and one more


def dispatchers():
    """Every numba dispatcher in mpips.kernels: {module.name: dispatcher}."""
    out = {}
    for info in pkgutil.iter_modules(mpips.kernels.__path__):
        mod = importlib.import_module(f"mpips.kernels.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == mod.__name__:
                out[f"{info.name}.{name}"] = obj
    return out


def signatures():
    """{(kernel, signature)} compiled (or loaded) in this process so far."""
    return {(name, str(sig)) for name, d in dispatchers().items() for sig in d.signatures}


def _synthetic_file(folder):
    """A small Criteo TSV file (label, 13 integers, 26 categoricals; some empty)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(2 * WARM_BATCH):
        ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-2, 500)))
                for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 1 << 32)):08x}"
                for _ in range(26)]
        lines.append("\t".join([str(i % 2)] + ints + cats))
    path = os.path.join(folder, "warm.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return [path]


def _first_files(plan):
    """The run's first data file (a stream: its first ready pass's), or [] if none yet."""
    cfg = plan.cfg
    try:
        if cfg.stream:
            ready = ready_passes(cfg.stream)
            return ready[0].files()[:1] if ready else []
        if plan.train_files is not None:
            return plan.train_files[:1]
        return resolve_data(cfg)[0][:1]
    except (OSError, ValueError):
        return []           # the run itself reports missing data, with its own message


def warm(plan, files=None, workers=1):
    """Run a few steps of training and an evaluation of the run's job (a RunPlan) in this
    process on `files` (default: the run's first file), or on synthetic lines if those
    yield no batch (the run reports its own data's problems later); returns the seconds it
    took.  Nothing is saved or logged.  ``workers``: the run's, which decide its --stale-lr
    rule (and so which kernel variants the servers call)."""
    t0 = time.perf_counter()
    cfg = plan.cfg
    mini = dataclasses.replace(cfg, batch_size=WARM_BATCH, global_batch=0, shuffle=False,
                               local_workers=1, save_dir="", metrics_out="", progress_every=0.0,
                               print_every=1 << 30, geo_steps=2, strict=False,
                               stale_lr=stale_rule(cfg.stale_lr, workers))
    files = _first_files(plan) if files is None else files
    try:
        done = _mini_run(mini, plan, files) if files else 0
    except PipeError:       # the run would wait for the command again: fail now, once
        raise
    except (DataError, ValueError, OSError):
        done = 0
    if not done and plan.schema.is_criteo:   # other schemas: no lines to make up; the
        with tempfile.TemporaryDirectory(prefix="mpips-warm-") as tmp:  # run compiles lazily
            _mini_run(mini, plan, _synthetic_file(tmp))
    return time.perf_counter() - t0


def _mini_run(mini, plan, files):
    """WARM_STEPS steps of local training and an evaluation on `files`; the steps done."""
    model = make_model(mini, plan.schema, plan.hidden)
    sparse, dense = make_tables(mini, model, cowclip=plan.cowclip)   # the run's rule's paths
    counted = counts_staleness(mini.mode, mini.staleness)
    ps = LocalPS(sparse, dense, StalenessTracker(sparse) if counted else None,  # as the
                 mini.stale_lr if counted else "none")                        # servers do
    trainer = make_trainer(mini, model, ps, 2,     # two owners: the grouping path too
                           replica=ps.dense, cowclip=plan.cowclip)
    reader = make_reader(mini, files, WARM_BATCH, lambda text: None, schema=plan.schema)
    try:
        steps = trainer.train_epoch(reader, 0, WARM_STEPS).steps
        trainer.evaluate(reader, 2)
    finally:
        reader.close()
        if tier_of(sparse) is not None:         # --table-memory: its folder goes now
            tier_of(sparse).close()
    return steps


def cache_misses():
    """Kernel signatures this process compiled because numba's cache did not hold them."""
    return sum(sum(d.stats.cache_misses.values()) for d in dispatchers().values())


def report_new(before, label, hooks):
    """With ``hooks.list_jit`` (MPIPS_DEBUG_JIT): print kernels compiled since `before` (a
    test aid)."""
    if not hooks.list_jit:
        return
    new = sorted(signatures() - before)
    text = (f"JIT --> {label}: {len(new)} kernel signature(s) compiled after warm-up"
            + "".join(f"\nJIT -->   {k}{s}" for k, s in new) + "\n")
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), text.encode())   # one write: ranks' lines never run together


def main(argv=None):
    """``python -m mpips.job.warmup [train flags]``: warm the numba cache for that run."""
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv, prog="python -m mpips.job.warmup")
        plan = make_plan(dataclasses.replace(cfg, resume="", save_dir=""))   # no checkpoint
    except ValueError as e:
        print(f"mpips: error: {e}", file=sys.stderr)
        return 2
    seconds = warm(plan)
    print(f"mpips: {len(signatures())} kernel signatures ready in {seconds:.1f} s "
          f"(compiled, or loaded from numba's cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
