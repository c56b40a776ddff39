"""Scale benchmark: does training keep its speed as the sparse table grows to 10M+ rows?

    python -m data_prep.criteo_like --out DATA --rows 20000000 --test-rows 200000 --card-scale 1
    python bench/bench_scale.py --data DATA                       # 2 servers x 2 workers async
    python bench/bench_scale.py --data DATA --runs 2x2,1x2,local --parts 4
    python bench/bench_scale.py --replot a.json,b.json              # plot saved runs together

Each run trains one epoch (Adam lr 1e-3, batch 512, the train defaults) over the first
``--parts`` part files of DATA/train (all by default) with ``--table-every 1000000``
(``--every``), launched as ``mpiexec -n S+W python -m mpips.train --servers S`` (``SxW``)
or ``python -m mpips.train --local`` (``local``).  While it runs, this script samples
every rank's /proc (CPU seconds, peak RSS) and, for every TABLE line (each 1M
examples), reports: examples/s over that 1M, table rows (all servers), server CPU seconds
and all ranks' CPU seconds in that 1M (the load-proof measure of cost per example on a
shared machine; for ``local`` "server" is the whole process), the first worker's
compute / wait seconds in that 1M, and peak RSS per rank so far.  At the end: the TIMES
line of each worker (read, dedup/plan, gather, forward/backward, scatter, AUC, pull/push
calls, wait), the SERVER lines (rows and bytes per row), the EPOCH line, and
``ratio_last_to_first`` = ex/s of the last 1M / ex/s of the first.  Results go to
bench/out/bench_scale.json and a plot of ex/s and table rows against examples seen to
docs/studies/scale.png (``--plot``; needs matplotlib, the ``bench`` extra).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
TABLE = re.compile(r"TABLE --> examples: (\d+) seconds: ([\d.]+) compute_s: ([\d.]+) "
                      r"wait_s: ([\d.]+) table_rows: (\d+) bytes_per_row: ([\d.]+)")
ROLE = re.compile(r"rank (\d+) host \S+ (server|worker) (\d+).* pid (\d+)")


def proc_sample(pid):
    """(cpu seconds, peak RSS MB) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        with open(f"/proc/{pid}/status") as fh:
            hwm = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
        return cpu, hwm / 1024
    except (OSError, StopIteration, IndexError, ValueError):
        return None


class Sampler(threading.Thread):
    """Polls /proc of the ranks every `every` seconds; keeps the latest sample per pid."""

    def __init__(self, every=1.0):
        super().__init__(daemon=True)
        self.pids, self.last, self.every = {}, {}, every
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            for pid in list(self.pids):
                s = proc_sample(pid)
                if s is not None:
                    self.last[pid] = s
            self.stop.wait(self.every)


def command(run, files, test, every, extra):
    base = ["-m", "mpips.train", "--train", ",".join(files), "--table-every", str(every),
            "--print-every", "1000000"] + (["--test", test] if os.path.isdir(test) else []) + extra
    if run == "local":
        return [sys.executable] + base + ["--local"]
    s, w = (int(x) for x in run.split("x"))
    return [mpiexec(), "-n", str(s + w), sys.executable] + base + [
        "--servers", str(s), "--mode", "async"]


