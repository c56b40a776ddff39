"""The disk tier's row store: whole table rows in LMDB, as raw bytes of a fixed layout.

A row is stored under its id (8 bytes, big-endian, sign bit flipped, so the byte order is
the ids' signed order) as one record of every field but the key (``row_dtype``: the
table's fields in the table's order, packed, native byte order): embedding, optimizer
state, admission counters and last-seen.  Nothing is pickled; a record that is not
``row_dtype.itemsize`` bytes is an error.

Every operation takes or returns a batch, as the table's fields in a dict of arrays
(``export_rows``' layout): ``get`` (multi-gets of the ids the filter of stored ids,
``IdFilter``, may hold), ``write`` (rows to put and ids to delete, in transactions of at
most ``txn_rows``) and ``scan`` (every row, in id order, in chunks).  The rows are
converted to and from bytes by numpy (``view`` / ``frombuffer``); py-lmdb iterates the
lists in C, never a Python loop a row.

The store is live state only.  Its folder is made fresh by ``tempfile.mkdtemp`` inside
the directory given (never an existing one: a folder left by another run is never read;
made hidden and renamed into view once its lock is held: ``_locked_folder``)
and removed by ``close``.  The folder's ``owner.lock`` is held (``flock``) while the store
is open; the kernel lets go of it when its process dies, so a folder whose lock nobody
holds was left by a killed run and ``sweep`` removes it (each new store sweeps its
parent).  LMDB was chosen over RocksDB (rocksdict) by
``bench/bench_engine.py`` on this 2-core machine (docs/disk-tier.md): its multi-get of a
step's misses is about 4x faster with the map resident, and a B+tree has no background
compaction to compete with training for the cores (LMDB runs no thread of its own).

LMDB reads through a memory map; the pages a process touches count in its RSS (and the
kernel maps about 16 neighbours with each page it faults in), so the map is dropped each
time ``map_budget`` bytes of it are resident.  Writes do not go through the map
(``writemap`` off): LMDB writes its pages with pwrite, so a write takes no page fault and
a full disk is an error of the commit, not a SIGBUS.  Writing through the map cost the
bounded store 1.6x the CPU in training steps and 8x in filling (a write fault a page
touched, after each drop of the map; docs/disk-tier.md, "The engine").
"""
import ctypes
import errno
import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from itertools import islice
from operator import itemgetter

import numpy as np

from mpips.kernels.hashmap import bloom_add, bloom_query, subsequence_mask
from mpips.tiering import check_dir

MAP_SIZE = 1 << 40          # LMDB's address space reservation (a sparse file; not memory)
MAP_BUDGET = 64 << 20       # default bytes of the map touched between reopenings
PAGE = 4096                 # LMDB's page
# Pages of the map a random row touches, as counted against the budget.  Measured on a
# 2x2 async run (the data file's Rss in /proc/<pid>/smaps): counting one page a row let
# the map reach 5x its budget; a write copies the leaf and its parents (copy on write) and
# takes pages from the free list, a read walks branch pages to the leaf.
READ_PAGES, WRITE_PAGES = 2, 6
# Pages of the map a row of a transaction may bring in (the kernel's fault-around: about
# 24 for one row alone, 11 a row in a batch of 1,000; docs/disk-tier.md, Sizing).  A
# transaction holds at most a quarter of the budget's worth of rows, so the map passes
# its budget by at most that before it is dropped: with 6 pages a row, a read of 427 rows
# at a 42 MB budget touched ~40 MB more, and the map peaked at twice its budget.
TXN_PAGES = 16
RESERVE_MIN = 16 << 20      # the least the data file is allocated ahead of its use
PREFIX = "mpips-tier-"      # the store folders' names: PREFIX + tag + "-" + random
LOCK = "owner.lock"         # held by the open store (flock), released when its process ends
SIGN = np.uint64(1 << 63)
KEY = np.dtype(">u8")
FILTER_BITS = 12            # IdFilter's bits an id (blocked, 7 probes: ~0.5% false maybes)
FILTER_FIRST = 1 << 16      # ids IdFilter's first part holds, by default


