"""Examples/s against the batch a worker takes: real 2 x W runs, code variants alternated.

    python bench/bench_batch.py --layouts 2x2,2x4 --batches 64,128,256,512,1024 --rounds 3
    python bench/bench_batch.py --layouts 2x4 --global 1024,2048 --rounds 5 \\
        --variant before=/work/main --variant after=.

Every run: ``mpiexec -n S+W python -m mpips.train --servers S`` with ``--batch-size b`` (b a
worker; ``--batches``) or ``--global-batch G`` (``--global``), one epoch of the embedded
synthetic set (or ``--data DIR`` with DIR/train, DIR/test), ``OMP_NUM_THREADS=1
NUMBA_NUM_THREADS=1``.  A variant is ``NAME=ROOT[:FLAGS]``: the package found first on
PYTHONPATH (a checkout or worktree, also the runs' working directory; default: this one)
and extra train flags (words ``NAME=VALUE`` in upper case: environment variables).  Each round
runs every (variant, layout, batch) once, the next round in reverse order, so that the
machine's load falls on all alike.  For each run it keeps the training span's examples/s
(the epoch record), each rank's CPU seconds (the PROFILE lines), worker 0's TIMES line,
test AUC and the 1-minute load average before the run; records go to ``--json`` (JSON
lines, appended as measured).  At the end: per (layout, batch) the median examples/s of each
variant, and each round's ratio of every variant to the first.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402

TIMES_RE = re.compile(r"TIMES --> worker 0 .*?((?:\w+_s: [\d.]+ ?)+)")
PROFILE_RE = re.compile(r"PROFILE --> (\d+) (server|worker) (.*)")


def parse_log(text):
    """(worker 0's TIMES as {phase: s}, [(role, cpu_s)] per rank) from a run's output."""
    times = {}
    m = TIMES_RE.search(text)
    if m:
        times = {k: float(v) for k, v in re.findall(r"(\w+)_s: ([\d.]+)", m.group(1))}
    ranks = [(role, float(rest.split()[-1])) for _, role, rest in PROFILE_RE.findall(text)]
    return times, ranks


def run_one(root, flags, layout, batch, use_global, data, log_dir, tag):
    S, W = (int(x) for x in layout.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        cmd = [mpiexec(), "-n", str(S + W), sys.executable, "-m", "mpips.train",
               "--servers", str(S), "--progress-every", "0", "--print-every", "1000000",
               "--metrics-out", str(out),
               "--global-batch" if use_global else "--batch-size", str(batch)]
        if data:
            cmd += ["--train", f"{data}/train", "--test", f"{data}/test"]
        cmd += flags
        env = {**os.environ, **ENV, "PYTHONPATH": str(Path(root).resolve())}
        env.update(x.split("=", 1) for x in flags if re.match(r"[A-Z][A-Z0-9_]*=", x))
        cmd = [x for x in cmd if not re.match(r"[A-Z][A-Z0-9_]*=", x)]
        load = os.getloadavg()[0]
        t0 = time.time()
        # run from the variant's root: ``python -m`` puts the working directory first
        proc = subprocess.run(cmd, env=env, cwd=Path(root).resolve(), capture_output=True,
                              text=True)
        log = proc.stdout + proc.stderr
        (log_dir / f"{tag}.log").write_text(log)
        if proc.returncode or not out.exists():
            raise SystemExit(f"bench_batch: {' '.join(cmd)} failed (exit {proc.returncode}); "
                             f"see {log_dir / tag}.log")
        rec = json.loads(out.read_text().splitlines()[-1])
    times, ranks = parse_log(log)
    return {"examples_per_sec": rec["examples_per_sec"], "train_seconds": rec["train_seconds"],
            "test_auc": rec.get("test_auc"), "test_logloss": rec.get("test_logloss"),
            "load1": round(load, 2), "wall_s": round(time.time() - t0, 1),
            "worker_cpu_s": [c for r, c in ranks if r == "worker"],
            "server_cpu_s": [c for r, c in ranks if r == "server"], "times": times}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="2x2", help="S x W layouts, comma-separated")
    ap.add_argument("--batches", default="", help="--batch-size values (a worker's batch)")
    ap.add_argument("--global", dest="globals_", default="", help="--global-batch values")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=ROOT[:FLAGS] (repeatable; default: now=<this checkout>)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--data", default="", help="DIR with train/ and test/ (default: embedded)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "bench_batch.jsonl"))
    a = ap.parse_args(argv)
    variants = []
    for v in a.variant or [f"now={ROOT}"]:
        name, _, rest = v.partition("=")
        root, _, flags = rest.partition(":")
        variants.append((name, root, flags.split()))
    cells = [(lay, int(b), False) for lay in a.layouts.split(",")
             for b in a.batches.split(",") if b]
    cells += [(lay, int(g), True) for lay in a.layouts.split(",") for g in a.globals_.split(",") if g]
    if not cells:
        ap.error("give --batches or --global")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / "bench_batch_logs"
    log_dir.mkdir(exist_ok=True)
    results = {}
    for rnd in range(a.rounds):
        order = [(c, v) for c in cells for v in variants]
        for (lay, b, glob), (name, root, flags) in (order if rnd % 2 == 0 else order[::-1]):
            tag = f"{name}-{lay}-{'G' if glob else 'b'}{b}-r{rnd}"
            r = run_one(root, flags, lay, b, glob, a.data, log_dir, tag)
            r |= {"variant": name, "layout": lay, "batch": b, "global": glob, "round": rnd,
                  "flags": " ".join(flags), "root": root}
            with open(out, "a") as f:
                f.write(json.dumps(r) + "\n")
            results.setdefault((lay, b, glob), {}).setdefault(name, {})[rnd] = r
            print(f"{tag}: {r['examples_per_sec']:.0f} ex/s, load {r['load1']}, AUC "
                  f"{r['test_auc']:.4f}, worker CPU {sum(r['worker_cpu_s']):.1f} s, server CPU "
                  f"{sum(r['server_cpu_s']):.1f} s", flush=True)
    first = variants[0][0]
    print("\nlayout batch variant median_ex/s rounds (ratio to " + first + " per round)")
    for (lay, b, glob), by in results.items():
        for name, rs in by.items():
            med = statistics.median(x["examples_per_sec"] for x in rs.values())
            ratios = [rs[k]["examples_per_sec"] / by[first][k]["examples_per_sec"]
                      for k in sorted(rs) if k in by[first]]
            print(f"{lay} {'G' if glob else 'b'}={b} {name} {med:.0f} "
                  + " ".join(f"{x:.3f}" for x in ratios))
    print("\nlayout variant batch: examples/s over the largest batch's, per round")
    for lay in a.layouts.split(","):
        for glob in (False, True):
            bs = sorted(b for (l2, b, g) in results if l2 == lay and g == glob)
            for name, _, _ in variants:
                if len(bs) < 2:
                    continue
                top = results[lay, bs[-1], glob][name]
                for b in bs[:-1]:
                    rs = results[lay, b, glob][name]
                    ratios = [rs[k]["examples_per_sec"] / top[k]["examples_per_sec"]
                              for k in sorted(rs) if k in top]
                    print(f"{lay} {name} {'G' if glob else 'b'}={b} / {bs[-1]}: "
                          + " ".join(f"{x:.3f}" for x in ratios)
                          + f" (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
