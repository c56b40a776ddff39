"""The disk tier (--table-memory) against the in-memory table: speed, memory, saves and loads.

    python -m data_prep.criteo_like --out DATA --rows 2000000 --test-rows 100000 --parts 4 --card-scale 1
    python bench/bench_disk_table.py train --data DATA [--ratio 4] [--rounds 2] [--fc 400,400,400]
    python bench/bench_disk_table.py saveload [--rows 4000000] [--ratio 4]
    python bench/bench_disk_table.py scale --ids 20000000 --cap 512M [--steps 300]
    python bench/bench_disk_table.py policy --data DATA [--ratio 4] --batch 1024
    python bench/bench_disk_table.py exact --data DATA [--ratio 4]

``train``: 2 servers x 2 workers, --mode async, one epoch over DATA/train, evaluated on
DATA/test.  The first run is in memory and gives each server's table bytes (its SERVER
line); the tier's runs cap each server at that / ``--ratio``.  Then the runs alternate
(tier, memory, tier, ...) for ``--rounds`` rounds of each kind, the same data every time.
Per run: examples/s, test AUC, each server's peak RSS and CPU seconds (PROFILE), and the
tier's hit ratio, disk rows and bytes, read and write-back seconds (SERVER lines).

``saveload``: in one process a table of ``--rows`` rows (Adam, dim 10) is filled, saved
full and loaded again, in memory or into a tier capped at the table's bytes / ``--ratio``;
each kind in its own process, so its peak RSS is its own.  Prints seconds and peak RSS.

``scale``: one server's table alone (a TieredTable capped at ``--cap``, no MPI), in one
process: every one of ``--ids`` ids is made by a pull and a push of batches of ``--batch``
ids (the fill), then ``--steps`` training steps of ``--batch`` ids drawn with Criteo-like
skew (Zipf over the ids), then a full save and a load into a fresh tier.  Prints ids/s, the
hit ratio, bytes on disk, seconds and the process's RSS after each phase (current and
peak): the peak is what the cap bounds, whatever ``--ids``.

``policy``: the cache policies' hit ratios on DATA/train's ids: each batch's unique ids
pulled (create=True) in file order through one TieredTable per policy, capped at the
in-memory table's bytes / ``--ratio``.

``exact``: ``--local`` and 2x2 ``--mode sync`` (admission ``--entry count:2``), each in
memory and then under a tier capped at a quarter (``--ratio``) of each server's in-memory
table (the record's table bytes over the servers): prints PASS or FAIL for the test AUC,
logloss and train loss and for every array of the final checkpoint (rows aligned by id),
then ``EXACT PASS`` or ``EXACT FAIL``.

Results go to bench/out/bench_disk_table.json (appended per invocation).  On a shared
machine, wall-clock figures move with the other load: compare the CPU seconds too.
"""
import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402

EPOCH = re.compile(r"EPOCH 0 --> examples: (\d+) seconds: ([\d.]+) examples/s: (\d+).*"
                   r"TEST examples: \d+ auc: ([\d.]+) logloss: ([\d.]+)")
SERVER = re.compile(r"SERVER --> (\d+) .*table rows: (\d+) bytes: (\d+) .*peak_rss_MB: (\d+)"
                    r"(?: tier: resident_rows: (\d+) disk_rows: (\d+) disk_MB: ([\d.]+) "
                    r"hit_ratio: ([\d.]+) read_s: ([\d.]+) write_s: ([\d.]+))?")
PROFILE = re.compile(r"PROFILE --> (\d+) (server|worker) .* (\d+) (\d+) ([\d.]+)$", re.M)
OUT = ROOT / "bench" / "out" / "bench_disk_table.json"
ZIPF = 1.1                  # scale: the skew of the training steps' ids


