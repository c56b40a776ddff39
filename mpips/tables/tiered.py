"""A sparse table larger than memory: a bounded SparseTable in front of rows on disk.

:class:`TieredTable` has the SparseTable interface (pull, push, add, assign, shrink, age,
the change tracking and the row streams a checkpoint reads and writes).  Every id has a row
*resident* in the numba table (the cache, at most ``cap_rows`` rows between calls), or on
disk (:class:`mpips.tables.disk.RowStore`: embedding, optimizer state, admission counters,
last-seen), or both: a row read in keeps its disk copy, and the resident row is the row
(the copy may be stale).  Two bits a resident row (``_flags``) say whether it has a disk
copy (COPY) and whether it changed since it was read in (CHANGED).  A call

1. looks its keys up in the cache (the hit path is the numba table's);
2. reads the misses from disk in one multi-get;
3. if the cache would pass its cap, moves rows out (never a key of this call; the
   fewest sightings first, by ``POLICY``) down to ``1 - EVICT_FRACTION`` of the cap, so
   the cache's compaction is paid once per that many misses;
4. writes back only those of them whose disk copy is missing or stale, in one batch sorted
   by id (LMDB transactions of at most ``RowStore.txn_rows`` rows each, so the map's pages
   stay within its budget); a clean row is dropped, its copy is already on disk;
5. imports the rows read (COPY), then runs the call on the cache as the in-memory table
   would, marking its rows CHANGED if the call changes rows.

A row's fields move with it byte for byte and the optimizer and the shrink's ageing are
per row, so every value equals the in-memory table's: only the order of the rows differs
(a checkpoint written from the tier holds the resident rows first, then the disk rows in id
order).  ``shrink``, ``age``, ``clear_dirty`` and the saves walk the disk rows too, in
chunks, skipping the copies of resident rows (``_disk_only``).  A call's own keys are never
moved out: the cap is exceeded by at most one call's keys (a server's request, or
``LOAD_ROWS`` while loading).

Row indices (``rows_of``, ``pull``'s return) are the cache's; an id on disk has -1 there
(``has_rows`` says whether an id has a row anywhere).  Moving rows out compacts the cache,
which counts as a compaction (the staleness tracker forgets its pulls, as after a shrink).
"""
import time

import numpy as np

from mpips.kernels.hashmap import age_rows
from mpips.tables.disk import RowStore
from mpips.tables.sparse import LOAD_FACTOR, UNSEEN_MAX, SparseTable, _as_keys

EVICT_FRACTION = 0.125      # of the cap moved out when the cache is full
# Which resident rows move out first: "lru" (least recently used, by call) or "lfu" (fewest
# sightings: the rows' own seen_count, ties by LRU).  Chosen by `bench_disk_table.py policy`
# (docs/disk-tier.md): on 1M Criteo-like rows at a quarter of the table, LFU read 292k rows
# from disk where LRU read 550k.
POLICIES = ("lru", "lfu")
POLICY = "lfu"
# The cap covers the resident rows and the pages of LMDB's map this process touches: a
# share of it is the map's (dropped and re-mapped when used up), the rest the rows'.  The
# map's share trades memory for speed: 300 steps of ~6k Zipf ids over 1M rows in one
# process spent 68 s in LMDB re-mapping every 64 MiB, 33 s never re-mapping.  With the map
# dropped by madvise and written by pwrite, a smaller minimum gives the rows more of a
# small cap: at 29.4 MB a server (2x2 on 1M Criteo-like rows), 8 MiB instead of 16 raised
# the hit ratio from 0.899 to 0.911, the server's CPU 17.7 s from 20.5-21.6 (docs/disk-tier.md).
MAP_SHARE = 0.25
MIN_MAP_BUDGET = 8 << 20
MIN_CAP_ROWS = 1
SCAN_ROWS = 1 << 16         # disk rows a chunk while walking the store (shrink, saves)
STAMP_BYTES = 9             # the LRU stamp (int64) and the flags (uint8) of a resident row
COPY, CHANGED = 1, 2        # a resident row's flags: it has a disk copy; it changed since read


