"""Load benchmark: a big sparse table's memory per row, build time, and throughput under load.

    python bench/bench_load.py                        # 50M rows (~10 GB, 1-2 min) + 4 clients
    python bench/bench_load.py --rows 2000000 --serve-rows 1000000 --rounds 400

Parts:
1. build (one process): a SparseTable of --rows rows (dim 10, Adam) grown from empty by
   pull(create=True) in chunks of random int64 ids, as a server fills up in training.
   Reports table bytes per row (SparseTable.nbytes / rows, and RSS growth / rows) against
   the raw payload: key 8 + values 40 + Adam m, v 80 + beta powers 8 = 136 B; goal <= 1.5x;
   and the process's peak RSS over its RSS at the end (goal <= 1.25: growing the table
   must never hold two copies of it), with the slowest chunk (index rebuild pauses).
2. serve (mpiexec -n 1+--clients): rank 0 runs the real Server over a table pre-filled
   with --serve-rows ids; every other rank is a PSClient that pulls 5k random ids of that
   universe and pushes gradients for them, --rounds times.  Reports keys/s (pulled + pushed,
   all clients) and the server's RSS sampled every --sample-every rounds by client 1 from
   /proc: with a fixed key universe it must stay flat (no growth of buffers or in-flight
   requests).
Results go to stdout and bench/out/bench_load.json.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENV, ROOT, mpiexec  # noqa: E402


DIM = 10
PAYLOAD = 8 + 4 * DIM + 2 * 4 * DIM + 8       # key, values, Adam m and v, beta1/beta2 powers
BATCH_KEYS = 5000
CHUNK = 1 << 20


def rss_mb(pid="self"):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def new_table():
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    return SparseTable(DIM, OptimizerConfig(name="adam", lr=1e-3), seed=0)


def fill(table, n_rows, seed):
    """Insert n_rows distinct random ids (chunked pulls with create); return the ids' seed."""
    rng = np.random.default_rng(seed)
    out = np.empty((CHUNK, DIM), np.float32)
    slowest = 0.0
    while len(table) < n_rows:
        ids = rng.integers(1, 2**63 - 1, size=min(CHUNK, n_rows - len(table)), dtype=np.int64)
        t0 = time.perf_counter()
        table.pull(ids, out[:len(ids)], create=True)
        slowest = max(slowest, time.perf_counter() - t0)
    return slowest


def build(rows):
    """Part 1: memory per row and build time."""
    import gc
    from mpips.tables.sparse import SparseTable  # noqa: F401 - warm imports first
    warm = new_table()
    fill(warm, 10_000, 99)                       # compile the kernels outside the timing
    del warm
    gc.collect()
    rss0, t0 = rss_mb(), time.perf_counter()
    table = new_table()
    slowest = fill(table, rows, 1)
    seconds = time.perf_counter() - t0
    n = len(table)
    peak, steady = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, rss_mb() / 1024
    res = {"rows": n, "build_seconds": round(seconds, 1),
           "rows_per_second": round(n / seconds),
           "slowest_chunk_seconds": round(slowest, 2), "chunk_rows": CHUNK,
           "payload_bytes_per_row": PAYLOAD,
           "table_bytes_per_row": round(table.nbytes / n, 1),
           "rss_bytes_per_row": round((rss_mb() - rss0) * 2**20 / n, 1),
           "row_capacity": table.capacity, "slots": table.n_slots,
           "pages": getattr(table, "n_pages", None),
           "peak_rss_gb": round(peak, 2), "steady_rss_gb": round(steady, 2),
           "peak_over_steady": round(peak / steady, 3)}
    res["ratio_table"] = round(res["table_bytes_per_row"] / PAYLOAD, 3)
    res["ratio_rss"] = round(res["rss_bytes_per_row"] / PAYLOAD, 3)
    res.update(local_throughput(table, n))
    return res


def local_throughput(table, n, rounds=200):
    """One process, no MPI: pull+push 5k random existing ids per round (keys/s)."""
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(0, n, BATCH_KEYS))
    ids = table.export_rows(keys)["keys"] if hasattr(table, "export_rows") else None
    out = np.empty((len(ids), DIM), np.float32)
    grads = np.full((len(ids), DIM), 1e-3, np.float32)
    t0 = time.perf_counter()
    for _ in range(rounds):
        table.pull(ids, out, create=True)
        table.push(ids, grads)
    dt = time.perf_counter() - t0
    return {"local_pull_push_keys_per_second": round(2 * rounds * len(ids) / dt)}