def train_run(args, cap_bytes, tier_dir):
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "mpips.train", "--mode", "async",
           "--train", os.path.join(args.data, "train"), "--test", os.path.join(args.data, "test"),
           "--fc", args.fc, "--print-every", "1000000", "--progress-every", "0"]
    if cap_bytes:
        cmd += ["--table-memory", str(cap_bytes), "--table-dir", tier_dir]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV),
                          cwd=str(ROOT), timeout=args.timeout)
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"run failed ({proc.returncode}): {text[-2000:]}")
    m = EPOCH.search(text)
    run = {"kind": "tier" if cap_bytes else "memory", "cap_bytes": cap_bytes,
           "wall_s": round(time.time() - t0, 1), "examples": int(m[1]),
           "train_s": float(m[2]), "examples_per_s": int(m[3]), "test_auc": float(m[4]),
           "test_logloss": float(m[5]), "servers": []}
    for s in SERVER.finditer(text):
        srv = {"rows": int(s[2]), "bytes": int(s[3]), "peak_rss_mb": int(s[4])}
        if s[5]:
            srv.update(resident_rows=int(s[5]), disk_rows=int(s[6]), disk_mb=float(s[7]),
                       hit_ratio=float(s[8]), read_s=float(s[9]), write_s=float(s[10]))
        run["servers"].append(srv)
    cpu = [float(p[5]) for p in PROFILE.finditer(text) if p[2] == "server"]
    for srv, c in zip(run["servers"], cpu):
        srv["cpu_s"] = c
    print(json.dumps(run), flush=True)
    return run


def train(args):
    tier_dir = tempfile.mkdtemp(prefix="bench-tier-")
    try:
        first = train_run(args, 0, tier_dir)
        cap = max(s["bytes"] for s in first["servers"]) // args.ratio
        runs = [first]
        for _ in range(args.rounds):
            runs.append(train_run(args, cap, tier_dir))
            if len([r for r in runs if r["kind"] == "memory"]) < args.rounds:
                runs.append(train_run(args, 0, tier_dir))
        assert not os.listdir(tier_dir), "a tier folder was left behind"
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    mem = [r["examples_per_s"] for r in runs if r["kind"] == "memory"]
    tier = [r["examples_per_s"] for r in runs if r["kind"] == "tier"]
    summary = {"ratio": args.ratio, "cap_bytes": cap, "fc": args.fc,
               "memory_ex_s": mem, "tier_ex_s": tier,
               "speed_ratio": round(sum(tier) / len(tier) / (sum(mem) / len(mem)), 3)}
    print("SUMMARY", json.dumps(summary), flush=True)
    return {"bench": "train", "data": args.data, "runs": runs, "summary": summary}


ROW_GROUPS = ("sparse", "admission")


def checkpoint_arrays(root):
    """{dataset: array} of the newest checkpoint under ``root``, all shards: row fields
    ordered by id, evicted ids sorted, dense slices in shard order (the tier writes its
    resident rows first, then the disk rows in id order; the rows must be equal)."""
    import h5py
    import numpy as np
    ckpt = os.path.join(root, sorted(d for d in os.listdir(root) if d.startswith("ckpt-"))[-1])
    parts = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".h5"):
            with h5py.File(os.path.join(ckpt, name), "r") as f:
                f.visititems(lambda path, obj: parts.setdefault(path, []).append(obj[()])
                             if isinstance(obj, h5py.Dataset) else None)
    out = {k: np.concatenate([np.atleast_1d(a) for a in v]) for k, v in parts.items()}
    for g in ROW_GROUPS:
        if f"{g}/keys" in out:
            order = np.argsort(out[f"{g}/keys"], kind="stable")
            for k in [k for k in out if k.startswith(g + "/") and k.count("/") == 1]:
                if k not in (f"{g}/evicted", f"{g}/admitted"):
                    out[k] = out[k][order]
            out[f"{g}/evicted"] = np.sort(out[f"{g}/evicted"])
    return os.path.basename(ckpt), out