class TieredTable:
    """A SparseTable holding at most ``memory_bytes`` of rows in memory, the rest on disk.

    table: the (empty) SparseTable used as the cache; memory_bytes: the cap: MAP_SHARE of
    it (at least MIN_MAP_BUDGET) for the pages of the store's map, the rest for resident
    rows (their fields, slots, stamps and flags); table_dir: parent of the store's folder;
    tag: the folder's name prefix (e.g. ``rank3``); policy: which rows move out (POLICIES).
    """

    def __init__(self, table, memory_bytes, table_dir, tag="table", policy=POLICY):
        if not isinstance(table, SparseTable) or len(table):
            raise ValueError("TieredTable needs an empty SparseTable")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")
        self.policy = policy
        self.cache = table
        template = table.export_rows(np.empty(0, np.int64))
        self.row_bytes = self.bytes_per_row(template)
        self.memory_bytes = int(memory_bytes)
        map_budget = max(int(self.memory_bytes * MAP_SHARE), MIN_MAP_BUDGET)
        self.cap_rows = max((self.memory_bytes - map_budget) // self.row_bytes, MIN_CAP_ROWS)
        self.store = RowStore(table_dir, template, tag, map_budget, first_ids=self.cap_rows)
        self._stamp = np.zeros(1024, np.int64)
        self._flags = np.zeros(1024, np.uint8)
        self._clock = 0
        self.shrinks = 0
        self._evicted = []
        self.hits = self.misses = self.moved_in = self.moved_out = self.written_back = 0
        self.read_s = self.write_s = 0.0

    @staticmethod
    def bytes_per_row(template):
        """Memory a resident row takes: its fields, its LRU stamp and up to two slots."""
        fields = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in template.values())
        return fields + STAMP_BYTES + int(np.ceil(2 * 4 / LOAD_FACTOR))

    # ------------------------------------------------------------- the table
    dim = property(lambda self: self.cache.dim)
    opt = property(lambda self: self.cache.opt)
    seed = property(lambda self: self.cache.seed)
    init_range = property(lambda self: self.cache.init_range)
    compactions = property(lambda self: self.cache.compactions)

    def __len__(self):
        return len(self.cache) + self.store.count - self.copies()

    def copies(self):
        """Resident rows that also have a (possibly stale) copy on disk."""
        return int(np.count_nonzero(self._flags[:len(self.cache)] & COPY))

    @property
    def row_span(self):
        """Row indices in use (the cache's): what per-row arrays indexed by them need."""
        return len(self.cache)

    @property
    def nbytes(self):
        """Bytes of the arrays in memory (the cache's and the stamps)."""
        return (self.cache.nbytes + self._stamp.nbytes + self._flags.nbytes +
                self.store.ids.nbytes)

    def row_fields(self):
        return self.cache.row_fields()

    def rows_of(self, keys):
        """The cache row of each key (-1: no row, or on disk)."""
        return self.cache.rows_of(keys)

    def has_rows(self, keys):
        """Which keys have a row, in memory or on disk (bool (n,))."""
        keys = _as_keys(keys)
        have = self.cache.has_rows(keys)
        if not have.all():
            have[~have] = self.store.contains(keys[~have])
        return have

    # ------------------------------------------------------------- residency
    def _touch_new(self, lo, flags=0):
        """Stamp rows lo .. len-1 of the cache (appended by this call) with the clock and
        set their ``flags``."""
        n = len(self.cache)
        if n > self._stamp.shape[0]:
            size = max(n, 2 * self._stamp.shape[0])
            self._stamp = _grown(self._stamp, size)
            self._flags = _grown(self._flags, size)
        self._stamp[lo:n] = self._clock
        self._flags[lo:n] = flags

    def _changed(self, lo):
        """After a call that changes its rows: rows from ``lo`` on (read in or made by it)
        differ from their disk copies."""
        self._flags[lo:len(self.cache)] |= CHANGED

    def _resident(self, keys, create, changes):
        """Make every key that has a row resident (moving LRU rows out first); return the
        number of cache rows before the rows read in.  changes: the call changes its rows
        (the hits are marked CHANGED here, the rows read in by ``_changed`` after it)."""
        self._clock += 1
        rows = self.cache.rows_of(keys)
        hit = rows >= 0
        self._stamp[rows[hit]] = self._clock
        if changes:
            self._flags[rows[hit]] |= CHANGED
        n_hit = int(hit.sum())
        self.hits += n_hit
        self.misses += len(keys) - n_hit
        if n_hit == len(keys):
            return len(self.cache)
        t0 = time.perf_counter()
        found, rows_in = self.store.get(keys[~hit])
        t1 = time.perf_counter()
        n_in = int(found.sum())
        room = n_in + ((len(keys) - n_hit - n_in) if create else 0)
        out = self._move_out(room)
        t2 = time.perf_counter()
        if out is not None:
            self.store.write(put=out)
        self.read_s += t1 - t0
        self.write_s += time.perf_counter() - t2
        lo = len(self.cache)
        if n_in:
            self.cache.import_rows(rows_in)
            self.moved_in += n_in
            self._touch_new(lo, COPY)
        return lo

    def _move_out(self, room):
        """Remove the least recently used rows (none of this call) so that ``room`` more
        fit under the cap; return those to write back (no copy on disk, or a stale one: an
        ``export_rows`` dict) or None."""
        n = len(self.cache)
        if n + room <= self.cap_rows:
            return None
        low = int(self.cap_rows * (1 - EVICT_FRACTION))
        stamps = self._stamp[:n]
        cold = np.flatnonzero(stamps < self._clock)
        k = min(n + room - low, len(cold))
        if k <= 0:
            return None
        if k < len(cold):
            if self.policy == "lfu":            # (in place: a full cache's ranking is
                rank = self.cache.field("seen_count")[cold].astype(np.int64)  # 6 MB an array)
                rank <<= 32
                rank += stamps[cold]
            else:
                rank = stamps[cold]
            pick = np.argpartition(rank, k - 1)[:k]
            del rank
            cold = cold[pick]
            cold.sort()
        back = cold[self._flags[cold] != COPY]
        out = self.cache.export_rows(back) if len(back) else None
        keep = np.ones(n, np.bool_)
        keep[cold] = False
        self._compact(keep)
        self.moved_out += k
        self.written_back += len(back)
        return out

    def _compact(self, keep):
        """Drop the cache rows where ``keep`` (bool (len,)) is False, with their stamps."""
        kept = int(np.count_nonzero(keep))
        n = len(keep)
        self._stamp[:kept] = self._stamp[:n][keep]
        self._flags[:kept] = self._flags[:n][keep]
        self.cache.drop(keep)

    # ------------------------------------------------------------- hot path
    def pull(self, keys, out, create=False, counts=None):
        """As SparseTable.pull; rows on disk are read in first."""
        keys = _as_keys(keys)
        lo = self._resident(keys, create, create)
        mid = len(self.cache)
        rows = self.cache.pull(keys, out, create=create)
        self._touch_new(mid)
        if create:
            self._changed(lo)
        return rows

    def push(self, keys, grads, scale=1.0, create=True, lr_scale=None):
        keys = _as_keys(keys)
        lo = self._resident(keys, create, True)
        mid = len(self.cache)
        self.cache.push(keys, grads, scale, create=create, lr_scale=lr_scale)
        self._touch_new(mid)
        self._changed(lo)

    def add(self, keys, deltas, create=True):
        keys = _as_keys(keys)
        lo = self._resident(keys, create, True)
        mid = len(self.cache)
        self.cache.add(keys, deltas, create=create)
        self._touch_new(mid)
        self._changed(lo)

    def assign(self, keys, values):
        keys = _as_keys(keys)
        lo = self._resident(keys, True, True)
        mid = len(self.cache)
        self.cache.assign(keys, values)
        self._touch_new(mid)
        self._changed(lo)

    # ------------------------------------------------------ checkpoint support
    def import_rows(self, data):
        """As SparseTable.import_rows: resident ids and, while the cap allows, new ones are
        imported into memory; the rest are written to disk as they are (a load streams
        through the cache without reading the disk)."""
        keys, cols = self.cache.checked_rows(data)
        self._clock += 1
        mem = self.cache.has_rows(keys)
        room = max(self.cap_rows - len(self.cache), 0)
        mem[np.flatnonzero(~mem)[:room]] = True
        if not mem.all():
            self._timed_write(put=_select(cols, ~mem))
        if mem.any():
            part = _select(cols, mem)
            if self.store.count:      # (older disk copies go: these rows have none)
                self._timed_write(discard=part["keys"])
            lo = len(self.cache)
            self.cache.import_rows({f: a for f, a in part.items() if np.ndim(a)})
            self._touch_new(lo)
            self._flags[self.cache.rows_of(part["keys"])] = 0

    def _timed_write(self, **kw):
        t0 = time.perf_counter()
        self.store.write(**kw)
        self.write_s += time.perf_counter() - t0

    def export_rows(self, rows=None):
        """Fields of cache ``rows``; None: every row, memory and disk (a copy of the whole
        table: tests and small tables only -- saves stream ``iter_rows``)."""
        if rows is not None:
            return self.cache.export_rows(rows)
        parts = list(self.iter_rows())
        if not parts:
            return self.cache.export_rows(np.empty(0, np.int64))
        return {f: np.concatenate([p[f] for p in parts]) for f in parts[0]}

    def count_rows(self, dirty_only=False):
        if not dirty_only:
            return len(self)
        return self.cache.count_rows(True) + sum(
            int(np.count_nonzero(c["dirty"])) for c in self._disk_only())

    def iter_rows(self, dirty_only=False, chunk=1 << 18):
        """The resident rows (cache order), then the disk rows (id order), in chunks."""
        yield from self.cache.iter_rows(dirty_only, chunk)
        for part in self._disk_only(min(chunk, SCAN_ROWS)):
            if dirty_only:
                sel = part["dirty"] != 0
                part = {f: a[sel] for f, a in part.items()}
            if len(part["keys"]):
                yield part

    def dirty_keys(self):
        parts = [self.cache.dirty_keys()] + [c["keys"] for c in self.iter_disk_dirty()]
        return np.concatenate(parts)

    def _disk_only(self, chunk=SCAN_ROWS):
        """The disk rows that are not resident (a resident row's copy may be stale), in
        chunks of at most ``chunk``, in id order."""
        for part in self.store.scan(chunk):
            sel = ~self.cache.has_rows(part["keys"])
            if not sel.all():
                part = {f: a[sel] for f, a in part.items()}
            yield part

    def iter_disk_dirty(self):
        for part in self._disk_only():
            sel = part["dirty"] != 0
            if sel.any():
                yield {f: a[sel] for f, a in part.items()}

    def clear_dirty(self):
        self._flags[self.cache.dirty_rows()] |= CHANGED
        self.cache.clear_dirty()
        for part in self.iter_disk_dirty():     # (the scan reads on after each write)
            part["dirty"][:] = 0
            self.store.write(put=part)
        self.shrinks = 0

    def evicted_keys(self):
        """Sorted unique ids removed by ``shrink`` since ``clear_evicted`` (both tiers)."""
        if not self._evicted:
            return np.empty(0, np.int64)
        return np.unique(np.concatenate(self._evicted))

    def clear_evicted(self):
        self._evicted = []

    # ------------------------------------------------------------------ shrink
    def shrink(self, threshold):
        """As SparseTable.shrink, over the resident rows and the disk rows."""
        if int(threshold) != threshold or threshold < 0:
            raise ValueError(f'shrink threshold must be an integer >= 0; got {threshold}')
        self.shrinks += 1
        removed = self._shrink_cache(int(threshold))
        t0 = time.perf_counter()
        for part in self._disk_only():
            keep = np.empty(len(part["keys"]), np.bool_)
            age_rows(part["unseen"], part["seen_flag"], len(keep), int(threshold), keep)
            gone = part["keys"][~keep]
            if len(gone):
                self._evicted.append(gone)
                removed += len(gone)
            self.store.write(put={f: a[keep] for f, a in part.items()}, delete=gone)
        self.write_s += time.perf_counter() - t0
        return removed

    def _shrink_cache(self, threshold):
        keep = self.cache.age_mask(threshold)
        n, kept = len(keep), int(keep.sum())
        self._flags[:n] |= CHANGED                       # (every row was aged)
        if kept == n:
            return 0
        gone = np.flatnonzero(~keep)
        keys = self.cache.export_rows(gone)["keys"]
        self._evicted.append(keys)
        self._timed_write(delete=keys[(self._flags[gone] & COPY) != 0])
        self._compact(keep)
        return n - kept

    def age(self, times):
        """Age every row as ``times`` shrink calls would, evicting none (checkpoint replay)."""
        self.cache.age(times)
        if not int(times):
            return
        self._flags[:len(self.cache)] |= CHANGED
        for part in self._disk_only():
            keep = np.empty(len(part["keys"]), np.bool_)
            for _ in range(int(times)):
                age_rows(part["unseen"], part["seen_flag"], len(keep), UNSEEN_MAX, keep)
            self.store.write(put=part)

    # ------------------------------------------------------------------ info
    def stats(self):
        """Counters for the SERVER line and the records."""
        looked = self.hits + self.misses
        return {"resident_rows": len(self.cache), "disk_rows": self.store.count,
                "disk_bytes": self.store.nbytes,
                "hit_ratio": self.hits / looked if looked else 1.0,
                "tier_read_s": self.read_s, "tier_write_s": self.write_s,
                "moved_in": self.moved_in, "moved_out": self.moved_out,
                "written_back": self.written_back, "looked_up": self.store.looked_up,
                "filter_bytes": self.store.ids.nbytes}

    def close(self):
        """Remove the store's folder (the tier is live state only)."""
        self.store.close()


