"""Per-key cost of the sparse table at a given size (CPU time, so a shared machine's load
counts less): build from empty, then pull(create=True) and push of 5k unique existing ids
a call (dim 10, Adam).

    python bench/bench_table.py --rows 5000000
    python bench/bench_table.py --rows 1170000 --dim 9 --keys 50000 --order random --calls 40

``--order random`` names a call's rows in random order, as a server's requests do (a
worker sends its ids sorted, and rows are numbered in order of first sight); ``rows``
(the default, the figures before it existed) in row order.
    PYTHONPATH=/tmp/old python bench/bench_table.py --rows 5000000 --no-repo   # another tree

``--no-repo`` imports ``mpips`` from PYTHONPATH instead of this checkout (to compare with an
older tree, e.g. ``git archive 8935e5d mpips | tar -x -C /tmp/old``); run the two
alternately and compare medians.  Prints one JSON line: build ns/row, pull and push
ns/key, peak RSS.
"""
import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--no-repo", action="store_true", help="use mpips from PYTHONPATH")
    ap.add_argument("--dim", type=int, default=10)
    ap.add_argument("--keys", type=int, default=5000, help="ids a call (unique)")
    ap.add_argument("--order", choices=("rows", "random"), default="rows",
                    help="a call's ids in row order (default) or shuffled")
    a = ap.parse_args()
    if not a.no_repo:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:                       # the layout before the package was layered (an older tree)
        from mpips.server.optim import OptimizerConfig
        from mpips.server.sparse_table import SparseTable
    except ImportError:
        from mpips.tables.optim import OptimizerConfig
        from mpips.tables.sparse import SparseTable

    dim, nk = a.dim, a.keys

    def table():
        return SparseTable(dim, OptimizerConfig("adam", lr=1e-3), seed=0)
    warm, buf = table(), np.empty((max(nk, 5000), dim), np.float32)
    warm.pull(np.arange(5000), buf[:5000], create=True)          # compile outside the timing
    warm.push(np.arange(5000), buf[:5000])
    rng = np.random.default_rng(1)
    t, chunk = table(), 1 << 20
    out = np.empty((chunk, dim), np.float32)
    t0 = time.process_time()
    while len(t) < a.rows:
        ids = rng.integers(1, 2**63 - 1, size=min(chunk, a.rows - len(t)), dtype=np.int64)
        t.pull(ids, out[:len(ids)], create=True)
    build = time.process_time() - t0
    calls = [t.export_rows(np.unique(rng.integers(0, a.rows, nk)))["keys"]
             for _ in range(a.calls)]
    if a.order == "random":
        for k in calls:
            rng.shuffle(k)
    grads = np.full((max(nk, 5000), dim), 1e-3, np.float32)
    t0 = time.process_time()
    for k in calls:
        t.pull(k, buf[:len(k)], create=True)
    pull = time.process_time() - t0
    t0 = time.process_time()
    for k in calls:
        t.push(k, grads[:len(k)])
    push = time.process_time() - t0
    n = sum(len(k) for k in calls)
    print(json.dumps({"rows": a.rows, "dim": dim, "keys": nk, "order": a.order, "build_ns_row": round(build / a.rows * 1e9, 1),
                      "pull_ns_key": round(pull / n * 1e9, 1),
                      "push_ns_key": round(push / n * 1e9, 1),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                           / 2**20, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