def exact_run(args, work, name, extra, n):
    """One run of the ``exact`` bench: its last metrics record and its newest checkpoint."""
    save, metrics = os.path.join(work, name), os.path.join(work, name + ".jsonl")
    cmd = ([mpiexec(), "-n", str(n)] if n > 1 else []) + [
        sys.executable, "-m", "mpips.train", "--train", os.path.join(args.data, "train"),
        "--test", os.path.join(args.data, "test"), "--fc", args.fc, "--print-every",
        "1000000", "--progress-every", "0", "--save-dir", save, "--metrics-out", metrics,
        "--entry", "count:2"] + extra
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV),
                          cwd=str(ROOT), timeout=args.timeout)
    if proc.returncode:
        text = proc.stdout + proc.stderr
        raise SystemExit(f"{name} failed ({proc.returncode}): {text[-2000:]}")
    with open(metrics) as fh:
        rec = [json.loads(x) for x in fh if x.strip()][-1]
    print(f"{name}: {time.time() - t0:.0f} s, test AUC {rec['test_auc']!r} logloss "
          f"{rec['test_logloss']!r}" + "".join(f" {k} {rec[k]}" for k in (
              "tier_resident_rows", "tier_disk_rows", "tier_hit_ratio") if k in rec), flush=True)
    return rec, checkpoint_arrays(save)


