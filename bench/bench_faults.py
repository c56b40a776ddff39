"""Fault report: each failure scenario, how fast it is detected, and what survives.

    python bench/bench_faults.py                 # all scenarios, --peer-timeout 5
    python bench/bench_faults.py --peer-timeout 10 --scenarios stop-server,hostile-message

Scenarios (2 servers x 2 workers, 3 epochs of 16k synthetic rows, a checkpoint per epoch;
faults hit mid epoch 2, once checkpoint 2 = epoch 1 is committed):
  kill-worker, kill-server   SIGKILL a rank (by the PID the job prints in its role map)
  stop-worker, stop-server   SIGSTOP a rank (resumed and killed afterwards)
  corrupt-checkpoint         flip bytes in a shard of the last checkpoint, then --resume the
                             root (the corrupted one is passed over for the one before)
  hostile-message            tests/mpi_wire_probe.py: crafted bad requests to a server
For each: seconds from the fault to the job's exit, exit code, the first error line, and
whether the last committed checkpoint still loads in full (CRC-checked) — i.e. whether
anything committed was lost.  Then the memory-per-row table of bench/bench_load.py
(from bench/out/bench_load.json, or a --rows run of its build part).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402


SCENARIOS = ("kill-worker", "kill-server", "stop-worker", "stop-server",
             "corrupt-checkpoint", "hostile-message")
VICTIM = {"worker": 2, "server": 1}     # world ranks in a 2 x 2 job: servers 0,1, workers 2,3




def ensure_data(out):
    from data_prep.synth import generate
    d = out / "faults-data"
    if not (d / "train").exists():
        generate(str(d), rows=16000, parts=8, seed=3, test_rows=4000)
    return str(d / "train"), str(d / "test")


def train_cmd(data, work, timeout, *extra):
    return [sys.executable, "-m", "mpips.train", "--train", data[0], "--test", data[1],
            "--batch-size", "256", "--fc", "32,16", "--print-every", "5", "--epochs", "3",
            "--save-dir", str(work / "ck"), "--peer-timeout", str(timeout)] + list(extra)


def first_error(text):
    for line in text.splitlines():
        if re.search(r"PeerTimeout|Error|EXIT STRING|rejected|FAILED", line):
            return line.strip()[:300]
    return ""


def checkpoint_state(root):
    """'ckpt-... loads (N rows)' for the newest committed checkpoint, or the reason it fails."""
    from mpips import checkpoint as ck
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    import numpy as np
    try:
        path = ck.resolve(str(root), warn=lambda m: None)
        m = ck.read_manifest(path)
        opt = OptimizerConfig(name=m["optimizer"]["name"])
        sparse = SparseTable(m["embedding_dim"], opt, seed=0)
        ck.load_local(path, sparse, DenseTable(np.zeros(m["n_params"], np.float32), opt))
        return f"{os.path.basename(path)} (epoch {m['meta']['epoch']}) loads, {len(sparse)} rows"
    except Exception as e:  # noqa: BLE001 - reported
        return f"does not load: {type(e).__name__}: {str(e)[:150]}"


def inject(data, work, kind, role, timeout):
    """Run the job, hit the victim mid epoch 2; return the report row."""
    work.mkdir(parents=True, exist_ok=True)
    so, se = work / "stdout.txt", work / "stderr.txt"
    cmd = [mpiexec(), "-n", "4"] + train_cmd(data, work, timeout)
    env = dict(os.environ, **ENV, MPIPS_DEBUG_SLOW_WORKER="0:0.03")
    with open(so, "w") as fo, open(se, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, cwd=str(ROOT))
    pids = {}
    try:
        while "TRAIN --> pass: 2 batch: 5 " not in so.read_text():
            if proc.poll() is not None:
                raise SystemExit(f"{kind}-{role}: job ended early\n{se.read_text()[-2000:]}")
            time.sleep(0.02)
        pids = {int(r): int(p) for r, p in
                re.findall(r"^  rank (\d+) .* pid (\d+)$", so.read_text(), re.M)}
        sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
        t0 = time.monotonic()
        os.kill(pids[VICTIM[role]], sig)
        rc = proc.wait(timeout=timeout + 60)
        seconds = time.monotonic() - t0
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    text = se.read_text() + so.read_text()
    named = re.search(r"rank\(s\) \[(\d+)\] stopped answering", text)
    return {"scenario": f"{kind}-{role}", "victim_rank": VICTIM[role],
            "seconds_to_exit": round(seconds, 2), "exit_code": rc,
            "rank_named": int(named.group(1)) if named else None,
            "first_error": first_error(se.read_text()) or first_error(so.read_text()),
            "last_checkpoint": checkpoint_state(work / "ck")}


def corrupt(data, work, timeout):
    """A clean run, then bytes flipped in a shard of its last checkpoint, then --resume."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [mpiexec(), "-n", "4"] + train_cmd(data, work, timeout, "--epochs", "2")
    env = dict(os.environ, **ENV)
    subprocess.run(cmd, capture_output=True, env=env, cwd=str(ROOT), check=True, timeout=300)
    shard = sorted((work / "ck" / "ckpt-000002-full").glob("*.h5"))[0]
    raw = bytearray(shard.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
    shard.write_bytes(bytes(raw))
    resume = [mpiexec(), "-n", "4"] + train_cmd(data, work, timeout, "--resume", str(work / "ck"))
    t0 = time.monotonic()
    proc = subprocess.run(resume, capture_output=True, text=True, env=env, cwd=str(ROOT),
                          timeout=300)
    seconds = time.monotonic() - t0
    from mpips import checkpoint as ck
    older = checkpoint_state(ck.resolve(str(work / "ck" / "ckpt-000001-full")))
    return {"scenario": "corrupt-checkpoint", "victim_rank": None,
            "seconds_to_exit": round(seconds, 2), "exit_code": proc.returncode,
            "rank_named": None,
            "first_error": first_error(proc.stderr) or next(
                (x.strip()[:300] for x in proc.stderr.splitlines() if "passing over" in x), ""),
            "last_checkpoint": f"after the resume {checkpoint_state(work / 'ck')}; the one "
                               f"before the corrupted one: {older}"}


def hostile():
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "tests.mpi_wire_probe"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV),
                          cwd=str(ROOT), timeout=120)
    n = len([x for x in proc.stderr.splitlines() if "rejected malformed request" in x])
    verdict = re.search(r"failed checks per rank \[.*\]", proc.stdout)
    return {"scenario": "hostile-message", "victim_rank": None,
            "seconds_to_exit": round(time.monotonic() - t0, 2), "exit_code": proc.returncode,
            "rank_named": None, "first_error": first_error(proc.stderr),
            "last_checkpoint": f"n/a; {n} requests rejected, tables unchanged, server kept "
                               f"serving ({verdict.group(0) if verdict else 'no verdict'})"}


