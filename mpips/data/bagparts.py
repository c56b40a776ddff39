"""Binary data parts of any schema: bags of ids (CSR) and finished dense values, memory-mapped.

A split directory written by ``write_split`` (``python -m data_prep.parts``)::

    manifest.json            format "mpips-shards", version 2, layout "bags", the schema
                             (Schema.to_dict), rows and ids per part, has_label, hash_bucket
    part-00000/dense.npy     (n, D)     float32  dense values as the text reader gives them
    part-00000/ids.npy       (nnz,)     int64    the ids of all bags, example-major
    part-00000/offsets.npy   (n*S + 1,) int64    bag (i, s) = ids[offsets[i*S+s]:offsets[i*S+s+1]]
    part-00000/label.npy     (n,)       int8     0/1 (absent without labels); (n, T) with
                                                 T > 1 labels (one column a task)

Version 1 directories (``mpips.data.binary``, Criteo's raw layout written by
``data_prep.criteo``) still read as before; a version-1 reader refuses version 2 by its
version check.  A part is read in pieces of ``binary.PIECE_ROWS`` rows; a one-hot schema's
pieces come back as ``(n, S)`` ids, others as CSR with offsets starting at 0.
"""
import os

import numpy as np

from mpips.data import bags, binary
from mpips.schema import Schema

VERSION = 2
LAYOUT = "bags"
FILES = {"dense": "dense.npy", "ids": "ids.npy", "offsets": "offsets.npy",
         "label": "label.npy"}


def is_bag_manifest(man: dict) -> bool:
    return man.get("version") == VERSION and man.get("layout") == LAYOUT


class _Part:
    """Appends pieces (dense, sparse, label, offsets) to one part directory."""

    def __init__(self, path: str, D: int, has_label: bool, T: int = 1):
        os.makedirs(path, exist_ok=False)
        self.ap = {"dense": binary.NpyAppender(os.path.join(path, FILES["dense"]), "float32", [D]),
                   "ids": binary.NpyAppender(os.path.join(path, FILES["ids"]), "int64", []),
                   "offsets": binary.NpyAppender(os.path.join(path, FILES["offsets"]), "int64",
                                                 [])}
        if has_label:
            self.ap["label"] = binary.NpyAppender(os.path.join(path, FILES["label"]), "int8",
                                                  [T] if T > 1 else [])
        self.ap["offsets"].append(np.zeros(1, np.int64))
        self.rows = self.nnz = 0

    def add(self, dense, sparse, label, offsets):
        if offsets is None:  # one-hot (n, S): every bag holds one id
            S = sparse.shape[1]
            offsets = np.arange(sparse.shape[0] * S + 1, dtype=np.int64)
            sparse = sparse.reshape(-1)
        self.ap["dense"].append(np.ascontiguousarray(dense, np.float32))
        self.ap["ids"].append(np.ascontiguousarray(sparse, np.int64))
        self.ap["offsets"].append(offsets[1:] + self.nnz)
        if "label" in self.ap:
            self.ap["label"].append(label.astype(np.int8))
        self.rows += label.shape[0]
        self.nnz += int(offsets[-1])

    def close(self):
        for a in self.ap.values():
            a.close()
        return {"rows": self.rows, "ids": self.nnz}


def write_split(split_dir: str, pieces, schema: Schema, *, rows_per_part: int,
                has_label: bool, hash_bucket: int) -> dict:
    """Write ``pieces`` (dense, sparse, label, offsets), in order, as parts of at most
    ``rows_per_part`` rows under ``split_dir`` (new or empty); the manifest last."""
    os.makedirs(split_dir, exist_ok=True)
    parts, cur = [], None
    for piece in pieces:
        while bags.n_rows(piece):
            if cur is None or cur.rows >= rows_per_part:
                if cur is not None:
                    parts.append(cur.close())
                cur = _Part(os.path.join(split_dir, binary.part_name(len(parts))),
                            schema.n_dense, has_label, schema.n_tasks)
            take = min(rows_per_part - cur.rows, bags.n_rows(piece))
            cur.add(*bags.slice_rows(piece, 0, take))
            piece = bags.slice_rows(piece, take, bags.n_rows(piece))
    if cur is not None:
        parts.append(cur.close())
    man = {"format": binary.FORMAT, "version": VERSION, "layout": LAYOUT, "kind": "split",
           "rows": sum(p["rows"] for p in parts),
           "parts": [{"name": binary.part_name(i), **p} for i, p in enumerate(parts)],
           "columns": {}, "stats": {}, "has_label": bool(has_label),
           "hash_bucket": int(hash_bucket), "schema": schema.to_dict()}
    binary.write_json_atomic(os.path.join(split_dir, binary.MANIFEST), man)
    return man


def _load(path: str, dtype, shape):
    if not os.path.isfile(path):
        raise binary.PartError(f"{path}: missing column file")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise binary.PartError(f"{path}: unreadable .npy ({exc})") from None
    if arr.dtype != np.dtype(dtype) or arr.shape != shape:
        raise binary.PartError(f"{path}: {arr.dtype} {arr.shape}, manifest says {dtype} "
                               f"{shape} (truncated or foreign file? re-write the parts)")
    return arr


def iter_part(part: str, man: dict, schema: Schema, hash_bucket=None,
              piece_rows: int = binary.PIECE_ROWS):
    """Yield (dense, sparse, label, offsets) pieces of a version-2 part read with ``schema``."""
    stored = Schema.from_dict(man["schema"])
    why = schema.diff(stored)
    if why:
        raise binary.PartError(f"{part}: parts were written with another schema ({why}); "
                               f"read them with the schema they were written with")
    if hash_bucket is not None and int(hash_bucket) != int(man["hash_bucket"]):
        raise binary.PartError(f"{part}: parts were hashed with hash_bucket="
                               f"{man['hash_bucket']}, the reader asked for {hash_bucket}")
    name = os.path.basename(os.path.normpath(part))
    entry = next(p for p in man["parts"] if p["name"] == name)
    n, nnz, S, D = int(entry["rows"]), int(entry["ids"]), schema.n_sparse, schema.n_dense
    dense = _load(os.path.join(part, FILES["dense"]), "float32", (n, D))
    ids = _load(os.path.join(part, FILES["ids"]), "int64", (nnz,))
    offsets = _load(os.path.join(part, FILES["offsets"]), "int64", (n * S + 1,))
    T = schema.n_tasks
    label = (_load(os.path.join(part, FILES["label"]), "int8", (n, T) if T > 1 else (n,))
             if man["has_label"] else None)
    no_label = (T,) if T > 1 else ()
    for a in range(0, n, piece_rows):
        b = min(n, a + piece_rows)
        off = np.array(offsets[a * S:b * S + 1])
        sp = np.array(ids[off[0]:off[-1]])
        lab = (np.zeros((b - a,) + no_label, np.float32) if label is None
               else label[a:b].astype(np.float32))
        if schema.one_hot:
            yield np.array(dense[a:b]), sp.reshape(b - a, S), lab, None
        else:
            yield np.array(dense[a:b]), sp, lab, off - off[0]
