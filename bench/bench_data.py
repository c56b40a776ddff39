"""Data-path throughput: raw TSV vs binary data parts vs a plain-Python line parser.

    PYTHONPATH=. python bench/bench_data.py [--rows 1000000] [--py-rows 200000]

On one synthetic Criteo file set (``data_prep.synth``, cached under bench/out/):
1. times ``python -m data_prep.criteo`` on it (wall seconds and peak RSS of that process);
2. reads it single-threaded (prefetch off, batch 512) with ``DataReader`` as TSV and as
   prepared binary parts, and with a plain-Python parser (split on TAB, ``int()`` per integer
   field, ``hash() % 1000001`` per categorical — what Paddle's pipe-command reader does)
   on the first ``--py-rows`` lines;
3. prints rows/s and MB/s (of the bytes each reader consumes) per core, and ratios.
Numba compile time is excluded (a warm-up read runs first).  Results also go to
bench/out/bench_data.json.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_prep.synth import generate  # noqa: E402
from mpips.data.criteo import CONT_DIFF, CONT_MIN  # noqa: E402
from mpips.data.files import resolve_paths  # noqa: E402
from mpips.data.reader import DataReader  # noqa: E402

BATCH = 512
SHARD_ROW_BYTES = 13 * 4 + 26 * 8 + 1  # int32 dense + int64 ids + int8 label


def python_parse(path: str, max_rows: int) -> int:
    """Plain-Python Criteo parsing, line by line (Paddle pipe-command style)."""
    lo, diff = CONT_MIN.tolist(), CONT_DIFF.tolist()
    n = 0
    with open(path) as fh:
        for line in fh:
            f = line.rstrip("\n").split("\t")
            label = int(f[0])
            dense = [(int(x) - lo[i]) / diff[i] if x else 0.0 for i, x in enumerate(f[1:14])]
            sparse = [hash(str(i) + x) % 1000001 for i, x in enumerate(f[14:])]
            n += 1 + 0 * (label + len(dense) + len(sparse))
            if n >= max_rows:
                break
    return n


def time_reader(spec, **kw):
    t0 = time.perf_counter()
    rows = sum(len(b) for b in DataReader(spec, BATCH, prefetch=False, **kw))
    return rows, time.perf_counter() - t0


def run_prep(src: str, out: str):
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "data_prep.criteo", "--input", src, "--out", out,
                    "--parts", "8", "--no-progress"], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=ROOT))
    secs = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return secs, rss


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--py-rows", type=int, default=200_000)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    a = ap.parse_args(argv)
    data = os.path.join(a.out, f"bench-data-{a.rows}")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        shutil.rmtree(data, ignore_errors=True)
        generate(data, rows=a.rows, parts=4, seed=0)
    src = os.path.join(data, "train")
    files = resolve_paths(src)
    in_bytes = sum(os.path.getsize(f) for f in files)
    prep_s, prep_rss = run_prep(src, os.path.join(a.out, f"bench-shards-{a.rows}"))
    shard_root = os.path.join(a.out, f"bench-shards-{a.rows}")
    shard_spec = f"{shard_root}/train,{shard_root}/val"
    time_reader(files[0], chunk_bytes=1 << 16)  # warm-up: numba compile / cache load
    time_reader(resolve_paths(shard_spec)[0])
    results = []
    rows, s = time_reader(src)
    results.append(("DataReader TSV (numba)", rows, s, in_bytes / s))
    rows, s = time_reader(shard_spec)
    results.append(("DataReader binary parts (mmap)", rows, s, rows * SHARD_ROW_BYTES / s))
    t0 = time.perf_counter()
    n = python_parse(files[0], a.py_rows)
    s = time.perf_counter() - t0
    results.append(("plain Python split/int/hash", n, s, n * in_bytes / a.rows / s))
    py_rate = results[-1][1] / results[-1][2]
    print(f"input: {a.rows:,} rows, {in_bytes / 1e6:.1f} MB TSV in {len(files)} files; "
          f"batch {BATCH}, one thread, prefetch off")
    print(f"data_prep.criteo: {prep_s:.1f} s wall ({a.rows / prep_s:,.0f} rows/s), "
          f"peak RSS {prep_rss:.0f} MB")
    print(f"{'reader':32s} {'rows':>10s} {'seconds':>8s} {'rows/s':>11s} {'MB/s':>7s} "
          f"{'x Python':>8s}")
    rec = {"rows": a.rows, "input_mb": in_bytes / 1e6, "prep_seconds": prep_s,
           "prep_peak_rss_mb": prep_rss, "readers": {}}
    for name, rows, s, bps in results:
        rate = rows / s
        print(f"{name:32s} {rows:>10,d} {s:>8.2f} {rate:>11,.0f} {bps / 1e6:>7.1f} "
              f"{rate / py_rate:>8.1f}")
        rec["readers"][name] = {"rows": rows, "seconds": s, "rows_per_s": rate,
                                "mb_per_s": bps / 1e6}
    with open(os.path.join(a.out, "bench_data.json"), "w") as fh:
        json.dump(rec, fh, indent=1)


if __name__ == "__main__":
    main()