# ---- part 2: under mpiexec ----------------------------------------------------------------
def mpi_main(a):
    from mpi4py import MPI

    from mpips.tables.dense import DenseTable
    from mpips.server.loop import Server
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.ownership import plan_keys
    from mpips.worker.client import PSClient
    comm = MPI.COMM_WORLD
    pid = np.array([os.getpid()], np.int64)
    comm.Bcast(pid, root=0)
    universe = np.random.default_rng(7).integers(1, 2**62, size=a.serve_rows, dtype=np.int64)
    if comm.rank == 0:
        table = new_table()
        out = np.empty((CHUNK, DIM), np.float32)
        for lo in range(0, len(universe), CHUNK):
            part = universe[lo:lo + CHUNK]
            table.pull(part, out[:len(part)], create=True)
        dense = DenseTable(np.zeros(16, np.float32), OptimizerConfig(name="adam", lr=1e-3))
        server = Server(comm, list(range(1, comm.size)), table, dense, timeout=600)
        comm.Barrier()
        server.run()
        comm.Gather(np.zeros(2), None, root=1)
        return 0
    client = PSClient(comm, [0], DIM, np.array([0, 16], np.int64), timeout=600)
    rng = np.random.default_rng(100 + comm.rank)
    out = np.empty((BATCH_KEYS, DIM), np.float32)
    grads = np.full((BATCH_KEYS, DIM), 1e-3, np.float32)
    samples = []
    comm.Barrier()
    t0, keys_done = time.perf_counter(), 0
    for r in range(a.rounds):
        plan = plan_keys(universe[rng.integers(0, len(universe), BATCH_KEYS)], 1)
        u = len(plan.keys)
        client.pull(plan, out[:u], step=r).wait()
        client.push(plan, grads[:u], step=r).wait()
        keys_done += 2 * u
        if comm.rank == 1 and r % a.sample_every == 0:
            samples.append(round(rss_mb(int(pid[0])), 1))
    seconds = time.perf_counter() - t0
    from mpips.comm.protocol import Op
    client.control(Op.FINISH)
    table = np.zeros((comm.size, 2)) if comm.rank == 1 else None
    comm.Gather(np.array([keys_done, seconds], np.float64), table, root=1)
    if comm.rank == 1:
        print("SERVER_RSS " + json.dumps(samples), flush=True)
        print(f"ALL keys {int(table[:, 0].sum())} seconds {table[:, 1].max():.3f}", flush=True)
    return 0


def serve(a):
    cmd = [mpiexec(), "-n", str(a.clients + 1), sys.executable,
           str(Path(__file__).resolve()), "--mpi", "--serve-rows", str(a.serve_rows),
           "--rounds", str(a.rounds), "--sample-every", str(a.sample_every)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV),
                          cwd=str(ROOT), timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"serve part failed:\n{proc.stderr[-3000:]}")
    samples = json.loads(proc.stdout.split("SERVER_RSS ")[1].splitlines()[0])
    words = proc.stdout.split("ALL keys ")[1].split()
    keys, secs = int(words[0]), float(words[2])
    half = len(samples) // 2
    return {"clients": a.clients, "serve_rows": a.serve_rows, "rounds": a.rounds,
            "keys_per_round": BATCH_KEYS, "wall_seconds": round(time.time() - t0, 1),
            "keys_pulled_and_pushed": keys, "seconds": round(secs, 2),
            "keys_per_second_all_clients": round(keys / secs),
            "server_rss_mb_samples": samples,
            "server_rss_growth_mb_second_half": round(max(samples[half:]) - samples[half], 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50_000_000, help="rows of the build part")
    ap.add_argument("--serve-rows", type=int, default=2_000_000, help="ids the server holds")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1000, help="pull+push rounds per client")
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--mpi", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mpi:
        return mpi_main(a)
    res = {}
    if not a.skip_build:
        res["build"] = build(a.rows)
        print(json.dumps(res["build"], indent=1), flush=True)
    if not a.skip_serve:
        res["serve"] = serve(a)
        print(json.dumps(res["serve"], indent=1), flush=True)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_load.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
