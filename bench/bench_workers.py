"""Quality as workers are added: test AUC and logloss against W, real runs and simulated.

    python -m data_prep.criteo_like --out /tmp/cl1m --rows 1000000 --test-rows 200000 \\
        --card-scale 0.05
    python bench/bench_workers.py --data /tmp/cl1m --real 2,4,8 --sim 2,4,8,16,32,64
    python bench/bench_workers.py --data /tmp/cl1m --rule "old=--stale-lr none" --real 4,8
    python bench/bench_workers.py --replot bench/out/bench_workers.json [--data DIR]
    python bench/bench_workers.py --data /tmp/cl1m --seeds 0,1,2 --sync 2,4,8 --sim 16,32,64
    python bench/bench_workers.py --data /tmp/cl1m --rule "G4096=--global-batch 4096" \
        --local-flags "--batch-size 4096" --real 2,4,8 --sync 8 --sim 16,32,64

Every run: one epoch, Adam lr 1e-3, batch 512 per worker (the train defaults), on
DATA/train, tested on DATA/test.  ``local`` is ``--local`` (one process, batch 512): the
yardstick every other run is compared with (``--local-flags FLAGS``: its own flags, e.g.
``--batch-size 4096`` against rules at ``--global-batch 4096``; part of its record's
identity, and the differences are taken against the ``local`` of these flags).  For each
rule (``--rule NAME=FLAGS``, repeatable; default: one rule ``default`` with no flags) and
each W:
- ``async`` (``--real``): ``mpiexec -n 2+W python -m mpips.train --servers 2`` (mode async);
- ``sync`` (``--sync``): ``--local --local-workers W``, which equals 2 x W sync bit for bit
  (docs/studies/scaling-with-w.md), in one process;
- ``sim`` (``--sim``): ``--local --simulate-workers W`` (the async simulator).
``--seeds 0,1,2`` repeats every run (``local`` included) with ``--seed s`` (the initial
weights): on some shapes the seed alone moves a run by more than the differences measured
(docs/studies/scaling-with-w.md), so each run is compared with ``local`` of its own seed and the table and
plot give the mean over seeds (the table also their sd; the plot's bars: the lowest and
highest seed).
Each record: AUC, logloss, mean prediction and their differences to ``local``; the servers'
staleness summary for real runs and the simulator's.  Records go to bench/out/bench_workers.json
(``--json``), each as soon as it is measured (a stopped bench keeps them; two benches may
share the file); runs already there with the same name are reused unless ``--force``.  A
plot of AUC and logloss minus local against W (one line per rule and kind) goes to
bench/out/workers.png (``--plot``; matplotlib, the ``bench`` extra; the study's figures in
docs/studies are written by naming them).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402

# a real run's ranks fail when a peer is silent for --peer-timeout (120 s by default); on a
# shared machine a quality run may be paused longer than that (SIGSTOP while another job
# is timed), so the bench waits longer.  Not in a record's identity: it moves no figure.
PEER_TIMEOUT = 1800

KEYS = ("test_auc", "test_logloss", "test_mean_pred", "test_ctr", "examples_per_sec",
        "test_auc_raw", "test_logloss_raw", "test_mean_pred_raw",      # --dense-average
        "push_staleness", "row_clip_frac")


def run_one(data, kind, W, flags, log_dir, seed=0, rule=""):
    """One training run; returns its epoch record (the keys above) and wall seconds (its
    output: LOG_DIR/DATA-RULE-KIND-W-sSEED.log)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        args = [sys.executable, "-m", "mpips.train", "--train", f"{data}/train",
                "--test", f"{data}/test", "--progress-every", "0", "--metrics-out", str(out)]
        if kind == "async":
            cmd = [mpiexec(), "-n", str(2 + W)] + args + ["--servers", "2", "--peer-timeout",
                                                          str(PEER_TIMEOUT)]
        elif kind == "sync":
            cmd = args + ["--local", "--local-workers", str(W)]
        elif kind == "sim":
            cmd = args + ["--local", "--simulate-workers", str(W)]
        else:
            cmd = args + ["--local"]
        cmd += shlex.split(flags) + ["--seed", str(seed)]
        t0 = time.time()
        log_path = log_dir / f"{Path(data).name}-{rule or 'local'}-{kind}-{W}-s{seed}.log"
        with open(log_path, "w") as log:
            rc = subprocess.run(cmd, env={**os.environ, **ENV}, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT).returncode
        if rc or not out.exists():
            raise SystemExit(f"bench_workers: {' '.join(cmd)} failed (exit {rc}); "
                             f"see {log_path}")
        rec = json.loads(out.read_text().splitlines()[-1])
    return {k: rec[k] for k in KEYS if k in rec} | {"wall_s": round(time.time() - t0, 1)}