def mapped_bytes():
    """Bytes of shared (file-backed) pages resident in this process: /proc/self/statm's
    third field."""
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[2]) * PAGE


MEASURE = os.path.exists("/proc/self/statm")
MADV_DONTNEED = 4


def _map_address(path):
    """Start address of this process's mapping of the file ``path`` (/proc/self/maps), or
    0 if there is none."""
    path = os.path.realpath(path)
    with open("/proc/self/maps") as fh:
        for line in fh:
            if line.rstrip("\n").endswith(" " + path):
                return int(line.split("-", 1)[0], 16)
    return 0


@lru_cache(maxsize=1)
def _libc():
    """libc with ``madvise`` typed (ctypes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def row_dtype(template):
    """Packed record dtype of every field of ``template`` (an ``export_rows`` dict) but keys."""
    return np.dtype([(f, a.dtype, a.shape[1:]) for f, a in template.items() if f != "keys"])


def encode_keys(keys):
    """int64 ids -> list of 8-byte keys whose byte order is the ids' order."""
    k = (np.ascontiguousarray(keys, np.int64).view(np.uint64) ^ SIGN).astype(KEY)
    return k.view("V8").tolist()


def sweep(parent):
    """Remove the store folders under ``parent`` that no process holds (left by a killed
    run); return their paths.  A folder without its lock file (being made, or made by an
    older mpips) is left alone."""
    gone = []
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if not name.startswith(PREFIX):
            continue
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue                        # held: a live store
        finally:
            os.close(fd)                    # (closing releases a lock just taken)
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


