"""The disk tier's row store: whole table rows in LMDB, as raw bytes of a fixed layout.

A row is stored under its id (8 bytes, big-endian, sign bit flipped, so the byte order is
the ids' signed order) as one record of every field but the key (``row_dtype``: the
table's fields in the table's order, packed, native byte order): embedding, optimizer
state, admission counters and last-seen.  Nothing is pickled; a record that is not
``row_dtype.itemsize`` bytes is an error.

Every operation takes or returns a batch, as the table's fields in a dict of arrays
(``export_rows``' layout): ``get`` (one multi-get), ``write`` (rows to put and ids to
delete, one write transaction) and ``scan`` (every row, in id order, in chunks).  The rows are converted to and from bytes by numpy
(``view`` / ``frombuffer``); py-lmdb iterates the lists in C, never a Python loop a row.

The store is live state only.  Its folder is made fresh by ``tempfile.mkdtemp`` inside
the directory given (never an existing one: a folder left by another run is never read)
and removed by ``close``.  LMDB was chosen over RocksDB (rocksdict) by
``bench/bench_engine.py`` on this 2-core machine (docs/disk-tier.md): its multi-get of a
step's misses is about 4x faster, and a B+tree has no background compaction to compete
with training for the cores (LMDB runs no thread of its own).
"""
import errno
import os
import shutil
import tempfile
from itertools import islice
from operator import itemgetter

import numpy as np

from mpips.tiering import check_dir

MAP_SIZE = 1 << 40          # LMDB's address space reservation (a sparse file; not memory)
SIGN = np.uint64(1 << 63)
KEY = np.dtype(">u8")


def row_dtype(template):
    """Packed record dtype of every field of ``template`` (an ``export_rows`` dict) but keys."""
    return np.dtype([(f, a.dtype, a.shape[1:]) for f, a in template.items() if f != "keys"])


def encode_keys(keys):
    """int64 ids -> list of 8-byte keys whose byte order is the ids' order."""
    k = (np.ascontiguousarray(keys, np.int64).view(np.uint64) ^ SIGN).astype(KEY)
    return k.view("V8").tolist()


def decode_keys(raw):
    """Concatenated 8-byte keys -> int64 ids."""
    return (np.frombuffer(raw, KEY).astype(np.uint64) ^ SIGN).view(np.int64)


class RowStore:
    """Table rows on disk (LMDB) in a fresh folder under ``parent``; see the module doc.

    template: an ``export_rows`` dict of the table (its fields and their shapes);
    tag: folder name prefix (e.g. the rank).
    """

    def __init__(self, parent, template, tag="table"):
        import lmdb             # the disk extra: imported only when a tier is made
        self.fields = list(template)
        self.dtype = row_dtype(template)
        self._template = {f: a[:0].copy() for f, a in template.items()}
        self.path = tempfile.mkdtemp(prefix=f"mpips-tier-{tag}-", dir=check_dir(parent))
        self.env = lmdb.open(self.path, map_size=MAP_SIZE, subdir=True, sync=False,
                             metasync=False, writemap=True, readahead=False, lock=False,
                             max_dbs=0, meminit=False)
        self.count = 0                      # rows stored

    # ----------------------------------------------------------------- codecs
    def _encode(self, rows):
        n = len(rows["keys"])
        rec = np.empty(n, self.dtype)
        for f in self.dtype.names:
            rec[f] = rows[f]
        return encode_keys(rows["keys"]), rec.view(f"V{self.dtype.itemsize}").tolist()

    def _decode(self, raw_keys, raw_vals, n):
        if len(raw_vals) != n * self.dtype.itemsize:
            raise OSError(errno.EIO, f"{self.path}: a stored row is not "
                          f"{self.dtype.itemsize} bytes (the tier's folder was changed)")
        rec = np.frombuffer(raw_vals, self.dtype, count=n)
        out = {"keys": decode_keys(raw_keys)}
        for f in self.dtype.names:
            out[f] = rec[f].copy()
        return out

    def empty(self):
        return {f: a.copy() for f, a in self._template.items()}

    # ----------------------------------------------------------------- batches
    def get(self, keys):
        """(found bool (n,), rows of the found keys in ``keys``' order) in one multi-get."""
        keys = np.ascontiguousarray(keys, np.int64)
        if not len(keys) or not self.count:
            return np.zeros(len(keys), np.bool_), self.empty()
        with self.env.begin(buffers=False) as txn:
            got = txn.cursor().getmulti(encode_keys(keys))
        rows = self._decode(b"".join(map(itemgetter(0), got)),
                            b"".join(map(itemgetter(1), got)), len(got))
        found = np.isin(keys, rows["keys"])
        if not np.array_equal(keys[found], rows["keys"]):
            raise OSError(errno.EIO, f"{self.path}: the multi-get returned other rows than "
                          "those asked for")
        return found, rows

    def write(self, put=None, delete=None):
        """One write transaction: store rows ``put`` (new or replacing) and delete the
        ids ``delete`` (which must be stored)."""
        with self.env.begin(write=True) as txn:
            if delete is not None and len(delete):
                gone = sum(map(txn.delete, encode_keys(delete)))
                if gone != len(delete):
                    raise OSError(errno.EIO, f"{self.path}: {len(delete) - gone} rows to move "
                                  "out were not stored (the tier lost rows)")
            if put is not None and len(put["keys"]):
                k, v = self._encode(put)
                txn.cursor().putmulti(zip(k, v), overwrite=True)
        self.count = self.env.stat()["entries"]

    def scan(self, chunk):
        """Every stored row, in id order, at most ``chunk`` at a time; ``write`` may be
        called between chunks (rows after the chunk yielded are read after it)."""
        start = b""
        while True:
            with self.env.begin(buffers=False) as txn:
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
            yield self._decode(b"".join(map(itemgetter(0), got)),
                               b"".join(map(itemgetter(1), got)), len(got))

    @property
    def nbytes(self):
        """Bytes the store takes on disk (blocks allocated)."""
        return sum(os.stat(os.path.join(self.path, f)).st_blocks * 512
                   for f in os.listdir(self.path))

    def close(self):
        """Close and remove the folder (live state only)."""
        if self.env is not None:
            self.env.close()
            self.env = None
        shutil.rmtree(self.path, ignore_errors=True)
