"""`python -m mpips.infer`: evaluate a checkpoint on a data set in one process.

    python -m mpips.infer --model ckpts/ --data data/test --metrics-out m.json
    python -m mpips.infer --model ckpts/ckpt-000004-delta --data day_2/ --predictions-out p.txt

``--model`` is a checkpoint directory or a root (its latest committed checkpoint).  The
base..delta chain is loaded into one sparse and one dense table, the model is rebuilt
from the stored config, and the data are read with the stored data settings (format,
``hash_bucket``).  Ids the checkpoint does not hold read as zeros (no rows are created).
The evaluation loop is the trainer's (``Trainer.evaluate``); this module only observes
its predictions for the running ``TEST --> batch: ...`` lines and the predictions file.

Output: ``TEST --> batch: B loss: L auc: A`` every ``--print-every`` batches and a
summary line; ``--metrics-out`` gets one JSON object (test_examples, test_auc,
test_logloss, test_mean_pred, test_ctr, seconds, examples_per_sec, checkpoint, meta);
``--predictions-out`` one probability per line, in data order.  On failure: one line on
stderr and exit code 1 (2 for usage errors).
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from collections import deque

import numpy as np

from mpips import checkpoint as ck
from mpips.build import make_model, make_reader
from mpips.config import Config, check_compatible
from mpips.metrics import BinaryMetrics
from mpips.server.dense_table import DenseTable
from mpips.server.optim import OptimizerConfig
from mpips.server.sparse_table import SparseTable
from mpips.ownership import plan_keys
from mpips.worker.local import LocalPS
from mpips.worker.trainer import Trainer

PROG = "python -m mpips.infer"


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description="Evaluate a mpips checkpoint on data.")
    p.add_argument("--model", required=True, help="checkpoint directory, or a root holding "
                   "ckpt-* directories (the latest committed one is used)")
    p.add_argument("--data", required=True, help="data: file, folder, glob or comma list")
    p.add_argument("--metrics-out", default="", help="write the metrics as JSON to this file")
    p.add_argument("--predictions-out", default="", help="write one probability per line")
    p.add_argument("--batch-size", type=int, default=0, help="examples per batch "
                   "(0 = the batch size stored in the checkpoint's config)")
    p.add_argument("--print-every", type=int, default=0, help="log a TEST line every N "
                   "batches (0 = the stored print_every)")
    return p


def config_from_manifest(manifest):
    """The stored run config as a Config (fields unknown to this version are dropped)."""
    names = {f.name for f in dataclasses.fields(Config)}
    stored = {k: v for k, v in manifest["config"].items() if k in names}
    stored.setdefault("embedding_dim", manifest["embedding_dim"])
    stored.setdefault("optimizer", manifest["optimizer"]["name"])
    return Config(**stored).validate()


def load_model(path, warn=None):
    """(cfg, model, LocalPS, manifest, checkpoint dir) for checkpoint dir or root ``path``."""
    ckpt_dir = ck.resolve(path, warn)
    elements = ck.chain(ckpt_dir)
    manifest = ck.read_manifest(ckpt_dir)
    cfg = config_from_manifest(manifest)
    check_compatible(manifest, cfg)
    model = make_model(cfg)
    opt = OptimizerConfig(**manifest["optimizer"])
    rows = sum(ck.read_manifest(d)["rows"] for d in elements)   # upper bound: no regrowth
    sparse = SparseTable(cfg.embedding_dim, opt, seed=cfg.seed, init_range=cfg.init_range,
                         capacity=max(rows, 1))
    dense = DenseTable(np.zeros(model.n_params, np.float32), opt)
    ck.load_shard_into(ckpt_dir, sparse, dense, 0, 1, [0, model.n_params])
    return cfg, model, LocalPS(sparse, dense), manifest, ckpt_dir


class _Tap:
    """Stands in for the model inside Trainer.evaluate and observes each batch's output.

    evaluate() prepares batch t+1 before predicting batch t, so labels queue up in the
    order batches were drawn and predictions come back in that same order.
    """

    def __init__(self, model, print_every, pred_file, log):
        self.model, self.print_every = model, print_every
        self.pred_file, self.log = pred_file, log
        self.labels = deque()
        self.metrics = BinaryMetrics()
        self.batches = 0

    @property
    def n_params(self):
        return self.model.n_params

    def batches_of(self, reader):
        for batch in reader:
            self.labels.append(batch.label)
            yield batch

    def predict(self, params, emb, dense, out):
        self.model.predict(params, emb, dense, out)         # out (B,) probabilities
        self.metrics.update(out, self.labels.popleft())
        self.batches += 1
        if self.pred_file is not None:
            self.pred_file.write(("%.7g\n" * len(out)) % tuple(out.tolist()))
        if self.batches % self.print_every == 0:
            self.log(f"TEST --> batch: {self.batches} loss: {self.metrics.logloss():.6f} "
                     f"auc: {self.metrics.auc():.6f}")


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def run(args, log=print):
    """Evaluate; return the metrics record."""
    cfg, model, ps, manifest, ckpt_dir = load_model(args.model, warn=log)
    batch_size = args.batch_size or cfg.batch_size
    print_every = args.print_every or cfg.print_every
    log(f"mpips infer: checkpoint {ckpt_dir} ({manifest['mode']}, {len(ps.sparse)} rows, "
        f"{model.n_params} dense parameters), batch {batch_size}")
    with contextlib.ExitStack() as stack:
        reader = make_reader(cfg, args.data, batch_size, log)
        stack.callback(reader.close)
        pred_file = None
        if args.predictions_out:
            pred_file = stack.enter_context(open(args.predictions_out, "w"))
        tap = _Tap(model, print_every, pred_file, log)
        trainer = Trainer(cfg, tap, ps, lambda ids: plan_keys(ids, 1))
        t0 = time.perf_counter()
        m = trainer.evaluate(tap.batches_of(reader))
        seconds = time.perf_counter() - t0
    if m.count == 0:
        raise ValueError(f"--data {args.data}: no examples")
    rec = {"checkpoint": ckpt_dir, "data": args.data, "batches": tap.batches,
           "test_examples": int(m.count), "test_auc": _finite(m.auc()),
           "test_logloss": _finite(m.logloss()), "test_mean_pred": _finite(m.mean_pred()),
           "test_ctr": _finite(m.observed_ctr()), "seconds": round(seconds, 4),
           "examples_per_sec": round(m.count / seconds, 1) if seconds > 0 else 0.0,
           "meta": manifest["meta"]}
    log(f"TEST --> examples: {rec['test_examples']} auc: {m.auc():.6f} logloss: "
        f"{m.logloss():.6f} mean_pred: {m.mean_pred():.6f} ctr: {m.observed_ctr():.6f} "
        f"seconds: {seconds:.2f} examples/s: {rec['examples_per_sec']:.0f}")
    if args.metrics_out:
        tmp = args.metrics_out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(json.dumps(rec) + "\n")
        os.replace(tmp, args.metrics_out)
    return rec


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("batch_size", "print_every"):
        if getattr(args, name) < 0:
            print(f"mpips.infer: error: --{name.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    try:
        run(args, log=lambda s: print(s, flush=True))
        return 0
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - the boundary of the program
        print(f"mpips.infer: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("MPIPS_TRACEBACK"):
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
