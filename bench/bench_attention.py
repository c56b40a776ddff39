"""Attention pooling against sum pooling: the cost of one training step's model work per
example (pool, forward, backward, the rows' gradients), same network, same bags.

    python bench/bench_attention.py [--len 20] [--batch 512] [--dim 8] [--fc 400,400,400]
        [--units 36] [--rounds 7]

Two history slots (items, categories) of exactly ``--len`` ids each, queried by a target
item and a target category (DIN's shape, data_prep/din_synth.py), under ``dnn`` with
``--fc``.  Rounds alternate the two poolings; prints the median microseconds per example of
each and their ratio (the bar of issue 47: attention <= 2x sum at length 20).  Times are
CPU seconds of this process (one BLAS thread), which a loaded machine hides less than the
clock; run with ``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1``.
"""
import argparse
import time

import numpy as np

from common import ROOT  # noqa: F401  (puts the repo root on sys.path)
from mpips.models.zoo import make_net
from mpips.schema import Schema


def schema(pooling, units):
    hist = {"separator": " ", "pooling": pooling}
    if pooling == "attention":
        hist["attention_units"] = units
    return Schema.from_dict({"format": "csv", "label": "label", "sparse": [
        {**hist, "names": ["hist_items"], "table": "item",
         **({"query": "target_item"} if pooling == "attention" else {})},
        {**hist, "names": ["hist_cats"], "table": "cat",
         **({"query": "target_cat"} if pooling == "attention" else {})},
        {"names": ["target_item"], "table": "item"}, {"names": ["target_cat"], "table": "cat"}]})


def batch(rng, n, L, dim, n_rows=20000):
    lens = np.tile([L, L, 1, 1], n)
    off = np.r_[0, np.cumsum(lens)].astype(np.int64)
    ids = rng.integers(0, n_rows, off[-1])
    uniq, inverse = np.unique(ids, return_inverse=True)
    rows = (0.1 * rng.standard_normal((len(uniq), dim))).astype(np.float32)
    return rows, inverse.astype(np.int64), off, (rng.random(n) < 0.3).astype(np.float32)


def step_seconds(net, params, data, steps):
    rows, inverse, off, label = data
    n = len(label)
    emb = np.empty((n, net.emb_width), np.float32)
    grad, gemb = np.empty(net.n_params, np.float32), np.empty_like(emb)
    grows, dense = np.empty_like(rows), np.zeros((n, 0), np.float32)
    t = time.process_time()
    for _ in range(steps):
        net.pool(rows, inverse, off, emb)
        net.forward_backward(params, emb, dense, label, grad, gemb)
        net.unpool(gemb, inverse, off, grows)
    return (time.process_time() - t) / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--len", type=int, default=20, help="ids in each history (default 20)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--fc", default="400,400,400")
    ap.add_argument("--units", default="36", help="the unit's hidden widths (default 36)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    a = ap.parse_args(argv)
    fc = tuple(int(x) for x in a.fc.split(","))
    units = [int(x) for x in a.units.split(",")]
    data = batch(np.random.default_rng(0), a.batch, a.len, a.dim)
    nets = {p: make_net("dnn", schema(p, units), a.dim, fc) for p in ("sum", "attention")}
    params = {p: net.init_params(0) for p, net in nets.items()}
    for p in nets:
        step_seconds(nets[p], params[p], data, 2)                     # compile, workspaces
    times = {p: [] for p in nets}
    for _ in range(a.rounds):
        for p in nets:
            times[p].append(step_seconds(nets[p], params[p], data, a.steps) / a.batch * 1e6)
    med = {p: float(np.median(t)) for p, t in times.items()}
    ratios = [x / y for x, y in zip(times["attention"], times["sum"])]
    print(f"history {a.len}, batch {a.batch}, dim {a.dim}, dnn --fc {a.fc}, unit {units}: "
          f"CPU us/example sum {med['sum']:.2f}, attention {med['attention']:.2f}; "
          f"attention / sum: median {np.median(ratios):.2f} (rounds {min(ratios):.2f}-"
          f"{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
