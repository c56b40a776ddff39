"""One big CSV shared by workers vs the same rows in parts (issue 35, part 5).

    python bench/bench_one_file.py --out /tmp/onefile [--rows 1000000] [--test-rows 100000]
        [--n 4] [--epochs 1] [--batch-size 512]

Writes the synthetic Criteo set (``mpips.data.synth``, 4 parts) as CSV with a header: one
file ``one.csv`` of every training row, the same rows as ``parts/part-*.csv``, and
``test.csv``; trains ``mpirun -n N`` sync (N - 2 workers: 2 servers) on each, and prints
the rows each worker trained (against the lines that start in its byte share, counted
here), and both test AUCs.  The bar: each worker within one line of its share, and the
AUCs within 0.002.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

from mpips.data.synth import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = ",".join(["label"] + [f"I{k}" for k in range(1, 14)] + [f"C{k}" for k in range(1, 27)])
SCHEMA = ('format = "csv"\nlabel = "label"\n[[dense]]\nnames = [%s]\nnorm = "log1p"\n'
          '[[sparse]]\nnames = [%s]\n') % (
    ", ".join(f'"I{k}"' for k in range(1, 14)), ", ".join(f'"C{k}"' for k in range(1, 27)))


def to_csv(src_files, dst):
    with open(dst, "wb") as out:
        out.write(HEADER.encode() + b"\n")
        for p in src_files:
            out.write(open(p, "rb").read().replace(b"\t", b","))


def prepare(out, rows, test_rows):
    synth = os.path.join(out, "synth")
    if not os.path.exists(os.path.join(synth, "meta.json")):
        generate(synth, rows, 4, 7, test_rows)
    parts = sorted(glob.glob(os.path.join(synth, "train", "*")))
    os.makedirs(os.path.join(out, "parts"), exist_ok=True)
    to_csv(parts, os.path.join(out, "one.csv"))
    for k, p in enumerate(parts):
        to_csv([p], os.path.join(out, "parts", f"part-{k}.csv"))
    to_csv(sorted(glob.glob(os.path.join(synth, "test", "*"))), os.path.join(out, "test.csv"))
    with open(os.path.join(out, "schema.toml"), "w") as f:
        f.write(SCHEMA)


def shares(path, W):
    """Data lines starting in each of W equal byte shares of ``path`` (header excluded)."""
    data = open(path, "rb").read()
    cuts = [w * len(data) // W for w in range(W + 1)]
    starts = [data.count(b"\n", 0, max(c - 1, 0)) + (1 if c > 0 else 0) for c in cuts]
    starts[-1] = data.count(b"\n")
    out = [b - a for a, b in zip(starts, starts[1:])]
    out[0] -= 1                                              # the header line
    return out


def train(out, name, train_path, args):
    metrics = os.path.join(out, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(args.n),
           sys.executable, "-m", "mpips.train", "--mode", "sync", "--train", train_path,
           "--test", os.path.join(out, "test.csv"), "--schema", os.path.join(out, "schema.toml"),
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
           "--metrics-out", metrics, "--progress-every", "0", "--print-every", "100000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=ROOT)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    bad = [x for x in (proc.stdout + proc.stderr).splitlines() if "malformed" in x]
    rec = [json.loads(x) for x in open(metrics)][-1]
    return rec, time.time() - t0, bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--test-rows", type=int, default=100_000)
    ap.add_argument("--n", type=int, default=4, help="ranks (2 servers, the rest workers)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=512)
    args = ap.parse_args(argv)
    prepare(args.out, args.rows, args.test_rows)
    W = args.n - 2
    want = shares(os.path.join(args.out, "one.csv"), W)
    one, t_one, bad_one = train(args.out, "one", os.path.join(args.out, "one.csv"), args)
    parts, t_parts, bad_parts = train(args.out, "parts", os.path.join(args.out, "parts"), args)
    print(f"one file  : worker_examples {one['worker_examples']} (lines in each byte share "
          f"{want}); test AUC {one['test_auc']:.6f}; {t_one:.0f} s; bad lines {len(bad_one)}")
    print(f"4 parts   : worker_examples {parts['worker_examples']}; test AUC "
          f"{parts['test_auc']:.6f}; {t_parts:.0f} s; bad lines {len(bad_parts)}")
    diff = abs(one["test_auc"] - parts["test_auc"])
    ok = diff < 0.002 and one["worker_examples"] == want and not bad_one
    print(f"AUC difference {diff:.6f} ({'within' if diff < 0.002 else 'NOT within'} 0.002); "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
