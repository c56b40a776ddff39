"""Binary data parts: memory-mappable .npy parts written by ``data_prep.criteo``.

Layout of one split directory (e.g. ``OUT/train``)::

    manifest.json            format, version, rows per part, columns, stats, hash_bucket
    part-00000/dense.npy     (n, 13) int32  raw integer values, DENSE_MISSING = empty field
    part-00000/sparse.npy    (n, 26) int64  feature ids (the TSV parser's hash)
    part-00000/label.npy     (n,)    int8   0/1 (absent when the split has no labels)
    part-00001/...

Dense values are stored raw and normalised when read, ``(x - cont_min) / cont_diff`` in
float64 then float32 (empty -> 0), exactly as the TSV parser does, so a part gives the
same ``Batch`` values as the text it came from, and any statistics can be applied later.
The prep root ``OUT`` holds ``manifest.json`` (kind "root": inputs, split rule, counts,
bad lines), ``stats.json`` and the split directories.  The split manifest is written
last (atomically), so a half-written split is never taken for a whole one.
"""
import json
import os

import numpy as np

from mpips.data.criteo import N_DENSE, N_SPARSE, make_norm

FORMAT = "mpips-shards"   # on-disk name, kept: prepared sets written before still read
VERSION = 1
VERSION_BAGS = 2  # any schema, bags of ids (mpips.data.bagparts)
MANIFEST = "manifest.json"
STATS = "stats.json"
DENSE_MISSING = int(np.iinfo(np.int32).min)  # stored for an empty integer field
PIECE_ROWS = 1 << 16  # rows read (and normalised) from a part at a time
NPY_HEADER_BYTES = 128  # fixed .npy header size, so the row count can be patched in place
COLUMNS = {  # name -> (file, dtype, shape of one row)
    "dense": ("dense.npy", "int32", [N_DENSE]),
    "sparse": ("sparse.npy", "int64", [N_SPARSE]),
    "label": ("label.npy", "int8", []),
}


class PartError(ValueError):
    """A binary data directory or manifest that cannot be read as written by data_prep."""


# ---------------------------------------------------------------- writing
class NpyAppender:
    """A .npy file grown by appending rows; the header's row count is fixed on close."""

    def __init__(self, path: str, dtype, row_shape):
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        self._f = open(path, "wb")
        self._f.write(self._header(0))

    def _header(self, n: int) -> bytes:
        d = {"descr": self.dtype.str, "fortran_order": False, "shape": (n,) + self.row_shape}
        text = repr(d).encode("latin1")
        pad = NPY_HEADER_BYTES - 10 - len(text) - 1
        return b"\x93NUMPY\x01\x00" + (NPY_HEADER_BYTES - 10).to_bytes(2, "little") + \
            text + b" " * pad + b"\n"

    def append(self, arr: np.ndarray) -> None:
        if arr.dtype != self.dtype or arr.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path}: appending {arr.dtype}{arr.shape}, "
                             f"expected {self.dtype} rows of shape {self.row_shape}")
        self._f.write(np.ascontiguousarray(arr).data)
        self.rows += arr.shape[0]

    def close(self) -> int:
        if self._f is not None:
            self._f.seek(0)
            self._f.write(self._header(self.rows))
            self._f.close()
            self._f = None
        return self.rows


class PartWriter:
    """Appends (dense int32 raw, sparse int64, label int8) rows to one part directory."""

    def __init__(self, path: str, has_label: bool):
        os.makedirs(path, exist_ok=False)
        self.path = path
        names = ["dense", "sparse"] + (["label"] if has_label else [])
        self.cols = {n: NpyAppender(os.path.join(path, COLUMNS[n][0]), COLUMNS[n][1],
                                    COLUMNS[n][2]) for n in names}

    def append(self, dense: np.ndarray, sparse: np.ndarray, label=None) -> None:
        self.cols["dense"].append(dense)  # (m, 13) int32
        self.cols["sparse"].append(sparse)  # (m, 26) int64
        if "label" in self.cols:
            self.cols["label"].append(label)  # (m,) int8

    def close(self) -> int:
        return [c.close() for c in self.cols.values()][0]


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)


