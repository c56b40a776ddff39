"""What the PROGRESS line costs: the same job with it off, at the default, and every step.

    python bench/bench_progress.py                    # 2x2 async, 300k rows, 2 rounds
    python bench/bench_progress.py --rounds 3 --local

Runs alternate within each round (off, default --progress-every 10, a line after every
step via the test hook), so a drift of the machine hits all variants alike; prints each
run's training-span examples/s, the ratio to `off` in the same round, and the median ratio.
Then, in-process, what one `Progress.tick` costs when no line is due (every step) and when
one is (formatting and printing it), as a fraction of a training step of the `off` runs:
a bound that does not depend on how loaded the machine is.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import ensure_data  # noqa: E402
from common import ENV, ROOT, mpiexec  # noqa: E402

from mpips.job.progress import Progress  # noqa: E402

VARIANTS = (("off", ["--progress-every", "0"], {}),
            ("default (10 s)", ["--progress-every", "10"], {}),
            ("every step", ["--progress-every", "10"], {"MPIPS_DEBUG_PROGRESS_STEPS": "1"}))


def run(args, env, metrics):
    if metrics.exists():
        metrics.unlink()
    proc = subprocess.run(args + ["--metrics-out", str(metrics)], capture_output=True, text=True,
                          env=dict(os.environ, **ENV, **env), cwd=str(ROOT))
    if proc.returncode != 0:
        sys.exit(f"run failed: {' '.join(args)}\n{proc.stderr[-2000:]}")
    lines = sum(line.startswith("PROGRESS") for line in proc.stdout.splitlines())
    return json.loads(metrics.read_text().splitlines()[-1])["examples_per_sec"], lines


def tick_cost(n=200_000):
    """(seconds per tick when no line is due, seconds per tick that prints a line)."""
    quiet = Progress("epoch 0", 10**9, 0, None, 3600.0)
    t0 = time.perf_counter()
    for i in range(n):
        quiet.tick(i, 0.5 * i)
    idle = (time.perf_counter() - t0) / n
    with open(os.devnull, "w") as null:
        loud = Progress("epoch 0", 10**9, 0, None, 0.0, write=lambda s: print(s, file=null))
        t0 = time.perf_counter()
        for i in range(n // 20):
            loud.tick(i, 0.5 * i)
        printing = (time.perf_counter() - t0) / (n // 20)
    return idle, printing


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--local", action="store_true", help="one process instead of 2x2 async")
    a = p.parse_args()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    data = ensure_data(out, a.rows, 0, 0)
    base = [sys.executable, "-m", "mpips.train", "--train", str(data / "train"),
            "--print-every", "100"]
    base = base + ["--local"] if a.local else [mpiexec(), "-n", "4"] + base
    ratios = {name: [] for name, _, _ in VARIANTS[1:]}
    step_s = []
    for r in range(a.rounds):
        rates = {}
        for name, flags, env in VARIANTS:
            rates[name], lines = run(base + flags, env, out / "progress.jsonl")
            print(f"round {r}: {name:15s} {rates[name]:9.0f} ex/s  ({lines} PROGRESS lines)",
                  flush=True)
        workers = 1 if a.local else 2          # a step: 512 rows on each worker
        step_s.append(512 * workers / rates["off"])
        for name in ratios:
            ratios[name].append(rates[name] / rates["off"])
            print(f"round {r}: {name} / off = {ratios[name][-1]:.3f}")
    for name, rs in ratios.items():
        print(f"median {name} / off over {a.rounds} rounds: {statistics.median(rs):.3f} "
              f"({', '.join(f'{x:.3f}' for x in rs)})")
    idle, printing = tick_cost()
    step = statistics.median(step_s)
    print(f"Progress.tick: {idle * 1e6:.2f} us when no line is due, {printing * 1e6:.1f} us "
          f"when it prints; a training step of the off runs: {step * 1e3:.1f} ms (median) -> "
          f"{idle / step:.2e} of a step per step, {printing / step:.2e} per printed line")


if __name__ == "__main__":
    main()
