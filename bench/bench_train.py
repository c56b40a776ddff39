"""Training benchmark: mpips 2 servers x 2 workers per mode, and the local run, on one machine.

    python bench/bench_train.py                       # 1M train / 200k test rows, all modes
    python bench/bench_train.py --rows 200000 --modes async,local

Prints, per run: train examples/s (training span, and whole job wall time), test AUC,
logloss, bytes sent per example, peak RSS per rank and the per-rank profile (compute,
wait, server busy).  Data: data_prep.synth into bench/out/data (kept between runs).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402

# name -> (mpips.train flags, ranks); bench_vs_torch.py uses the same table
RUNS = {"local": (["--local"], 1), "local2": (["--local", "--local-workers", "2"], 1),
        "async": (["--mode", "async"], 4),
        "sync": (["--mode", "sync"], 4), "geo": (["--mode", "geo", "--geo-steps", "100"], 4),
        "ssp": (["--mode", "ssp", "--staleness", "4"], 4)}


def ensure_data(out, rows, test_rows, seed):
    from data_prep.synth import generate
    d = out / f"data-{rows}-{test_rows}-{seed}"
    if not (d / "train").exists():
        t0 = time.time()
        generate(str(d), rows=rows, parts=8, seed=seed, test_rows=test_rows)
        print(f"generated {rows}+{test_rows} rows in {time.time() - t0:.1f} s -> {d}")
    return d


def run(name, args, n, data, out, extra):
    metrics = out / f"{name}.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [sys.executable, "-m", "mpips.train", "--train", str(data / "train"),
           "--test", str(data / "test"), "--metrics-out", str(metrics)] + args + extra
    if n > 1:
        cmd = [mpiexec(), "-n", str(n)] + cmd
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV),
                          cwd=str(ROOT))
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"{name}: FAILED\n{proc.stderr[-2000:]}")
        return None
    rec = [json.loads(x) for x in metrics.read_text().splitlines()][-1]
    rec["wall_seconds"] = wall
    rec["profile"] = [line for line in proc.stdout.splitlines() if line.startswith("PROFILE")]
    rss = [float(line.split()[9]) for line in rec["profile"][1:]]      # peak_rss_MB column
    rec["peak_rss_mb"] = max(rss) if rss else None
    if n == 1:
        m = re.search(r"peak_rss_mb=(\d+)", proc.stdout)
        rec["peak_rss_mb"] = float(m.group(1)) if m else None
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--test-rows", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="local,local2,async,sync,geo,ssp",
                    help="local2 = one process, batch 2 x B: the run sync mode equals")
    ap.add_argument("--extra", default="", help="extra flags for every run")
    ap.add_argument("--idle-compare", action="store_true",
                    help="also run async with busy-polling servers (--idle-sleep 0)")
    a = ap.parse_args()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    data = ensure_data(out, a.rows, a.test_rows, a.seed)
    extra = a.extra.split()
    runs = dict(RUNS)
    todo = [m for m in a.modes.split(",") if m]
    if a.idle_compare:
        runs["async-spin"] = (["--mode", "async", "--idle-sleep", "0"], 4)
        todo.append("async-spin")
    results = {}
    for name in todo:
        args, n = runs[name]
        rec = run(name, args, n, data, out, extra)
        if rec:
            results[name] = rec
            print(f"{name:10s} ex/s {rec['examples_per_sec']:>9.0f}  job ex/s "
                  f"{rec['train_examples'] / rec['wall_seconds']:>8.0f}  test_auc "
                  f"{rec['test_auc']:.4f}  logloss {rec['test_logloss']:.4f}  bytes/ex "
                  f"{rec.get('bytes_sent_per_example', 0):>7.0f}  peak_rss_MB {rec['peak_rss_mb']}",
                  flush=True)
            for line in rec["profile"]:
                print("    " + line)
    if "local" in results:
        base = results["local"]
        for name, rec in results.items():
            print(f"ratio {name}/local: ex/s x{rec['examples_per_sec'] / base['examples_per_sec']:.2f}"
                  f"  dAUC {rec['test_auc'] - base['test_auc']:+.4f}")
    (out / "bench_train.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
