"""Choosing the disk tier's engine: LMDB (py-lmdb) against RocksDB (rocksdict) on the tier's
own access pattern (docs/disk-tier.md, "The engine").

A table of N rows of ROW bytes (Adam, dim 10: 136 B) is written in one batch, then STEPS
steps each read MISS random ids in one multi-get, delete them (they move into memory;
"move") or leave their copies ("keep"), and write MISS rows that moved in earlier back in
one batch -- what a step of a table 4x its cap does.  Prints seconds per phase and bytes
on disk.

    python bench/bench_engine.py [--rows 1000000] [--steps 200] [--miss 8192]
    python bench/bench_engine.py --rows 560000 --steps 100 --miss 1500 --bounded 16777216

``--bounded B`` runs them as the tier does, with the engine's memory held to B bytes:
LMDB's map is dropped (closed and reopened) each time B bytes of it are resident in the
process, in transactions of 170 rows (the tier's at a 16 MiB budget); RocksDB gets a block
cache of B/2 and two memtables of B/4 (reads by pread; no map).  Copies are kept (the
tier's mode).  CPU is the process's, around the engine's calls only (RocksDB's background
threads count while those calls run).
"""
import argparse
import os
import shutil
import tempfile
import time
from operator import itemgetter

import numpy as np

ROW = 136


def as_bytes(arr, width):
    """Rows of a C-contiguous array as a list of bytes objects (no Python loop)."""
    return np.ascontiguousarray(arr).view(f"V{width}").ravel().tolist()


class Lmdb:
    """LMDB as the tier opens it (mpips.tables.disk: no writemap, so a full disk is an
    error, not a SIGBUS)."""
    writemap = False

    def __init__(self, path):
        import lmdb
        self.env = lmdb.open(path, map_size=1 << 40, subdir=True, sync=False, metasync=False,
                             writemap=self.writemap, readahead=False, lock=False, max_dbs=0)

    def put(self, k, v):
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(k, v))

    def get(self, k):
        with self.env.begin() as txn:
            got = txn.cursor().getmulti(k)
        return list(map(itemgetter(1), got))

    def delete(self, k):
        with self.env.begin(write=True) as txn:
            sum(map(txn.delete, k))

    def close(self):
        self.env.close()


class LmdbWritemap(Lmdb):
    """LMDB writing through its memory map."""
    writemap = True


class BoundedLmdb(Lmdb):
    """LMDB as the tier runs it (mpips.tables.disk): the map's pages resident in the process
    are measured after each transaction, and the map is dropped (closed and reopened) past
    ``BUDGET`` bytes of them, so the process's RSS stays bounded; by pwrite."""
    BUDGET = 16 << 20

    def __init__(self, path):
        from mpips.tables.disk import mapped_bytes
        self.path, self.mapped, self.reopens = path, mapped_bytes, 0
        super().__init__(path)
        self.base = mapped_bytes()

    def _check(self):
        if self.mapped() - self.base > self.BUDGET:
            self.env.close()
            Lmdb.__init__(self, self.path)
            self.base, self.reopens = self.mapped(), self.reopens + 1

    def put(self, k, v):
        for lo in range(0, len(k), 170):      # (the tier's transactions at this budget)
            super().put(k[lo:lo + 170], v[lo:lo + 170])
            self._check()

    def get(self, k):
        out = []
        for lo in range(0, len(k), 170):
            out += super().get(k[lo:lo + 170])
            self._check()
        return out


class BoundedLmdbWritemap(BoundedLmdb):
    writemap = True