def record_key(r):
    return (r.get("data"), r["rule"], r["kind"], r["W"], r["flags"], seed_of(r))


def save_record(path, rec):
    """Add rec to the JSON at path (replacing a record of the same run) as soon as it is
    measured: read afresh and replaced atomically, so a stopped bench keeps what it ran and
    two benches writing one file keep each other's records."""
    records = json.loads(path.read_text())["records"] if path.exists() else []
    records = [r for r in records if record_key(r) != record_key(rec)] + [rec]
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"records": records}, indent=1))
    os.replace(tmp, path)


def seed_of(r):
    return r.get("seed", 0)


def differences(records, local_flags=""):
    """{(rule, kind, W): [(seed, dAUC, dlogloss, record)]}: each run minus ``local`` of
    its own seed run with ``local_flags`` (runs without one are left out)."""
    base = {seed_of(r): r for r in records if r["kind"] == "local" and r["flags"] == local_flags}
    out = {}
    for r in records:
        if r["kind"] != "local" and seed_of(r) in base:
            b = base[seed_of(r)]
            out.setdefault((r["rule"], r["kind"], r["W"]), []).append(
                (seed_of(r), r["test_auc"] - b["test_auc"],
                 r["test_logloss"] - b["test_logloss"], r))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in out.items()}


def y_range(values, lo, hi, grow, pad=0.002):
    """The y-range of a plot of differences to ``local``: [lo, hi] widened to hold every
    value (plus ``pad``) on the side ``grow`` ("up" for AUC, "down" for logloss), where runs
    beat one process; the other bound stays, so diverged runs (AUC 0.5-0.57) fall off the
    chart rather than squash the rest."""
    if grow == "up":
        return lo, max([hi] + [v + pad for v in values])
    return min([lo] + [v - pad for v in values]), hi