def one_run(run, files, test, every, extra, log_path):
    cmd = command(run, files, test, every, extra)
    print(f"[{run}] {' '.join(cmd)}", flush=True)
    sampler = Sampler()
    sampler.start()
    roles, rows, tail = {}, [], []
    t0 = time.time()
    with open(log_path, "w") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
            env=dict(os.environ, **ENV)) as proc:
        if run == "local":
            roles[proc.pid] = ("local", 0, 0)
            sampler.pids[proc.pid] = "local"
        prev = None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            m = ROLE.search(line)
            if m:
                pid = int(m.group(4))
                roles[pid] = (m.group(2), int(m.group(3)), int(m.group(1)))
                sampler.pids[pid] = m.group(2)
            m = TABLE.search(line)
            if m:
                ex, sec, comp, wait, trows, bpr = (float(g) for g in m.groups())
                snap = {pid: sampler.last.get(pid) or proc_sample(pid) for pid in roles}
                srv_cpu = sum(s[0] for pid, s in snap.items()
                              if s and roles[pid][0] in ("server", "local"))
                all_cpu = sum(s[0] for s in snap.values() if s)
                rec = {"examples": int(ex), "seconds": sec, "compute_s": comp, "wait_s": wait,
                       "table_rows": int(trows), "bytes_per_row": bpr, "server_cpu_s": srv_cpu,
                       "cpu_s": all_cpu,
                       "peak_rss_mb": {f"{roles[p][0]} {roles[p][1]} (rank {roles[p][2]})":
                                       round(s[1]) for p, s in snap.items() if s}}
                if prev is not None:
                    dt = sec - prev["seconds"]
                    rec.update(interval_ex_s=round((ex - prev["examples"]) / dt) if dt else 0,
                               interval_compute_s=round(comp - prev["compute_s"], 2),
                               interval_wait_s=round(wait - prev["wait_s"], 2),
                               interval_server_cpu_s=round(srv_cpu - prev["server_cpu_s"], 2),
                               interval_cpu_s=round(all_cpu - prev["cpu_s"], 2))
                else:
                    rec.update(interval_ex_s=round(ex / sec) if sec else 0,
                               interval_compute_s=comp, interval_wait_s=wait,
                               interval_server_cpu_s=round(srv_cpu, 2),
                               interval_cpu_s=round(all_cpu, 2))
                rows.append(rec)
                prev = rec
                print(f"[{run}] {rec['examples'] / 1e6:5.1f}M ex {rec['interval_ex_s']:7d} ex/s "
                      f"rows {rec['table_rows']:>10,} ({bpr:.0f} B/row) server cpu "
                      f"{rec['interval_server_cpu_s']:6.1f}s all ranks {rec['interval_cpu_s']:6.1f}s "
                      f" worker0 compute "
                      f"{rec['interval_compute_s']:6.1f}s wait {rec['interval_wait_s']:6.1f}s  "
                      f"peak MB {list(rec['peak_rss_mb'].values())}", flush=True)
            if line.startswith(("TIMES", "SERVER", "EPOCH", "PROFILE")):
                tail.append(line.rstrip())
        rc = proc.wait()
    sampler.stop.set()
    if rc != 0:
        raise SystemExit(f"[{run}] failed (exit {rc}); see {log_path}")
    for line in tail:
        print(f"[{run}] {line}", flush=True)
    epoch = next((ln for ln in tail if ln.startswith("EPOCH")), "")
    res = {"run": run, "command": " ".join(cmd), "wall_seconds": round(time.time() - t0, 1),
           "progress": rows, "final_lines": tail}
    m = re.search(r"examples/s: (\d+).*TEST examples: \d+ auc: ([\d.]+)", epoch)
    if m:
        res["epoch_ex_s"], res["test_auc"] = int(m.group(1)), float(m.group(2))
    if len(rows) >= 2:
        res["ratio_last_to_first"] = round(rows[-1]["interval_ex_s"] / rows[0]["interval_ex_s"], 3)
        print(f"[{run}] ex/s last 1M / first 1M: {res['ratio_last_to_first']}", flush=True)
    return res


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax2 = ax.twinx()
    for res in results:
        xs = [r["examples"] / 1e6 for r in res["progress"]]
        ax.plot(xs, [r["interval_ex_s"] for r in res["progress"]], marker="o",
                label=f"{res['run']} ex/s")
        ax2.plot(xs, [r["table_rows"] / 1e6 for r in res["progress"]], ls="--",
                 label=f"{res['run']} table rows")
    ax.set_xlabel("examples seen (M)")
    ax.set_ylabel("examples/s over the last 1M")
    ax2.set_ylabel("table rows (M, dashed)")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower left", fontsize=8)
    ax.set_title("mpips: throughput as the sparse table grows (Criteo-cardinality data)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="", help="a data_prep.criteo_like output directory")
    ap.add_argument("--runs", default="2x2", help="comma list of SxW (servers x workers, "
                    "async) and 'local'")
    ap.add_argument("--parts", type=int, default=0, help="train on the first N parts (0 = all)")
    ap.add_argument("--every", type=int, default=1_000_000, help="examples per report line")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "studies" / "scale.png"), help="PNG ('' = none)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "bench_scale.json"))
    ap.add_argument("--replot", default="", help="comma list of --out JSON files of earlier "
                    "runs: plot their results together to --plot, run nothing")
    ap.add_argument("extra", nargs="*", help="more mpips.train arguments (after --)")
    a = ap.parse_args()
    if a.data:                 # the runs start in the repository's root, not in this cwd
        a.data = os.path.abspath(a.data)
    if a.replot:
        plot([r for f in a.replot.split(",") for r in json.loads(Path(f).read_text())["results"]],
             a.plot)
        return 0
    if not a.data:
        ap.error("--data is required (or --replot)")
    files = sorted(str(p) for p in Path(a.data, "train").glob("part-*"))
    if a.parts:
        files = files[:a.parts]
    if not files:
        raise SystemExit(f"no part files in {a.data}/train")
    meta = json.loads(Path(a.data, "meta.json").read_text()) if Path(a.data, "meta.json").exists() \
        else {}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for run in a.runs.split(","):
        results.append(one_run(run, files, str(Path(a.data, "test")), a.every, a.extra,
                               out.with_name(f"bench_scale_{run}.log")))
        out.write_text(json.dumps({"data": a.data, "files": files, "meta": meta,
                                   "results": results}, indent=1))
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
