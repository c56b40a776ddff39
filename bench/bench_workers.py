"""Quality as workers are added: test AUC and logloss against W, real runs and simulated.

    python -m data_prep.criteo_like --out /tmp/cl1m --rows 1000000 --test-rows 200000 \\
        --card-scale 0.05
    python bench/bench_workers.py --data /tmp/cl1m --real 2,4,8 --sim 2,4,8,16,32,64
    python bench/bench_workers.py --data /tmp/cl1m --rule "old=--stale-lr none" --real 4,8
    python bench/bench_workers.py --replot bench/out/bench_workers.json [--data DIR]

Every run: one epoch, Adam lr 1e-3, batch 512 per worker (the train defaults), on
DATA/train, tested on DATA/test.  ``local`` is ``--local`` (one process, batch 512): the
yardstick every other run is compared with.  For each rule (``--rule NAME=FLAGS``, repeatable;
default: one rule ``default`` with no flags) and each W:
- ``async`` (``--real``): ``mpiexec -n 2+W python -m mpips.train --servers 2`` (mode async);
- ``sync`` (``--sync``): ``--local --local-workers W``, which equals 2 x W sync bit for bit
  (docs/modes.md), in one process;
- ``sim`` (``--sim``): ``--local --simulate-workers W`` (the async simulator).
Each record: AUC, logloss, mean prediction and their differences to ``local``; the servers'
staleness summary for real runs and the simulator's.  Records go to bench/out/bench_workers.json
(``--json``; runs already there with the same name are reused unless ``--force``), and a plot
of AUC and logloss minus local against W (one line per rule and kind) to docs/workers.png
(``--plot``; matplotlib, the ``bench`` extra).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402

KEYS = ("test_auc", "test_logloss", "test_mean_pred", "test_ctr", "examples_per_sec",
        "push_staleness")


def run_one(data, kind, W, flags, log_dir):
    """One training run; returns its epoch record (the keys above) and wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        args = [sys.executable, "-m", "mpips.train", "--train", f"{data}/train",
                "--test", f"{data}/test", "--progress-every", "0", "--metrics-out", str(out)]
        if kind == "async":
            cmd = [mpiexec(), "-n", str(2 + W)] + args + ["--servers", "2"]
        elif kind == "sync":
            cmd = args + ["--local", "--local-workers", str(W)]
        elif kind == "sim":
            cmd = args + ["--local", "--simulate-workers", str(W)]
        else:
            cmd = args + ["--local"]
        cmd += shlex.split(flags)
        t0 = time.time()
        with open(log_dir / f"{kind}-{W}.log", "w") as log:
            rc = subprocess.run(cmd, env={**os.environ, **ENV}, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT).returncode
        if rc or not out.exists():
            raise SystemExit(f"bench_workers: {' '.join(cmd)} failed (exit {rc}); "
                             f"see {log_dir / f'{kind}-{W}.log'}")
        rec = json.loads(out.read_text().splitlines()[-1])
    return {k: rec[k] for k in KEYS if k in rec} | {"wall_s": round(time.time() - t0, 1)}


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    base = next(r for r in records if r["kind"] == "local")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lines = sorted({(r["rule"], r["kind"]) for r in records if r["kind"] != "local"})
    for (rule, kind) in lines:
        rs = sorted((r for r in records if (r["rule"], r["kind"]) == (rule, kind)),
                    key=lambda r: r["W"])
        style = {"async": "o-", "sim": "s--", "sync": "^:"}[kind]
        for ax, key in zip(axes, ("test_auc", "test_logloss")):
            ax.plot([r["W"] for r in rs], [r[key] - base[key] for r in rs], style,
                    label=f"{rule} {kind}")
    axes[0].set_ylim(-0.05, 0.01)         # diverged runs (AUC 0.5-0.57) fall off the chart
    axes[1].set_ylim(-0.01, 0.05)
    for ax, key, bar in zip(axes, ("AUC", "logloss"), (0.003, 0.003)):
        ax.axhline(0, color="k", lw=0.8)
        for b in (-bar, bar):
            ax.axhline(b, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers W")
        ax.set_ylabel(f"test {key} - --local")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("quality against workers (real 2 x W async, sync = --local-workers W, "
                 "sim = --simulate-workers W)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def table(records):
    base = next(r for r in records if r["kind"] == "local")
    print(f"{'rule':12s} {'kind':6s} {'W':>3s} {'AUC':>7s} {'dAUC':>8s} {'logloss':>8s} "
          f"{'dLL':>8s} {'pred':>6s} {'stale p50/p90/max':>18s}")
    for r in sorted(records, key=lambda r: (r["rule"], r["kind"], r["W"])):
        st = r.get("push_staleness") or {}
        s = f"{st.get('p50', '')}/{st.get('p90', '')}/{st.get('max', '')}" if st else ""
        print(f"{r['rule']:12s} {r['kind']:6s} {r['W']:3d} {r['test_auc']:.4f} "
              f"{r['test_auc'] - base['test_auc']:+.4f} {r['test_logloss']:.4f} "
              f"{r['test_logloss'] - base['test_logloss']:+.4f} "
              f"{r.get('test_mean_pred', 0):.4f} {s:>18s}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="DIR with train/ and test/")
    ap.add_argument("--real", default="", help="W list of real 2 x W async runs")
    ap.add_argument("--sync", default="", help="W list of --local --local-workers W runs")
    ap.add_argument("--sim", default="", help="W list of --simulate-workers W runs")
    ap.add_argument("--rule", action="append", default=[],
                    help="NAME=FLAGS (repeatable): a rule's flags, added to every run")
    ap.add_argument("--json", default=str(ROOT / "bench/out/bench_workers.json"))
    ap.add_argument("--force", action="store_true", help="rerun runs already in --json")
    ap.add_argument("--plot", default=str(ROOT / "docs/workers.png"))
    ap.add_argument("--replot", help="only plot and tabulate this JSON")
    a = ap.parse_args(argv)
    if a.replot:
        records = [r for r in json.loads(Path(a.replot).read_text())["records"]
                   if not a.data or r.get("data") == a.data]
        table(records)
        plot(records, a.plot)
        return
    if not a.data:
        ap.error("--data DIR is needed (or --replot)")
    rules = dict(r.split("=", 1) for r in a.rule) or {"default": ""}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text())["records"] if path.exists() else []
    have = {(r["rule"], r["kind"], r["W"], r["flags"]): r for r in old if r.get("data") == a.data}
    log_dir = path.parent / "bench_workers_logs"
    log_dir.mkdir(exist_ok=True)
    todo = [("", "local", 1, "")]
    for name, flags in rules.items():
        for kind, ws in (("async", a.real), ("sync", a.sync), ("sim", a.sim)):
            todo += [(name, kind, int(w), flags) for w in ws.split(",") if w]
    records = [r for r in old if r.get("data") != a.data]
    for name, kind, W, flags in todo:
        key = (name, kind, W, flags)
        if key in have and not a.force:
            rec = have.pop(key)
        else:
            rec = {"rule": name, "kind": kind, "W": W, "flags": flags, "data": a.data,
                   **run_one(a.data, kind, W, flags, log_dir)}
            print(json.dumps(rec), flush=True)
        records.append(rec)
    records += list(have.values())
    path.write_text(json.dumps({"records": records}, indent=1))
    mine = [r for r in records if r.get("data") == a.data]
    table(mine)
    if a.plot:
        plot(mine, a.plot)


if __name__ == "__main__":
    main()