def memory_table(rows):
    path = ROOT / "bench" / "out" / "bench_load.json"
    if path.exists():
        return json.loads(path.read_text())["build"]
    sys.argv = [sys.argv[0]]
    from bench.bench_load import build
    return build(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-timeout", type=float, default=5.0)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--rows", type=int, default=2_000_000,
                    help="rows of the memory table when bench/out/bench_load.json is missing")
    a = ap.parse_args()
    out = ROOT / "bench" / "out"
    data = ensure_data(out)
    rows = []
    for name in a.scenarios.split(","):
        work = out / f"faults-{name}"
        if work.exists():
            import shutil
            shutil.rmtree(work)
        if name.startswith(("kill", "stop")):
            kind, role = name.split("-")
            rows.append(inject(data, work, kind, role, a.peer_timeout))
        elif name == "corrupt-checkpoint":
            rows.append(corrupt(data, work, a.peer_timeout))
        elif name == "hostile-message":
            rows.append(hostile())
        else:
            raise SystemExit(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nFAULT REPORT (--peer-timeout {a.peer_timeout:g})")
    print(f"{'scenario':20} {'exit':>4} {'seconds':>8} {'named':>5}  last committed checkpoint")
    for r in rows:
        print(f"{r['scenario']:20} {r['exit_code']:>4} {r['seconds_to_exit']:>8.2f} "
              f"{str(r['rank_named']):>5}  {r['last_checkpoint']}")
        print(f"{'':20} first error: {r['first_error']}")
    mem = memory_table(a.rows)
    print("\nMEMORY PER ROW (SparseTable, dim 10, Adam)")
    print(f"rows {mem['rows']}: payload {mem['payload_bytes_per_row']} B, table "
          f"{mem['table_bytes_per_row']} B ({mem['ratio_table']}x), RSS "
          f"{mem['rss_bytes_per_row']} B ({mem['ratio_rss']}x), build {mem['build_seconds']} s")
    (out / "bench_faults.json").write_text(json.dumps({"faults": rows, "memory": mem}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
