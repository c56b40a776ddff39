"""Checkpoint benchmark: HDF5 save/load throughput of one server's shard, and delta sizes.

    python bench/bench_checkpoint.py                       # 4M rows, Adam, dim 10
    python bench/bench_checkpoint.py --rows 1000000 --fractions 0.01,0.1

One process plays one server: a sparse table of --rows ids (lazy Adam, every row pushed
once so its optimizer state is real) and the CTR-DNN dense slice.  It measures a full
save, a load into one table, a re-sharding load (the shard read as server 0 of 2), then
a base followed by one delta per fraction of rows touched (each delta after the
previous one) and the load of the whole base + deltas chain.  The files stay in the
page cache, so the figures are the CPU cost (HDF5, CRC-32, table import), not the disk.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpips import checkpoint as ck
from mpips.models.zoo import make_net
from mpips.schema import Schema
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.tables.ownership import dense_bounds

PUSH_CHUNK = 1 << 18    # rows per push while filling the table


def build(rows, dim, seed):
    opt = OptimizerConfig(name="adam", lr=1e-3)
    sparse = SparseTable(dim, opt, seed=seed, capacity=rows)
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, int(rows * 1.001), dtype=np.int64))[:rows]
    rng.shuffle(keys)
    for lo in range(0, rows, PUSH_CHUNK):
        k = keys[lo:lo + PUSH_CHUNK]
        sparse.push(k, rng.standard_normal((len(k), dim)).astype(np.float32))
    model = make_net("dnn", Schema.criteo(), dim, (400, 400, 400))
    dense = DenseTable(model.init_params(seed), opt)
    dense.push(rng.standard_normal(model.n_params).astype(np.float32))
    return sparse, dense, keys, opt


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def load_time(path, opt, dim, server, n_servers, bounds, capacity):
    """(rows loaded, seconds) of loading ``path`` as ``server`` of ``n_servers``."""
    sparse = SparseTable(dim, opt, seed=0, capacity=capacity)
    dense = DenseTable(np.zeros(bounds[server + 1] - bounds[server]), opt)
    t0 = time.perf_counter()
    ck.load_shard_into(path, sparse, dense, server, n_servers, bounds)
    return len(sparse), time.perf_counter() - t0


def report(name, rows, nbytes, seconds, extra=""):
    print(f"{name:<28} {rows:>11,} {nbytes / 1e6:>10.1f} {seconds:>8.2f} "
          f"{rows / seconds:>12,.0f} {nbytes / 1e6 / seconds:>8.1f}  {extra}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=10)
    p.add_argument("--fractions", default="0.01,0.1,0.5", help="rows touched before each delta")
    p.add_argument("--dir", default="", help="checkpoint root (default: a temp dir, removed)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="mpips-bench-ckpt-")
    t0 = time.perf_counter()
    sparse, dense, keys, opt = build(args.rows, args.dim, seed=1)
    n, P = len(sparse), len(dense)
    print(f"table: {n:,} rows x dim {args.dim}, Adam; {sparse.nbytes / 1e6:.0f} MB in memory; "
          f"dense {P:,} values; built in {time.perf_counter() - t0:.1f} s; root {root}")
    print(f"{'operation':<28} {'rows':>11} {'MB':>10} {'seconds':>8} {'rows/s':>12} {'MB/s':>8}")
    try:
        full, s = timed(lambda: ck.save_local(root, sparse, dense, "full"))
        size = dir_bytes(full)
        report("save full", n, size, s)
        s = load_time(full, opt, args.dim, 0, 1, [0, P], n)[1]
        report("load full (1 server)", n, size, s)
        kept, s = load_time(full, opt, args.dim, 0, 2, dense_bounds(P, 2), n // 2 + n // 8)
        report("load as server 0 of 2", n, size, s, f"kept {kept:,} rows")
        base, s = timed(lambda: ck.save_local(root, sparse, dense, "base"))
        report("save base", n, dir_bytes(base), s)
        rng = np.random.default_rng(2)
        for frac in (float(x) for x in args.fractions.split(",")):
            touched = np.unique(rng.choice(keys, int(n * frac), replace=False))
            for lo in range(0, len(touched), PUSH_CHUNK):
                k = touched[lo:lo + PUSH_CHUNK]
                sparse.push(k, rng.standard_normal((len(k), args.dim)).astype(np.float32))
            last, s = timed(lambda: ck.save_local(root, sparse, dense, "delta"))
            rows = ck.read_manifest(last)["rows"]
            report(f"save delta ({frac:.0%} touched)", rows, dir_bytes(last), s,
                   f"{dir_bytes(last) / size:.1%} of a full save")
        chain = ck.chain(last)
        s = load_time(last, opt, args.dim, 0, 1, [0, P], n)[1]
        report(f"load base + {len(chain) - 1} deltas", n, sum(dir_bytes(c) for c in chain), s)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