def write_split_manifest(split_dir: str, parts_rows: list, *, has_label: bool,
                         hash_bucket: int, cont_min, cont_diff, extra=None) -> dict:
    """Write ``split_dir/manifest.json`` for parts ``part-00000..`` with these row counts."""
    cols = {n: {"file": f, "dtype": d, "shape": s} for n, (f, d, s) in COLUMNS.items()
            if has_label or n != "label"}
    cols["dense"].update(encoding="raw integer value", missing=DENSE_MISSING)
    man = {"format": FORMAT, "version": VERSION, "kind": "split",
           "rows": int(sum(parts_rows)),
           "parts": [{"name": part_name(i), "rows": int(r)} for i, r in enumerate(parts_rows)],
           "columns": cols, "has_label": bool(has_label), "hash_bucket": int(hash_bucket),
           "stats": {"cont_min": [float(x) for x in cont_min],
                     "cont_diff": [float(x) for x in cont_diff]}}
    man.update(extra or {})
    write_json_atomic(os.path.join(split_dir, MANIFEST), man)
    return man


def part_name(i: int) -> str:
    return f"part-{i:05d}"


# ---------------------------------------------------------------- manifests
def _read_json(path: str):
    try:
        with open(path) as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise PartError(f"{path}: not valid JSON ({exc}); re-run data_prep.criteo") from None


def _manifest_kind(directory: str):
    """'split', 'root' or None (no mpips manifest) for a directory."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    man = _read_json(path)
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        return None
    return man.get("kind")


def is_split_dir(path: str) -> bool:
    return os.path.isdir(path) and _manifest_kind(path) == "split"


def is_prep_root(path: str) -> bool:
    return os.path.isdir(path) and _manifest_kind(path) == "root"


def is_part_dir(path: str) -> bool:
    """A part directory: its parent is a split directory."""
    path = os.path.normpath(path)
    return os.path.isdir(path) and is_split_dir(os.path.dirname(path))


def read_manifest(split_dir: str) -> dict:
    """The validated split manifest of ``split_dir``; PartError says what is wrong."""
    path = os.path.join(split_dir, MANIFEST)
    if not os.path.isfile(path):
        raise PartError(f"{split_dir}: no {MANIFEST} (not a binary data directory, or its "
                         f"preparation did not finish; re-run data_prep.criteo)")
    man = _read_json(path)
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise PartError(f"{path}: not an {FORMAT} manifest")
    if man.get("version") not in (VERSION, VERSION_BAGS):
        raise PartError(f"{path}: binary data format version {man.get('version')!r}; this mpips "
                         f"reads versions {VERSION} and {VERSION_BAGS} (re-run data_prep)")
    for key in ("parts", "columns", "hash_bucket", "stats", "has_label"):
        if key not in man:
            raise PartError(f"{path}: manifest lacks {key!r}; re-run data_prep.criteo")
    return man


def list_parts(split_dir: str) -> list[str]:
    """Part directories of a split, in manifest order; missing ones are an error."""
    man = read_manifest(split_dir)
    parts = [os.path.join(split_dir, p["name"]) for p in man["parts"]]
    missing = [p for p in parts if not os.path.isdir(p)]
    if missing:
        raise PartError(f"{split_dir}: {len(missing)} part(s) listed in {MANIFEST} are "
                         f"missing, e.g. {missing[0]} (copy them back or re-run data_prep)")
    return parts


def part_rows(part: str) -> int:
    """Rows of one part directory, from its split's manifest."""
    split_dir, name = os.path.split(os.path.normpath(part))
    entry = next((p for p in read_manifest(split_dir)["parts"] if p["name"] == name), None)
    if entry is None:
        raise PartError(f"{part}: not listed in {os.path.join(split_dir, MANIFEST)}")
    return int(entry["rows"])