def _grown(arr, size):
    out = np.zeros(size, arr.dtype)
    out[:len(arr)] = arr
    return out


def _select(cols, mask):
    """The rows of ``mask`` of a ``checked_rows`` dict (scalars stay scalars)."""
    return {f: a[mask] if np.ndim(a) else a for f, a in cols.items()}


# ------------------------------------------------------------------ reporting
TIER_STATS = ("resident_rows", "disk_rows", "disk_bytes", "tier_hits", "tier_misses",
              "tier_read_us", "tier_write_us")


def tier_of(table):
    """The TieredTable behind a table (an admission filter's), or None."""
    inner = getattr(table, "table", table)
    return inner if isinstance(inner, TieredTable) else None


def tier_counters(table):
    """{TIER_STATS name: int} of a table (zeros without a tier), for a STATS record."""
    t = tier_of(table)
    if t is None:
        return dict.fromkeys(TIER_STATS, 0)
    return {"resident_rows": len(t.cache), "disk_rows": t.store.count,
            "disk_bytes": t.store.nbytes, "tier_hits": t.hits, "tier_misses": t.misses,
            "tier_read_us": int(t.read_s * 1e6), "tier_write_us": int(t.write_s * 1e6)}


def tier_record(c):
    """The record's tier fields from counters (a dict, or STATS records of all servers:
    summed)."""
    tot = {k: int(np.sum(c[k])) for k in TIER_STATS}
    looked = tot["tier_hits"] + tot["tier_misses"]
    return {"tier_resident_rows": tot["resident_rows"], "tier_disk_rows": tot["disk_rows"],
            "tier_disk_bytes": tot["disk_bytes"],
            "tier_hit_ratio": round(tot["tier_hits"] / looked, 6) if looked else 1.0,
            "tier_read_s": round(tot["tier_read_us"] / 1e6, 3),
            "tier_write_s": round(tot["tier_write_us"] / 1e6, 3)}


def tier_note(table):
    """The SERVER / PROFILE line's tier part ('' without a tier)."""
    if tier_of(table) is None:
        return ""
    r = tier_record(tier_counters(table))
    return (f" tier: resident_rows: {r['tier_resident_rows']} disk_rows: "
            f"{r['tier_disk_rows']} disk_MB: {r['tier_disk_bytes'] / 2**20:.1f} hit_ratio: "
            f"{r['tier_hit_ratio']:.4f} read_s: {r['tier_read_s']:.2f} write_s: "
            f"{r['tier_write_s']:.2f}")