def exact(args):
    """``--local`` and 2x2 ``--mode sync``, each in memory and under a tier capped at a
    quarter of each server's in-memory table: PASS when the test AUC, logloss and train loss
    are equal and so is every array of the final checkpoint (rows aligned by id)."""
    import numpy as np
    work = tempfile.mkdtemp(prefix="bench-exact-", dir=args.dir or None)
    result, ok = {"bench": "exact", "data": args.data, "ratio": args.ratio, "kinds": []}, True
    try:
        for kind, extra, n, servers in (("local", ["--local"], 1, 1),
                                        ("sync", ["--mode", "sync"], 4, 2)):
            rm, (cm, am) = exact_run(args, work, f"{kind}-memory", extra, n)
            cap = rm["table_bytes"] // servers // args.ratio
            tier_dir = os.path.join(work, "tierdir")
            os.makedirs(tier_dir, exist_ok=True)
            rt, (ct, at) = exact_run(args, work, f"{kind}-tier", extra + [
                "--table-memory", str(cap), "--table-dir", tier_dir], n)
            checks = {m: rt[m] == rm[m] for m in ("test_auc", "test_logloss",
                                                             "train_loss")}
            checks["same arrays"] = sorted(am) == sorted(at)
            for k in sorted(am):
                checks[k] = k in at and am[k].shape == at[k].shape and np.array_equal(am[k], at[k])
            checks["tier folder removed"] = not os.listdir(tier_dir)
            for k, v in checks.items():
                print(f"{kind} {k}: {'PASS' if v else 'FAIL'}", flush=True)
            ok &= all(checks.values())
            result["kinds"].append({
                "kind": kind, "cap_bytes": cap, "checkpoint": [cm, ct],
                "auc": [rm["test_auc"], rt["test_auc"]],
                "tier": {k: rt[k] for k in rt if k.startswith("tier_")},
                "rows": int(len(am.get("sparse/keys", []))), "checks": checks})
            for name in (f"{kind}-memory", f"{kind}-tier"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("EXACT", "PASS" if ok else "FAIL", flush=True)
    return result


def saveload_one(kind, rows, ratio):
    """Fill, save full and load one table in this process; print a JSON line."""
    import numpy as np
    from mpips import checkpoint as ck
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    from mpips.tables.tiered import TieredTable
    opt = OptimizerConfig(name="adam", lr=1e-3)
    work = tempfile.mkdtemp(prefix="bench-saveload-")

    def table():
        t = SparseTable(10, opt, seed=0)
        if kind == "memory":
            return t
        per = TieredTable.bytes_per_row(t.export_rows(np.empty(0, np.int64)))
        return TieredTable(t, rows * per // ratio, work, tag="bench")
    try:
        t, dense = table(), DenseTable(np.zeros(1000, np.float32), opt)
        t0 = time.perf_counter()
        step = 1 << 16
        for lo in range(0, rows, step):
            keys = np.arange(lo, min(lo + step, rows), dtype=np.int64) * 7919
            t.pull(keys, np.empty((len(keys), 10), np.float32), create=True)
        t1 = time.perf_counter()
        path = ck.save_local(os.path.join(work, "ckpt"), t, dense, "full")
        t2 = time.perf_counter()
        if kind != "memory":
            t.close()
        t = table()
        ck.load_local(path, t, DenseTable(np.zeros(1000, np.float32), opt))
        t3 = time.perf_counter()
        assert len(t) == rows
        out = {"kind": kind, "rows": rows, "fill_s": round(t1 - t0, 2),
               "save_s": round(t2 - t1, 2), "load_s": round(t3 - t2, 2),
               "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
        if kind != "memory":
            out.update(t.stats(), disk_bytes=t.store.nbytes)
            t.close()
        print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rss_mb():
    """(current, peak) RSS of this process in MB."""
    with open("/proc/self/status") as fh:
        cur = next(int(x.split()[1]) for x in fh if x.startswith("VmRSS"))
    return round(cur / 1024), round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def scale(args):
    """The ``scale`` bench (see the module doc); one JSON line per phase."""
    import numpy as np
    from mpips import checkpoint as ck
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    from mpips.tables.tiered import TieredTable
    from mpips.tiering import parse_size
    opt, b = OptimizerConfig(name="adam", lr=1e-3), args.batch
    work = tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir or None)
    rng = np.random.default_rng(0)
    key = lambda idx: (idx * 0x9E3779B1) % (1 << 62)     # (ids spread over the int64 range)
    out = {"bench": "scale", "ids": args.ids, "cap": args.cap, "batch": b, "phases": []}

    def phase(name, t0, t, **kw):
        cur, peak = rss_mb()
        rec = dict(phase=name, s=round(time.perf_counter() - t0, 1),
                   cpu_s=round(time.process_time() - c0[0], 1), rss_mb=cur,
                   peak_rss_mb=peak, rows=len(t), **kw)
        if tier:
            rec.update(disk_mb=round(t.store.nbytes / 2**20), hit_ratio_all=round(
                t.stats()["hit_ratio"], 4), reopens=t.store.reopens)
        out["phases"].append(rec)
        print(json.dumps(rec), flush=True)

    tier, c0 = args.cap != "0", [0.0]

    def table():
        t = SparseTable(10, opt, seed=0)
        if not tier:
            return t
        t = TieredTable(t, parse_size(args.cap), work, "scale")
        t.store.map_budget = args.map_budget or t.store.map_budget
        if args.writemap != t.store.writemap:
            t.store.writemap = args.writemap
            t.store.env.close()
            t.store._open()
        return t
    try:
        t, buf = table(), np.empty((b, 10), np.float32)
        grads = rng.standard_normal((b, 10)).astype(np.float32) * 1e-3
        phase("start", time.perf_counter(), t, cap_rows=t.cap_rows if tier else 0)
        t0, c0[0] = time.perf_counter(), time.process_time()
        for lo in range(0, args.ids, b):
            k = np.sort(key(np.arange(lo, min(lo + b, args.ids), dtype=np.int64)))
            t.pull(k, buf[:len(k)], create=True)
            t.push(k, grads[:len(k)])
        phase("fill", t0, t, ids_per_s=round(args.ids / (time.perf_counter() - t0)))
        hits0, looked0 = (t.hits, t.hits + t.misses) if tier else (0, 0)
        t0, c0[0] = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            k = np.unique(key((rng.zipf(ZIPF, b) - 1) % args.ids))
            t.pull(k, buf[:len(k)], create=True)
            t.push(k, grads[:len(k)])
        n = args.steps * b
        phase("train", t0, t, ids_per_s=round(n / (time.perf_counter() - t0)),
              hit_ratio=round((t.hits - hits0) / (t.hits + t.misses - looked0), 4) if tier
              else 1.0)
        if args.no_saveload:
            return out
        t0, c0[0] = time.perf_counter(), time.process_time()
        path = ck.save_local(os.path.join(work, "ckpt"), t, DenseTable(np.zeros(8, np.float32),
                                                                        opt), "full")
        phase("save", t0, t)
        if tier:
            t.close()
        t0, c0[0] = time.perf_counter(), time.process_time()
        t = table()
        ck.load_local(path, t, DenseTable(np.zeros(8, np.float32), opt))
        phase("load", t0, t)
        assert len(t) == args.ids
        if tier:
            t.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def policy(args):
    """The ``policy`` bench (see the module doc)."""
    import numpy as np
    from mpips.data.reader import DataReader
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    from mpips.tables.tiered import POLICIES, TieredTable
    reader = DataReader(os.path.join(args.data, "train"), args.batch, prefetch=False)
    batches = [np.unique(b.sparse) for b in reader]
    opt = OptimizerConfig(name="adam", lr=1e-3)
    full = SparseTable(10, opt, seed=0)
    for k in batches:
        full.pull(k, np.empty((len(k), 10), np.float32), create=True)
    cap = full.nbytes // args.ratio
    out = {"bench": "policy", "data": args.data, "ratio": args.ratio, "cap_bytes": cap,
           "rows": len(full), "batches": len(batches), "runs": []}
    work = tempfile.mkdtemp(prefix="bench-policy-", dir=args.dir or None)
    try:
        for name in POLICIES:
            t = TieredTable(SparseTable(10, opt, seed=0), cap, work, "policy", policy=name)
            t0 = time.perf_counter()
            for k in batches:
                t.pull(k, np.empty((len(k), 10), np.float32), create=True)
            run = {"policy": name, "cap_rows": t.cap_rows, "s": round(time.perf_counter() - t0, 1),
                   **{k: v for k, v in t.stats().items() if k in ("hit_ratio", "moved_in")}}
            out["runs"].append(run)
            print(json.dumps(run), flush=True)
            t.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def saveload(args):
    runs = []
    for kind in ("memory", "tier"):
        proc = subprocess.run([sys.executable, __file__, "saveload-one", kind, str(args.rows),
                               str(args.ratio)], capture_output=True, text=True,
                              env=dict(os.environ, **ENV), cwd=str(ROOT), timeout=args.timeout)
        if proc.returncode:
            raise SystemExit(proc.stderr[-2000:])
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    return {"bench": "saveload", "ratio": args.ratio, "runs": runs}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "saveload-one":
        return saveload_one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("train", "saveload", "scale", "policy", "exact"))
    p.add_argument("--data", default="", help="a data_prep.criteo_like folder (train)")
    p.add_argument("--ratio", type=int, default=4, help="table bytes / --table-memory")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fc", default="400,400,400")
    p.add_argument("--rows", type=int, default=4_000_000, help="saveload: table rows")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--ids", type=int, default=2_000_000, help="scale: ids in the table")
    p.add_argument("--cap", default="256M", help="scale: the table's --table-memory (0: in "
                   "memory)")
    p.add_argument("--batch", type=int, default=8192,
                   help="scale: ids a step; policy: rows a batch")
    p.add_argument("--steps", type=int, default=300, help="scale: training steps")
    p.add_argument("--map-budget", type=int, default=0, help="scale: bytes of LMDB's map "
                   "before it is dropped (0: the tier's own share of --cap)")
    p.add_argument("--writemap", type=int, default=0, help="scale: LMDB writes through its "
                   "map (1) or by pwrite (0)")
    p.add_argument("--no-saveload", action="store_true", help="scale: stop after training")
    p.add_argument("--dir", default="", help="scale: where the tier and checkpoint go")
    args = p.parse_args()
    if args.what in ("train", "policy", "exact") and not args.data:
        p.error("train needs --data (see the usage above)")
    result = {"train": train, "saveload": saveload, "scale": scale,
              "policy": policy, "exact": exact}[args.what](args)
    OUT.parent.mkdir(exist_ok=True)
    with open(OUT, "a") as fh:
        fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
