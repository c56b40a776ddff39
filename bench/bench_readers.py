"""Reader throughput by format: the same Criteo rows as TSV, gzip TSV, CSV, slot, MultiSlot.

    PYTHONPATH=. python bench/bench_readers.py [--rows 200000]

Writes ``--rows`` synthetic Criteo rows (``data_prep.synth``) in each format under
bench/out/, reads each with ``DataReader`` (prefetch off, batch 512, one thread, numba
compile excluded by a warm-up) and prints rows/s and MB/s of text, by CPU time (the
process's, so other load on a shared machine counts less) and by wall time.
"""
import argparse
import csv
import gzip
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_prep.synth import generate  # noqa: E402
from mpips.data.files import resolve_paths  # noqa: E402
from mpips.data.reader import DataReader  # noqa: E402
from mpips.schema import DenseGroup, Schema, SparseGroup  # noqa: E402

DENSE = [f"I{k}" for k in range(1, 14)]
CATS = [f"C{k}" for k in range(1, 27)]


def convert(tsv: str, out: str):
    """(path, schema) per format, written from the Criteo TSV file ``tsv``."""
    lines = open(tsv).read().splitlines()
    rows = [ln.split("\t") for ln in lines]
    paths = {k: os.path.join(out, f"data.{k}") for k in ("csv", "slot", "ms", "tsv.gz")}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label"] + DENSE + CATS)
        w.writerows(rows)
    with open(paths["slot"], "w") as f:
        for r in rows:
            f.write(" ".join([f"click:{r[0]}"] + [f"{n}:{v}" for n, v in zip(DENSE, r[1:14]) if v]
                             + [f"{n}:{int(v, 16)}" for n, v in zip(CATS, r[14:]) if v]) + "\n")
    with open(paths["ms"], "w") as f:
        for r in rows:
            parts = [f"1 {v}" if v else "0" for v in r[1:14]]
            parts += [f"1 {int(v, 16)}" if v else "0" for v in r[14:]]
            f.write(" ".join(parts + [f"1 {r[0]}"]) + "\n")
    with open(tsv, "rb") as src, gzip.open(paths["tsv.gz"], "wb", compresslevel=6) as dst:
        dst.write(src.read())
    dense = (DenseGroup(tuple(DENSE), norm="log1p"),)
    sparse = (SparseGroup(tuple(CATS)),)
    return [("Criteo TSV (default schema)", tsv, None),
            ("Criteo TSV gzip", paths["tsv.gz"], None),
            ("CSV with header", paths["csv"],
             Schema(format="csv", delimiter=",", header=True, label="label", dense=dense,
                    sparse=sparse)),
            ("slot text (named slots)", paths["slot"],
             Schema(format="slot", label="click", dense=dense, sparse=sparse)),
            ("MultiSlot", paths["ms"],
             Schema(format="multislot", label="label", fields=tuple(DENSE + CATS + ["label"]),
                    dense=dense, sparse=sparse))]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    a = ap.parse_args(argv)
    data = os.path.join(a.out, f"bench-readers-{a.rows}")
    if not os.path.isdir(data):
        generate(data, rows=a.rows, parts=1, seed=0)
    tsv = resolve_paths(os.path.join(data, "train"))[0]
    print(f"{a.rows} rows; reader: rows/s (CPU) MB/s (CPU) rows/s (wall)")
    for name, path, schema in convert(tsv, data):
        kw = dict(schema=schema, prefetch=False, warn=lambda m: None)
        sum(len(b) for b in DataReader(path, 512, chunk_bytes=1 << 16, **kw))  # compile
        c0, w0 = time.process_time(), time.perf_counter()
        rd = DataReader(path, 512, **kw)
        n = sum(len(b) for b in rd)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        mb = rd.stats.text_bytes / 1e6
        print(f"  {name:30s} {n / cpu / 1e3:6.0f}k {mb / cpu:6.0f} {n / wall / 1e3:6.0f}k"
              f"  ({mb:.0f} MB, {rd.stats.bad_lines} bad)")


if __name__ == "__main__":
    main()
