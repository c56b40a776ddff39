"""`python -m mpips.infer`: score a data set with a checkpoint, in one process or under mpirun.

    python -m mpips.infer --checkpoint ckpts/ --data data/test --metrics-out m.json
    mpirun -n 4 python -m mpips.infer --checkpoint ckpts/ --data data/test --predictions-out p.txt
    python -m mpips.infer --checkpoint ckpts/ --data unlabeled/ --no-label --predictions-out p.txt

``--checkpoint`` (old name ``--model``, still taken, with a note) is a checkpoint
directory or a root (its newest checkpoint whose whole chain verifies, chosen by the first
rank; one that does not is passed over with a warning).  The
table is read straight from the checkpoint's shard files — keys, embedding values and
dense weights, never the optimizer state — and the base..delta chain is folded into one
read-only table (``mpips.serving.model.ServingModel``; ids the checkpoint does not hold read
zeros).  The data are read as the run read them: its hash bucket, and the normalisation
values the checkpoint recorded from the run's ``--stats`` (not the file as it is now).  A
chain whose elements disagree on a setting that changes what the numbers mean
(``mpips.checkpoint.compat.MEANING``) is refused.  No server ranks: scoring needs no messages.
Under mpirun the first rank of each node loads the table into MPI shared memory and the
node's other ranks map it, so a node holds one copy whatever N is (``--table-per-rank``:
every rank loads its own; docs/serving.md has the measurements).

Data parallel: the files are split over the ranks in contiguous blocks as in training
(``split_files``; with fewer files than ranks, rank r takes file r).  Each file is scored
in batches from its own start, so a prediction does not depend on N: the predictions and
the AUC histograms are the ones a single process computes, and the histograms are
summed exactly (``BinaryMetrics`` states hold integer counts) into one global AUC.

Output: ``TEST --> batch: B loss: L auc: A`` every ``--print-every`` batches (rank 0's
running metrics) and a summary line; ``--metrics-out`` gets one JSON object (test_examples,
test_auc, test_logloss, test_mean_pred, test_ctr, seconds, examples_per_sec,
load_seconds, memory_mb (sum over ranks of the proportional set size), cpu_seconds
(scoring, summed over ranks), ranks,
checkpoint, meta); ``--predictions-out`` one probability per line,
files in order and lines in order whatever N is (each rank writes its part, then copies
it into the file at its offset).  ``--no-label``: the files have no label column (a
Criteo TSV line of 39 fields; a CSV without the label's column, ...); the scores are
written, the metrics count examples only (AUC, logloss, mean_pred, ctr are null).
On failure: one line on stderr naming the rank, exit
code 1 (2 for usage errors).
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import traceback

import numpy as np

from mpips.comm.backoff import COLLECTIVE, Backoff
from mpips.job.build import make_reader
from mpips.serving.bundle import Snapshot, bundle_info, schema_of_manifest
from mpips.checkpoint import read_manifest, resolve, saved_settings
from mpips.checkpoint.compat import check_wanted
from mpips.checkpoint.load import add_checkpoint_option, checkpoint_arg
from mpips.config import MODELS, Config
from mpips.data.files import resolve_paths, split_files
from mpips.models.zoo import metrics_for
from mpips.job.resume import first_rank_decides
from mpips.serving.model import ServingModel, hash_slots
from mpips.serving.shared import node_window, table_layout
from mpips.tables.sparse import slots_for

PROG = "python -m mpips.infer"
MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description="Score data with a mpips checkpoint.")
    add_checkpoint_option(p)
    p.add_argument("--data", required=True, help="data: file, folder, glob or comma list")
    p.add_argument("--metrics-out", default="", help="write the metrics as JSON to this file")
    p.add_argument("--predictions-out", default="", help="write one probability per line")
    p.add_argument("--batch-size", type=int, default=0, help="examples per batch "
                   "(0 = the batch size stored in the checkpoint's config)")
    p.add_argument("--print-every", type=int, default=0, help="log a TEST line every N "
                   "batches (0 = the stored print_every)")
    p.add_argument("--table-per-rank", action="store_true", help="every rank loads its own "
                   "copy of the table (default: one copy per node, in MPI shared memory)")
    p.add_argument("--network", default="", choices=("",) + MODELS, help="the network the "
                   "checkpoint must hold: dnn, wide_deep or deepfm (default: the one stored in it)")
    p.add_argument("--no-label", action="store_true", help="the data has no label column: "
                   "write --predictions-out (metrics count examples only; no AUC or logloss)")
    p.add_argument("--schema", default="", help="feature schema TOML the data is in; it must "
                   "be the checkpoint's (default: the schema stored in the checkpoint)")
    return p


def config_from_manifest(manifest):
    """The stored run config as a Config (fields unknown to this version are dropped; the
    schema is the one stored in the manifest, not the file the run was given, which may
    have moved: the data is read with the model's schema)."""
    names = {f.name for f in dataclasses.fields(Config)} - {"schema"}
    stored = {k: v for k, v in manifest["config"].items() if k in names}
    stored.setdefault("embedding_dim", manifest["embedding_dim"])
    stored.setdefault("optimizer", manifest["optimizer"]["name"])
    return Config(**stored).validate()


def my_files(files, n_ranks, rank):
    """Rank's contiguous block of files (as training splits them); [] if none is left."""
    if len(files) >= n_ranks:
        return split_files(files, n_ranks, rank)
    return files[rank:rank + 1]


class Group:
    """The few collectives infer needs; one process when comm is None."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = (comm.rank, comm.size) if comm is not None else (0, 1)

    def _wait(self, req):
        backoff = Backoff(*COLLECTIVE)          # idle ranks sleep (other ranks still score)
        while not req.Test():
            backoff.sleep()

    def allreduce(self, arr, op="sum"):
        if self.comm is None:
            return arr.copy()
        from mpi4py import MPI
        out = np.empty_like(arr)
        ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._wait(self.comm.Iallreduce(arr, out, op=ops[op]))
        return out

    def agree(self, fn):
        """fn() on every rank; if it raised anywhere, the lowest such rank re-raises (one
        error line for the job) and the others leave quietly (SystemExit 1)."""
        try:
            out, err = fn(), None
        except (ValueError, OSError) as e:
            out, err = None, e
        first = int(self.allreduce(np.array([self.rank if err else self.size]), "min")[0])
        if first == self.rank:
            raise err
        if first < self.size:
            raise SystemExit(1)
        return out

    def allgather(self, value):
        arr = np.array([value], np.int64)
        if self.comm is None:
            return arr
        out = np.empty(self.size, np.int64)
        self._wait(self.comm.Iallgather(arr, out))
        return out

    def barrier(self, comm=None):
        comm = comm or self.comm
        if comm is not None:
            self._wait(comm.Ibarrier())

    def node(self):
        """The communicator of this node's ranks, or None when this rank is alone on it."""
        if self.comm is None:
            return None
        from mpi4py import MPI
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        if node.size == 1:
            node.Free()
            return None
        return node


def pss_mb():
    """This process's proportional set size (shared pages divided among their users), MB."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def warm_up(model):
    """Score one row: the kernels' first calls (numba) count as loading, not scoring."""
    dense = np.zeros((1, model.n_dense), np.float32)
    model.predict(dense, np.zeros((1, model.n_sparse), np.int64))
    if not model.schema.one_hot:
        model.predict(dense, np.zeros(1, np.int64),
                      offsets=np.minimum(np.arange(model.n_sparse + 1), 1))


def load_model(path, group, say, share=True):
    """(Snapshot, ServingModel, shared window or None) of checkpoint ``path``.

    With several ranks on a node, the table is held ONCE per node in MPI shared memory: the
    node's first rank reads the shards and builds the hash map, the others map its memory.
    """
    node = group.node() if share else None
    if node is None:
        snap = Snapshot(path, warn=say)
        return snap, ServingModel.from_snapshot(snap), None
    leader = node.rank == 0
    snap = Snapshot(path, warn=say, load=leader)
    info = bundle_info(snap)
    sizes = np.zeros(3, np.int64)
    if leader:
        sizes[:] = [len(snap.keys), slots_for(len(snap.keys)), len(snap.dense)]
    else:                          # meanwhile, the first kernel calls on an empty model
        warm_up(ServingModel(np.empty(0, np.int64), np.empty((0, snap.dim), np.float32),
                             np.zeros(info["model"]["n_params"], np.float32), info["model"],
                             info["data"], schema=schema_of_manifest(info)))
    group._wait(node.Ibcast(sizes, root=0))
    n, n_slots, n_params = (int(x) for x in sizes)
    win, views = node_window(node, table_layout(n, snap.dim, n_slots, n_params), leader)
    if leader:                     # the table goes into shared memory, the hash map is built there
        views["keys"][:], views["values"][:], views["params"][:] = snap.keys, snap.values, \
            snap.dense
        snap.keys = snap.values = snap.dense = None
        hash_slots(views["keys"], views["slots"])
    group.barrier(node)
    model = ServingModel(views["keys"], views["values"], views["params"], info["model"],
                         info["data"], info["checkpoint"], slots=views["slots"],
                         schema=schema_of_manifest(info))
    return snap, model, (win, node)


def _nan(x):
    return float("nan") if x is None else x


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def score_files(cfg, model, files, batch_size, sink, on_batch, norm=None, has_label=True):
    """Score files one by one (batches from each file's start); return BinaryMetrics
    (without labels: its count only, every example counted as a 0 of probability 0).
    norm: (cont_min, cont_diff) to read with instead of --stats' file."""
    m = metrics_for(model.network())
    fmt = "%.7g\n" if model.n_tasks == 1 else "\t".join(["%.7g"] * model.n_tasks) + "\n"
    for path in files:
        with contextlib.closing(make_reader(cfg, [path], batch_size, on_batch.warn,
                                            norm=norm, schema=model.schema,
                                            has_label=has_label)) as reader:
            for batch in reader:
                probs = model.predict(batch.dense, batch.sparse,          # (B,) / (B, T)
                                      offsets=batch.offsets)
                m.update(probs if has_label else np.zeros_like(probs), batch.label)
                if sink is not None:
                    sink.write((fmt * len(probs)) % tuple(probs.ravel().tolist()))
                on_batch(m)
    return m


class _Progress:
    def __init__(self, every, log, has_label=True):
        self.every, self.log, self.batches, self.has_label = every, log, 0, has_label

    def warn(self, msg):
        self.log(msg)

    def __call__(self, m):
        self.batches += 1
        if self.batches % self.every == 0:
            self.log(f"TEST --> batch: {self.batches} loss: {m.logloss():.6f} auc: {m.auc():.6f}"
                     if self.has_label else
                     f"SCORE --> batch: {self.batches} examples: {m.count}")


def gather_predictions(group, part, out):
    """Copy every rank's part file into ``out`` at its offset (rank order), then commit."""
    sizes = group.allgather(os.path.getsize(part))
    offset = int(sizes[:group.rank].sum())
    tmp = out + ".tmp"
    if group.rank == 0:
        with open(tmp, "wb") as fh:
            fh.truncate(int(sizes.sum()))
    group.barrier()
    with open(part, "rb") as src, open(tmp, "r+b") as dst:
        dst.seek(offset)
        shutil.copyfileobj(src, dst, 1 << 20)
    os.remove(part)
    group.barrier()
    if group.rank == 0:
        os.replace(tmp, out)


def run(args, log=print, comm=None):
    """Score; return the metrics record (the same on every rank)."""
    group = Group(comm)
    say = log if group.rank == 0 else (lambda s: None)
    labelled = not getattr(args, "no_label", False)
    t0 = time.perf_counter()
    path = group.agree(lambda: first_rank_decides(comm, lambda: resolve(args.checkpoint)))
    files = group.agree(lambda: (Snapshot(path, load=False), resolve_paths(args.data))[1])
    group.agree(lambda: check_wanted(read_manifest(path), path, args.network, args.schema))
    snap, model, shared = load_model(path, group, say, not args.table_per_rank)
    warm_up(model)
    cfg = config_from_manifest(snap.manifest)
    norm = saved_settings(snap.manifest)["norm"]         # the values it was trained with
    norm = (norm["cont_min"], norm["cont_diff"]) if isinstance(norm, dict) else None
    load_s = time.perf_counter() - t0
    batch_size = args.batch_size or cfg.batch_size
    mine = my_files(files, group.size, group.rank)
    say(f"mpips infer: checkpoint {snap.path} ({snap.manifest['mode']}, {len(model)} rows, "
        f"{len(model.params)} dense parameters), batch {batch_size}, {group.size} rank(s), "
        f"{len(files)} file(s); loaded in {load_s:.2f} s")
    part = None
    if args.predictions_out:
        part = args.predictions_out + (f".part-{group.rank:05d}" if group.size > 1 else ".tmp")
    t1, c1 = time.perf_counter(), time.process_time()
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(part, "w")) if part else None
        local = score_files(cfg, model, mine, batch_size, sink,
                            _Progress(args.print_every or cfg.print_every, say, labelled),
                            norm, labelled)
    score_s, cpu_s = time.perf_counter() - t1, time.process_time() - c1
    m = local.with_state(group.allreduce(local.state()))
    seconds = float(group.allreduce(np.array([score_s]), op="max")[0])
    load_s = float(group.allreduce(np.array([load_s]), op="max")[0])
    pss, cpu_s = (float(x) for x in group.allreduce(np.array([pss_mb(), cpu_s])))
    if shared is not None:                       # every rank of the node is done with it
        del model
        group.barrier(shared[1])
        shared[0].Free()
        shared[1].Free()
    if part:
        if group.size > 1:
            gather_predictions(group, part, args.predictions_out)
        else:
            os.replace(part, args.predictions_out)
    if m.count == 0:
        raise ValueError(f"--data {args.data}: no examples")
    if not labelled:                  # no labels: no metric but the count
        auc = logloss = mean_pred = ctr = None
    else:
        auc, logloss, mean_pred, ctr = (_finite(x) for x in (m.auc(), m.logloss(),
                                                              m.mean_pred(), m.observed_ctr()))
    rec = {"checkpoint": snap.path, "data": args.data, "ranks": group.size,
           "test_examples": int(m.count), "test_auc": auc, "test_logloss": logloss,
           "test_mean_pred": mean_pred, "test_ctr": ctr, "seconds": round(seconds, 4),
           "load_seconds": round(load_s, 4), "memory_mb": round(pss, 1),
           "cpu_seconds": round(cpu_s, 4),
           "examples_per_sec": round(m.count / seconds, 1) if seconds > 0 else 0.0,
           "meta": snap.manifest["meta"]}
    if labelled and hasattr(m, "task_fields"):        # several labels: per-task figures
        rec["tasks"] = {n: {k: _finite(v) for k, v in f.items()}
                        for n, f in m.task_fields("test_").items()}
    if labelled:
        say(f"TEST --> examples: {rec['test_examples']} auc: {m.auc():.6f} logloss: "
            f"{m.logloss():.6f} mean_pred: {m.mean_pred():.6f} ctr: {m.observed_ctr():.6f} "
            f"seconds: {seconds:.2f} examples/s: {rec['examples_per_sec']:.0f}"
            + (" | TASKS " + "; ".join(f"{n}: auc {_nan(t['test_auc']):.6f}"
                                       for n, t in rec["tasks"].items())
               if "tasks" in rec else ""))
    else:
        say(f"SCORE --> examples: {rec['test_examples']} (no labels) seconds: {seconds:.2f} "
            f"examples/s: {rec['examples_per_sec']:.0f}")
    if args.metrics_out and group.rank == 0:
        tmp = args.metrics_out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(json.dumps(rec) + "\n")
        os.replace(tmp, args.metrics_out)
    return rec


def _world():
    """COMM_WORLD when started by an MPI launcher, else None (no MPI import)."""
    if not any(k in os.environ for k in MPI_ENV):
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else None


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    checkpoint_arg(parser, args, lambda s: print(s, file=sys.stderr, flush=True))
    for name in ("batch_size", "print_every"):
        if getattr(args, name) < 0:
            print(f"mpips.infer: error: --{name.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    if args.no_label and not args.predictions_out:
        print("mpips.infer: error: --no-label scores data without labels: give "
              "--predictions-out FILE to write the scores", file=sys.stderr)
        return 2
    comm = _world()
    try:
        run(args, log=lambda s: print(s, flush=True), comm=comm)
        return 0
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - the boundary of the program
        who = "" if comm is None else f"rank {comm.rank}: "
        print(f"mpips.infer: {who}error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("MPIPS_TRACEBACK"):
            traceback.print_exc()
        if comm is not None:
            time.sleep(0.2)    # let the line reach the launcher before the job is torn down
            comm.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