def _locked_folder(parent, prefix):
    """A fresh folder ``parent/prefix<random>`` with its ``LOCK`` held; (path, lock fd).

    The folder is made under a hidden name (``.`` + the name, which ``sweep`` passes by),
    its lock taken, and only then renamed to its name: a store folder is never visible to
    another process's sweep before its lock is held.  (Made and locked in place, two
    servers starting on one node raced: one's sweep took the other's lock in the moment
    before its owner did, the owner's flock failed with EAGAIN, and the sweep removed the
    live folder.)  A process killed between the two steps leaves an empty hidden folder."""
    hidden = tempfile.mkdtemp(prefix="." + prefix, dir=parent)
    lock = os.open(os.path.join(hidden, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # (nobody else knows the folder)
        path = os.path.join(parent, os.path.basename(hidden)[1:])
        os.rename(hidden, path)                 # (a folder of that name: ENOTEMPTY/EEXIST)
    except OSError:
        os.close(lock)
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    return path, lock


class IdFilter:
    """Which ids may have a row in the store: a blocked Bloom filter
    (``mpips.kernels.hashmap.bloom_add``) that grows by parts, each holding twice the ids
    of the one before (the first ``first`` ids), so it is never rebuilt from the store.
    ``maybe`` is False only for an id never added: such an id is not looked up in LMDB.
    Most of a step's misses are ids seen for the first time, which have no row on disk,
    and LMDB's search for one faults the B+tree's pages into the map as a search that
    finds its row does (docs/disk-tier.md, "The filter").  Deleted ids keep their bits (a
    false maybe costs a lookup, nothing else).  A part that would take the filter past
    ``limit`` bytes is not made: the filter is dropped and every id is a maybe (``full``)."""

    def __init__(self, first=FILTER_FIRST, limit=1 << 62):
        self.first, self.limit = max(int(first), 64), int(limit)
        self.parts, self.room, self.ids, self.full = [], 0, 0, False

    def maybe(self, keys):
        if self.full:
            return np.ones(len(keys), np.bool_)
        out = np.zeros(len(keys), np.bool_)
        for bits in self.parts:
            bloom_query(bits, keys, out)
        return out

    def add(self, keys):
        """Add ``keys`` (int64, distinct); those that are maybe already take no room."""
        if self.full:
            return
        keys = np.ascontiguousarray(keys, np.int64)
        new = keys[~self.maybe(keys)]
        while len(new):
            if not self.room:
                room = 2 * self.parts[-1].size * 64 // FILTER_BITS if self.parts else self.first
                words = -(-room * FILTER_BITS // 512) * 8
                if self.nbytes + 8 * words > self.limit:
                    self.parts, self.room, self.full = [], 0, True
                    return
                self.parts.append(np.zeros(words, np.uint64))
                self.room = room
            take, new = new[:self.room], new[self.room:]
            bloom_add(self.parts[-1], take)
            self.room -= len(take)
            self.ids += len(take)

    @property
    def nbytes(self):
        return sum(p.nbytes for p in self.parts)


def decode_keys(raw):
    """Concatenated 8-byte keys -> int64 ids."""
    return (np.frombuffer(raw, KEY).astype(np.uint64) ^ SIGN).view(np.int64)


class RowStore:
    """Table rows on disk (LMDB) in a fresh folder under ``parent``; see the module doc.

    template: an ``export_rows`` dict of the table (its fields and their shapes);
    tag: folder name prefix (e.g. the rank); map_budget: bytes the store may hold in
    memory (what it adds to the RSS, about): the pages of LMDB's map this process touched
    (dropped when the budget is used up) and the filter of ids (``IdFilter``, at most half
    of it); first_ids: the ids the filter's first part holds.
    """

    writemap = False        # LMDB writes by pwrite from its own pages (True: through its map)

    def __init__(self, parent, template, tag="table", map_budget=None, first_ids=FILTER_FIRST):
        self.fields = list(template)
        self.dtype = row_dtype(template)
        self._template = {f: a[:0].copy() for f, a in template.items()}
        parent = check_dir(parent)
        self.swept = sweep(parent)          # folders of killed runs (reported by the caller)
        self.path, self._lock = _locked_folder(parent, f"{PREFIX}{tag}-")
        self.map_budget = MAP_BUDGET if map_budget is None else int(map_budget)
        self.txn_rows = max(self.map_budget // (4 * TXN_PAGES * PAGE), 1)
        self.env, self._touched, self._allocated, self.reopens = None, 0, 0, 0
        self._open()
        self._fd = os.open(os.path.join(self.path, "data.mdb"), os.O_RDWR)
        self.count = 0                      # rows stored
        self.ids = IdFilter(first_ids, self.map_budget // 2)   # ids that may be stored
        self.looked_up = 0                  # ids looked up in LMDB (the filter's maybes)

    def _open(self):
        import lmdb             # the disk extra: imported only when a tier is made
        self._addr = None       # the map's address (``_unmap``), found at the first drop
        self.env = lmdb.open(self.path, map_size=MAP_SIZE, subdir=True, sync=False,
                             metasync=False, writemap=self.writemap, readahead=False, lock=False,
                             max_dbs=0, meminit=False)
        self._base = mapped_bytes() if MEASURE else 0

    def _touch(self, nbytes):
        """After a transaction: past ``map_budget`` bytes of the map resident in this
        process (and the filter's bytes), drop them (``_unmap``; closing and reopening the
        environment where that cannot be done): they stay in the page cache, not in this
        process's RSS.  The map's resident bytes are measured (``mapped_bytes``: file pages
        resident, less those after the last opening) where /proc is; else ``nbytes`` (an
        estimate of the pages touched) are counted."""
        if MEASURE:
            over = mapped_bytes() - self._base + self.ids.nbytes > self.map_budget
        else:
            self._touched += nbytes
            over = self._touched + self.ids.nbytes > self.map_budget
        if over:
            if not self._unmap():
                self.env.close()
                self._open()
            self._touched = 0
            self.reopens += 1

    def _unmap(self):
        """Drop the map's resident pages from this process (``madvise(MADV_DONTNEED)``
        over the data file's pages: LMDB's pages are in the file, written by pwrite, so
        nothing is lost; the next touch maps them from the page cache again).  About 13%
        less CPU than closing and reopening LMDB (docs/disk-tier.md).  False where the
        map is not found in /proc/self/maps (then the caller reopens)."""
        if self._addr is None:
            self._addr = _map_address(os.path.join(self.path, "data.mdb")) if MEASURE else 0
        if not self._addr:
            return False
        n = (self.env.info()["last_pgno"] + 1) * PAGE
        if _libc().madvise(self._addr, n, MADV_DONTNEED):
            return False
        self._base = mapped_bytes()
        return True

    def _reserve(self, n_rows):
        """Allocate the file's blocks ahead of a write of ``n_rows`` rows, so that a full
        disk is found before a transaction, with the line that says what to do (LMDB's
        own ENOSPC would come from its commit; through a map, with ``writemap``, it would
        be a SIGBUS)."""
        used = (self.env.info()["last_pgno"] + 1) * PAGE
        need = used + 4 * n_rows * (self.dtype.itemsize + 24) + RESERVE_MIN
        if need <= self._allocated:
            return
        target = need + max(need // 4, RESERVE_MIN)
        try:
            os.posix_fallocate(self._fd, 0, target)
        except OSError as e:
            raise OSError(e.errno, f"{self.path}: the disk tier could not grow to "
                          f"{target / 2**20:.0f} MiB ({os.strerror(e.errno)}): free space "
                          "under --table-dir or raise --table-memory, then resume from the "
                          "last checkpoint") from None
        self._allocated = target

    # ----------------------------------------------------------------- codecs
    def _encode(self, rows, idx=None):
        """(keys, records) as lists of bytes of the rows ``idx`` of ``rows`` (default: all,
        in id order: a B+tree takes sorted inserts faster, the pages they touch are
        neighbours)."""
        if idx is None:
            idx = self._order(rows["keys"])
        keys = np.ascontiguousarray(rows["keys"], np.int64)[idx]
        rec = np.empty(len(keys), self.dtype)
        for f in self.dtype.names:
            rec[f] = rows[f][idx] if np.ndim(rows[f]) else rows[f]
        return encode_keys(keys), rec.view(f"V{self.dtype.itemsize}").tolist()

    @staticmethod
    def _order(keys):
        """Indices of ``keys`` in id order."""
        keys = np.asarray(keys)
        if len(keys) > 1 and (keys[1:] < keys[:-1]).any():
            return np.argsort(keys)
        return np.arange(len(keys))

    def _decode(self, keys, raw_vals):
        """Rows (an ``export_rows`` dict) of the ids ``keys`` and their records joined."""
        n = len(keys)
        if len(raw_vals) != n * self.dtype.itemsize:
            raise OSError(errno.EIO, f"{self.path}: a stored row is not "
                          f"{self.dtype.itemsize} bytes (the tier's folder was changed)")
        rec = np.frombuffer(raw_vals, self.dtype, count=n)
        out = {"keys": keys}
        for f in self.dtype.names:
            out[f] = rec[f].copy()
        return out

    def empty(self):
        return {f: a.copy() for f, a in self._template.items()}

    # ----------------------------------------------------------------- batches
    def _pieces(self, n):
        """Slices of at most ``txn_rows`` of n rows: one transaction each, so that the map's
        pages one transaction touches stay within the map's budget."""
        return [slice(lo, lo + self.txn_rows) for lo in range(0, n, self.txn_rows)]

    def _lookup(self, keys, values):
        """Look up in LMDB the ids of ``keys`` the filter may have stored, in multi-gets of
        at most ``txn_rows``: (found bool (n,), the found ids (int64, in ``keys``' order),
        their records joined, or b"" unless ``values``)."""
        keys = np.ascontiguousarray(keys, np.int64)
        found = self.ids.maybe(keys) if len(keys) and self.count else \
            np.zeros(len(keys), np.bool_)
        if not found.any():
            return found, keys[:0], b""
        sub = keys[found]
        self.looked_up += len(sub)
        raw, got_keys, got_vals = encode_keys(sub), [], []
        for sl in self._pieces(len(sub)):
            with self._errors("reading"), self.env.begin(buffers=not values) as txn:
                part = txn.cursor().getmulti(raw[sl])     # (buffers, for the keys alone:
                got_keys.append(b"".join(map(itemgetter(0), part)))    # they live in the
                if values:                                             # transaction; bytes
                    got_vals.append(b"".join(map(itemgetter(1), part)))  # join faster)
            self._touch(len(part) * READ_PAGES * PAGE)
        ids = decode_keys(b"".join(got_keys))
        hit = np.empty(len(sub), np.bool_)
        if subsequence_mask(sub, ids, hit) != len(ids):
            raise OSError(errno.EIO, f"{self.path}: the multi-get returned other rows than "
                          "those asked for")
        found[found] = hit
        return found, ids, b"".join(got_vals)

    def get(self, keys):
        """(found bool (n,), rows of the found keys in ``keys``' order): multi-gets of at
        most ``txn_rows`` ids."""
        found, ids, vals = self._lookup(keys, True)
        return found, (self._decode(ids, vals) if len(ids) else self.empty())

    def contains(self, keys):
        """Which ``keys`` are stored (bool (n,)); the rows are not decoded."""
        return self._lookup(keys, False)[0]

    def write(self, put=None, delete=None, discard=None):
        """Store rows ``put`` (new or replacing; a field may be a scalar for all rows),
        delete the ids ``delete`` (which must be stored) and the ids ``discard`` that are;
        in transactions of at most ``txn_rows`` rows."""
        n_put = 0 if put is None else len(put["keys"])
        n_del = (0 if delete is None else len(delete)) + (0 if discard is None else
                                                          len(discard))
        self._reserve(n_put + n_del)
        gone = 0
        for ids, strict in ((delete, True), (discard, False)):
            if ids is None or not len(ids):
                continue
            raw = encode_keys(ids)
            for sl in self._pieces(len(raw)):
                with self._errors("writing"), self.env.begin(write=True) as txn:
                    n = sum(map(txn.delete, raw[sl]))
                gone += n if strict else 0
                self._touch(len(raw[sl]) * WRITE_PAGES * PAGE)
            if strict and gone != len(ids):
                raise OSError(errno.EIO, f"{self.path}: {len(ids) - gone} rows to move "
                              "out were not stored (the tier lost rows)")
        if n_put:
            self.ids.add(put["keys"])           # (before: an id stored is always maybe)
            order = self._order(put["keys"])
            for sl in self._pieces(n_put):      # (encoded a piece at a time: a write-back
                k, v = self._encode(put, order[sl])     # of 92k rows made 33 MB of bytes)
                with self._errors("writing"), self.env.begin(write=True) as txn:
                    txn.cursor().putmulti(zip(k, v), overwrite=True)
                self._touch((sl.stop - sl.start) * WRITE_PAGES * PAGE)
        self.count = self.env.stat()["entries"]

    @contextmanager
    def _errors(self, doing):
        """An LMDB error as one OSError line naming the folder."""
        import lmdb
        try:
            yield
        except lmdb.Error as e:
            raise OSError(errno.EIO, f"{self.path}: the disk tier failed {doing} rows "
                          f"({type(e).__name__}: {e}); resume from the last "
                          "checkpoint") from None

    def scan(self, chunk):
        """Every stored row, in id order, at most ``chunk`` at a time; ``write`` may be
        called between chunks (rows after the chunk yielded are read after it)."""
        start = b""
        while True:
            with self._errors("reading"), self.env.begin(buffers=False) as txn:
                cur = txn.cursor()
                if not cur.set_range(start):
                    return
                got = list(islice(cur.iternext(), chunk + 1))
            if start and got[0][0] == start:
                got = got[1:]
            else:
                got = got[:chunk]
            if not got:
                return
            start = got[-1][0]
            self._touch(len(got) * (self.dtype.itemsize + 16))
            yield self._decode(decode_keys(b"".join(map(itemgetter(0), got))),
                               b"".join(map(itemgetter(1), got)))

    @property
    def nbytes(self):
        """Bytes the store takes on disk (blocks allocated)."""
        return sum(os.stat(os.path.join(self.path, f)).st_blocks * 512
                   for f in os.listdir(self.path))

    def close(self):
        """Close and remove the folder (live state only)."""
        if self.env is not None:
            self.env.close()
            os.close(self._fd)
            self.env = None
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)            # (after the folder is gone: never swept live)
            self._lock = None
