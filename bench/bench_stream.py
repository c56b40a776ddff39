"""Online-training benchmark: a 3-day x 24-hour synthetic stream, 2 servers x 2 workers.

    pip install -e '.[plot]'
    python bench/bench_stream.py                   # writes bench/stream.png and prints a table

Runs the same stream twice, with eviction (`--shrink-every pass --shrink-threshold 6`: rows
unseen for 6 hours go) and without (`--shrink-every never`), both with `--entry count:2` and a
base/delta save per pass.  Prints per-day progressive AUC, table rows and wall time per pass,
and plots them per pass with `mpips.plot` (progressive AUC, table rows, ids admitted /
waiting / evicted, examples/s).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402

from mpips.plot import PlotError, plot_files  # noqa: E402





def run(name, stream, out, extra):
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*"):
        if f.is_file():
            f.unlink()
    ck = out / "ck"
    subprocess.run(["rm", "-rf", str(ck)], check=True)
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "mpips.train", "--stream", str(stream),
           "--save-dir", str(ck), "--entry", "count:2", "--metrics-out", str(out / "m.jsonl"),
           "--print-every", "100000"] + extra
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV),
                          cwd=str(ROOT))
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in open(out / "m.jsonl")]
    print(f"{name}: {len(recs)} passes in {time.time() - t0:.1f} s")
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--days", type=int, default=3)
    ap.add_argument("--hours", type=int, default=24)
    ap.add_argument("--rows-per-pass", type=int, default=2000)
    a = ap.parse_args()
    from data_prep.stream_synth import generate_stream
    base = ROOT / "bench" / "out" / "stream"
    data = base / f"data-{a.days}-{a.hours}-{a.rows_per_pass}"
    if not (data / "stream_meta.json").exists():
        generate_stream(str(data), a.days, a.hours, a.rows_per_pass)
    runs = {"evict": run("with eviction", data, base / "evict",
                         ["--shrink-every", "pass", "--shrink-threshold", "6"]),
            "keep": run("without eviction", data, base / "keep", ["--shrink-every", "never"])}
    print("day       | AUC evict | AUC keep | rows evict | rows keep | s/pass evict | s/pass keep")
    for day in sorted({r["pass"][:8] for r in runs["evict"]}):
        e = [r for r in runs["evict"] if r["pass"].startswith(day)]
        k = [r for r in runs["keep"] if r["pass"].startswith(day)]
        mean = lambda rs, f: sum(r[f] for r in rs) / len(rs)   # noqa: E731
        print(f"{day}  | {mean(e, 'test_auc'):.4f}    | {mean(k, 'test_auc'):.4f}   | "
              f"{e[-1]['table_rows']:>10} | {k[-1]['table_rows']:>9} | "
              f"{mean(e, 'train_seconds'):.3f}        | {mean(k, 'train_seconds'):.3f}")
    try:
        plot_files([str(base / "evict" / "m.jsonl"), str(base / "keep" / "m.jsonl")],
                   str(ROOT / "bench" / "stream.png"), labels=["with eviction", "without eviction"],
                   title=f"{a.days} days x {a.hours} passes, {a.rows_per_pass} rows/pass, 2x2 async")
    except PlotError as e:       # matplotlib missing
        print(e)
        return
    print("wrote bench/stream.png")


if __name__ == "__main__":
    main()