class Rocks:
    BUDGET = 0              # bounded: block cache and write buffers within this many bytes

    def __init__(self, path):
        from rocksdict import BlockBasedOptions, Cache, Options, Rdict, WriteBatch
        opt = Options(raw_mode=True)
        opt.create_if_missing(True)
        opt.set_max_background_jobs(1)
        opt.increase_parallelism(1)
        if self.BUDGET:
            bbo = BlockBasedOptions()
            bbo.set_block_cache(Cache(self.BUDGET // 2))
            bbo.set_cache_index_and_filter_blocks(True)
            bbo.set_bloom_filter(10, False)
            opt.set_block_based_table_factory(bbo)
            opt.set_write_buffer_size(self.BUDGET // 4)
            opt.set_max_write_buffer_number(2)
        self.db, self.WriteBatch = Rdict(path, opt), WriteBatch


class BoundedRocks(Rocks):
    """RocksDB with its block cache (half the budget) and memtables (two of a quarter)
    bounded; reads by pread, no map."""
    BUDGET = 16 << 20

    def put(self, k, v):
        wb = self.WriteBatch(raw_mode=True)
        for a, b in zip(k, v):
            wb.put(a, b)
        self.db.write(wb)

    def get(self, k):
        return self.db.get(k)

    def delete(self, k):
        wb = self.WriteBatch(raw_mode=True)
        for a in k:
            wb.delete(a)
        self.db.write(wb)

    def close(self):
        self.db.close()


def rss_kb():
    with open("/proc/self/status") as fh:
        return next(int(x.split()[1]) for x in fh if x.startswith("VmRSS"))


def du(path):
    """Bytes allocated on disk (LMDB's file is sparse: its size is the map's)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path)
               for f in fs)


def run(engine, rows, steps, miss, seed=0, keep_copies=False):
    rng = np.random.default_rng(seed)
    tmp = tempfile.mkdtemp(prefix=f"engine-{engine.__name__}-")
    try:
        keys = np.arange(rows, dtype=">i8")
        vals = rng.integers(0, 255, (rows, ROW), dtype=np.uint8)
        rss0 = rss_kb()
        db = engine(tmp)
        t0 = time.perf_counter()
        db.put(as_bytes(keys, 8), as_bytes(vals, ROW))
        t_load = time.perf_counter() - t0
        on_disk = np.ones(rows, bool)
        t_get = t_del = t_put = cpu = 0.0
        for _ in range(steps):
            out = rng.choice(np.flatnonzero(on_disk), miss, replace=False)
            back = rng.choice(np.flatnonzero(~on_disk), miss, replace=False) \
                if (~on_disk).sum() >= miss else np.empty(0, np.int64)
            k = as_bytes(np.sort(out).astype(">i8"), 8)
            kb, vb = as_bytes(np.sort(back).astype(">i8"), 8), as_bytes(vals[back], ROW)
            c0 = time.process_time()
            t0 = time.perf_counter()
            got = db.get(k)
            t1 = time.perf_counter()
            if not keep_copies:
                db.delete(k)
            t2 = time.perf_counter()
            db.put(kb, vb)
            t3 = time.perf_counter()
            cpu += time.process_time() - c0
            assert len(got) == miss and all(g is not None for g in got)
            on_disk[out], on_disk[back] = False, True      # (kept copies: overwritten)
            t_get, t_del, t_put = t_get + t1 - t0, t_del + t2 - t1, t_put + t3 - t2
        cpu_us = 1e6 * cpu / (steps * miss)
        db.close()
        print(f"{engine.__name__:12s} {'keep' if keep_copies else 'move'} rows {rows} load {t_load:.2f} s; per step of {miss} misses:"
              f" get {1e3 * t_get / steps:.1f} ms, delete {1e3 * t_del / steps:.1f} ms, "
              f"put {1e3 * t_put / steps:.1f} ms; CPU {cpu_us:.1f} us a row read and "
              f"written; RSS +{(rss_kb() - rss0) / 1024:.0f} MB at the end; on disk {du(tmp) / 2**20:.0f} MiB",
              flush=True)
    finally:
        shutil.rmtree(tmp)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--miss", type=int, default=8192)
    p.add_argument("--bounded", type=int, default=0, help="bytes: run the engines with their "
                   "memory bounded to this (the tier's regime), copies kept")
    a = p.parse_args()
    if a.bounded:
        BoundedLmdb.BUDGET = BoundedRocks.BUDGET = a.bounded
        for engine in (BoundedLmdb, BoundedLmdbWritemap, BoundedRocks) * 2:
            run(engine, a.rows, a.steps, a.miss, keep_copies=True)
        return
    for engine in (Lmdb, LmdbWritemap, Rocks) * 2:
        for keep in (False, True):
            run(engine, a.rows, a.steps, a.miss, keep_copies=keep)


if __name__ == "__main__":
    main()
