"""--dense-average: a column of the B table from one training run.

    python bench/bench_average.py --bs 0.97,0.9,0.95,0.98,0.99 -- --local \\
        --train D/train --test D/test --batch-size 4096 --seed 0
    python bench/bench_average.py --bs 0.97,0.9,0.99 -- --local --simulate-workers 32 \\
        --global-batch 4096 --train D/train --test D/test --seed 0

The weights train the same whatever B is (the average is read, never trained on), so one
run gives every B: the run trains with ``--dense-average`` at the first B of ``--bs``, the
averages of the others are stepped beside it with the same kernel after every dense step
(``mpips.kernels.optim.ema_update``, from the same initial weights), and the run's
evaluation scores them all in its one pass over the test set (``Trainer.eval_weights``).
One process only (``--local``, ``--local-workers``, ``--simulate-workers``): a worker's
replica steps only its shard.  Prints a line per B (and B = 0, the trained weights):
test AUC, logloss and mean prediction of the epoch's evaluation, and appends them as one
JSON line to ``--json``.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402,F401  (the repo root on sys.path)

from mpips import train as entry  # noqa: E402
from mpips.kernels.optim import ema_update  # noqa: E402
from mpips.metrics import BinaryMetrics  # noqa: E402
from mpips.tables.dense import DenseTable  # noqa: E402
from mpips.worker.trainer import Trainer  # noqa: E402

import numpy as np  # noqa: E402


def patch(extra_bs):
    """Step the averages of ``extra_bs`` beside every averaging table; evaluate them with
    the run's own; returns {B: BinaryMetrics of every evaluation part (one epoch: the
    --local-workers or simulated workers' parts of its one evaluation) merged}."""
    init, push, weights, evaluate = (DenseTable.__init__, DenseTable.push_range,
                                     Trainer.eval_weights, Trainer.evaluate)
    out = {b: BinaryMetrics() for b in extra_bs}

    def new_init(self, values, opt, average=0.0):
        init(self, values, opt, average)
        self._extra = {b: self.values.copy() for b in extra_bs} if average else {}

    def new_push(self, grads, scale, lo, hi):
        push(self, grads, scale, lo, hi)
        for b, avg in self._extra.items():
            ema_update(avg[lo:hi], self.values[lo:hi], np.float32(b))

    def new_weights(self):
        return weights(self) + [self.replica._extra[b] for b in extra_bs]

    def new_evaluate(self, batches, max_steps=0):
        m = evaluate(self, batches, max_steps)
        if not max_steps:                   # (the kernels' warm-up evaluates 2 batches)
            for b, mb in zip(extra_bs, self.eval_metrics[2:]):
                out[b].merge(mb)
        return m

    DenseTable.__init__, DenseTable.push_range = new_init, new_push
    Trainer.eval_weights, Trainer.evaluate = new_weights, new_evaluate
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", default="0.97,0.9,0.95,0.98,0.99", help="B values; the run "
                    "trains (and records) with the first")
    ap.add_argument("--json", default="", help="append the table's JSON line here")
    ap.add_argument("train", nargs=argparse.REMAINDER, help="-- then python -m mpips.train flags")
    a = ap.parse_args(argv)
    bs = [float(x) for x in a.bs.split(",")]
    flags = [x for x in a.train if x != "--"]
    if "--local" not in flags or "--epochs" in flags or "--stream" in flags:
        raise SystemExit("bench_average: one process and one epoch: give --local, not "
                         "--epochs or --stream")
    metrics = str(Path(a.json or "/tmp/bench_average.json").with_suffix(".run.jsonl"))
    Path(metrics).unlink(missing_ok=True)
    merged = patch(bs[1:])
    rc = entry.main(flags + ["--dense-average", str(bs[0]), "--metrics-out", metrics])
    if rc:
        return rc
    rec = [json.loads(x) for x in open(metrics) if x.strip()][-1]
    table = {0.0: (rec["test_auc_raw"], rec["test_logloss_raw"], rec["test_mean_pred_raw"]),
             bs[0]: (rec["test_auc"], rec["test_logloss"], rec["test_mean_pred"])}
    table.update({b: (m.auc(), m.logloss(), m.mean_pred()) for b, m in merged.items()})
    print(f"flags: {' '.join(flags)}")
    for b in sorted(table):
        auc, ll, mp = table[b]
        print(f"B {b:<5g} auc {auc:.4f} logloss {ll:.4f} mean_pred {mp:.3f}")
    if a.json:
        with open(a.json, "a") as fh:
            fh.write(json.dumps({"flags": flags, "table": {str(b): v for b, v in table.items()}})
                     + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