def plot(records, path, local_flags=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    diffs = differences(records, local_flags)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (rule, kind) in sorted({(k[0], k[1]) for k in diffs}):
        ws = sorted(k[2] for k in diffs if k[:2] == (rule, kind))
        style = {"async": "o-", "sim": "s--", "sync": "^:"}[kind]
        for ax, i in zip(axes, (1, 2)):
            vals = [[d[i] for d in diffs[rule, kind, w]] for w in ws]
            ys = [statistics.mean(v) for v in vals]
            err = [[y - min(v) for y, v in zip(ys, vals)], [max(v) - y for y, v in zip(ys, vals)]]
            ax.errorbar(ws, ys, yerr=err, fmt=style, capsize=3, label=f"{rule} {kind}")
    for ax, i, lo, hi, grow in ((axes[0], 1, -0.05, 0.01, "up"), (axes[1], 2, -0.01, 0.05, "down")):
        ax.set_ylim(*y_range([d[i] for ds in diffs.values() for d in ds], lo, hi, grow))
    seeds = sorted({seed_of(r) for r in records})
    for ax, key, bar in zip(axes, ("AUC", "logloss"), (0.003, 0.003)):
        ax.axhline(0, color="k", lw=0.8)
        for b in (-bar, bar):
            ax.axhline(b, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers W")
        ax.set_ylabel(f"test {key} - --local" + (f" (mean of seeds {seeds})"
                                                 if len(seeds) > 1 else ""))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    data = sorted({Path(r["data"]).name for r in records if r.get("data")})
    fig.suptitle(f"quality against workers on {', '.join(data)} (real 2 x W async, sync = "
                 "--local-workers W = 2 x W sync, sim = --simulate-workers W)"
                 + (f"; against --local {local_flags}" if local_flags else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
    return [ax.get_ylim() for ax in axes]


def table(records, local_flags=""):
    print(f"{'rule':12s} {'kind':6s} {'W':>3s} {'seeds':>6s} {'dAUC':>8s} {'sd':>7s} {'dLL':>8s} "
          f"{'sd':>7s}  per seed: dAUC / dLL, AUC, stale p50/p90/max")
    for (rule, kind, W), ds in sorted(differences(records, local_flags).items()):
        per = []
        for seed, da, dl, r in ds:
            st = r.get("push_staleness") or {}
            s = f" {st.get('p50', '')}/{st.get('p90', '')}/{st.get('max', '')}" if st else ""
            per.append(f"s{seed} {da:+.4f}/{dl:+.4f} {r['test_auc']:.4f}{s}")
        sd = [f"{statistics.stdev(d[i] for d in ds):.4f}" if len(ds) > 1 else "" for i in (1, 2)]
        print(f"{rule:12s} {kind:6s} {W:3d} {len(ds):6d} {statistics.mean(d[1] for d in ds):+.4f} "
              f"{sd[0]:>7s} {statistics.mean(d[2] for d in ds):+.4f} {sd[1]:>7s}  "
              + "; ".join(per))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="DIR with train/ and test/")
    ap.add_argument("--real", default="", help="W list of real 2 x W async runs")
    ap.add_argument("--sync", default="", help="W list of --local --local-workers W runs")
    ap.add_argument("--sim", default="", help="W list of --simulate-workers W runs")
    ap.add_argument("--rule", action="append", default=[],
                    help="NAME=FLAGS (repeatable): a rule's flags, added to every run")
    ap.add_argument("--local-flags", default="",
                    help="the yardstick's (plain --local run's) flags, e.g. '--batch-size 4096'")
    ap.add_argument("--json", default=str(ROOT / "bench/out/bench_workers.json"))
    ap.add_argument("--force", action="store_true", help="rerun runs already in --json")
    ap.add_argument("--plot", default=str(ROOT / "bench/out/workers.png"))
    ap.add_argument("--replot", help="only plot and tabulate this JSON")
    ap.add_argument("--seeds", default="0", help="run everything with each --seed in this list")
    a = ap.parse_args(argv)
    if a.data:                 # the runs start in the repository's root, not in this cwd
        a.data = os.path.abspath(a.data)
    if a.replot:
        records = [r for r in json.loads(Path(a.replot).read_text())["records"]
                   if not a.data or r.get("data") == a.data]
        table(records, a.local_flags)
        if a.plot:                          # --plot "": no plot (not a file named .png)
            plot(records, a.plot, a.local_flags)
        return
    if not a.data:
        ap.error("--data DIR is needed (or --replot)")
    rules = dict(r.split("=", 1) for r in a.rule) or {"default": ""}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text())["records"] if path.exists() else []
    have = {record_key(r)[1:] for r in old if r.get("data") == a.data}
    log_dir = path.parent / "bench_workers_logs"
    log_dir.mkdir(exist_ok=True)
    todo = []
    for seed in (int(x) for x in a.seeds.split(",")):
        todo.append(("", "local", 1, a.local_flags, seed))
        for name, flags in rules.items():
            for kind, ws in (("async", a.real), ("sync", a.sync), ("sim", a.sim)):
                todo += [(name, kind, int(w), flags, seed) for w in ws.split(",") if w]
    for name, kind, W, flags, seed in todo:
        if (name, kind, W, flags, seed) not in have or a.force:
            rec = {"rule": name, "kind": kind, "W": W, "flags": flags, "data": a.data,
                   "seed": seed, **run_one(a.data, kind, W, flags, log_dir, seed, name)}
            print(json.dumps(rec), flush=True)
            save_record(path, rec)
    mine = [r for r in json.loads(path.read_text())["records"] if r.get("data") == a.data]
    table(mine, a.local_flags)
    if a.plot:
        plot(mine, a.plot, a.local_flags)


if __name__ == "__main__":
    main()