def manifest_norm(man: dict) -> np.ndarray:
    st = man["stats"]
    return make_norm(st["cont_min"], st["cont_diff"])


# ---------------------------------------------------------------- reading
def open_part(part: str):
    """(manifest, {column: memmap}) of one part directory, checked against the manifest."""
    part = os.path.normpath(part)
    split_dir, name = os.path.split(part)
    man = read_manifest(split_dir)
    entry = next((p for p in man["parts"] if p["name"] == name), None)
    if entry is None:
        raise PartError(f"{part}: not listed in {os.path.join(split_dir, MANIFEST)}")
    arrays = {}
    for col, spec in man["columns"].items():
        path = os.path.join(part, spec["file"])
        if not os.path.isfile(path):
            raise PartError(f"{path}: missing column file of part {part}")
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise PartError(f"{path}: unreadable .npy ({exc})") from None
        want = (int(entry["rows"]),) + tuple(spec["shape"])
        if arr.dtype != np.dtype(spec["dtype"]) or arr.shape != want:
            raise PartError(f"{path}: {arr.dtype} {arr.shape}, manifest says "
                             f"{spec['dtype']} {want} (truncated or foreign file? "
                             f"re-run data_prep.criteo)")
        arrays[col] = arr
    return man, arrays


def normalise_raw(raw: np.ndarray, norm: np.ndarray) -> np.ndarray:
    """(m, 13) int32 raw -> (m, 13) float32 ``(x - min) / diff``, empty -> 0 (as the parser)."""
    x = raw.astype(np.float64)  # (m, 13)
    np.subtract(x, norm[0], out=x)
    np.divide(x, norm[1], out=x)
    x[raw == DENSE_MISSING] = 0.0
    return x.astype(np.float32)


def iter_part(part: str, norm=None, hash_bucket=None, piece_rows: int = PIECE_ROWS):
    """Yield ``(dense f32, sparse i64, label f32)`` pieces of one part (fresh arrays).

    ``norm`` (2, 13) defaults to the manifest's statistics.  ``hash_bucket``, if given,
    must equal the one the parts were hashed with.  Label is 0 when the split has none.
    """
    man, arrays = open_part(part)
    if hash_bucket is not None and int(hash_bucket) != int(man["hash_bucket"]):
        raise PartError(f"{part}: parts were hashed with hash_bucket={man['hash_bucket']}, "
                         f"the reader asked for {hash_bucket} (pass --hash-bucket "
                         f"{man['hash_bucket']}, or re-run data_prep with the bucket you want)")
    norm = manifest_norm(man) if norm is None else norm
    dense, sparse, label = arrays["dense"], arrays["sparse"], arrays.get("label")
    n = dense.shape[0]
    for a in range(0, n, piece_rows):
        b = min(n, a + piece_rows)
        lab = np.zeros(b - a, np.float32) if label is None else label[a:b].astype(np.float32)
        yield normalise_raw(dense[a:b], norm), np.array(sparse[a:b]), lab


# ---------------------------------------------------------------- statistics
def load_stats(path: str, n_dense: int = N_DENSE):
    """(cont_min, cont_diff) float64 (n_dense,) from a stats.json, a prep root or a split dir."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, STATS)):
            path = os.path.join(path, STATS)
        else:
            norm = manifest_norm(read_manifest(path))
            return norm[0].copy(), norm[1].copy()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"statistics file {path!r} not found (data_prep.criteo "
                                f"writes OUT/{STATS})")
    st = _read_json(path)
    if not isinstance(st, dict) or "cont_min" not in st or "cont_diff" not in st:
        raise PartError(f"{path}: needs 'cont_min' and 'cont_diff' lists of {n_dense} numbers")
    try:
        norm = make_norm(st["cont_min"], st["cont_diff"], n_dense)
    except (ValueError, TypeError) as exc:
        raise PartError(f"{path}: {exc}") from None
    return norm[0].copy(), norm[1].copy()
