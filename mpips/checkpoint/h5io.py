"""The HDF5 side of checkpoints, public for the modules that read or write such files
(``mpips.checkpoint.load``/``save``, ``mpips.serving.bundle``).

A file holds datasets written whole and contiguous (:func:`write_whole`: the dataset's
shape, dtype and CRC-32 go to the caller's manifest); :class:`Shard` opens one such file
against its manifest entry and a *schema* (dataset name -> (dtype, shape given the
entry), :func:`tables_schema` for the tables of a checkpoint) and checks sizes, shapes,
dtypes and, as they are read, CRCs; any problem is a CheckpointError naming the file.
Above the files: one checkpoint element's rows and dense values (:func:`element_rows`,
:func:`dense_values`, :func:`dense_slice`), and the id-set steps of folding a chain
(:func:`sorted_unique`, :func:`in_sorted`, :func:`fold_removed`).
"""
import os
import zlib
from contextlib import contextmanager

import h5py
import numpy as np

from mpips.checkpoint.manifest import MANIFEST, SKIPPED_FIELDS, CheckpointError
from mpips.tables.dense import DenseTable, dense_fields
from mpips.tables.optim import OptimizerConfig
from mpips.tables.ownership import owners
from mpips.tables.sparse import SparseTable

LOAD_ROWS = 1 << 16                    # rows per read + import_rows call (its np.unique
                                       # is ~4x faster per row on cache-sized pieces)
VERIFY_BYTES = 1 << 24                 # bytes per read while verifying a dataset's CRC
AVERAGE = "if saved"                   # tables_schema: a dataset read where a shard has it


# ------------------------------------------------------------------ files
def write_whole(group, name, arr, datasets):
    arr = np.ascontiguousarray(arr)
    group.create_dataset(name, data=arr)
    datasets[f"{group.name.strip('/')}/{name}"] = {
        "shape": list(arr.shape), "dtype": arr.dtype.name, "crc32": zlib.crc32(arr)}


@contextmanager
def h5_errors(path):
    """Turn h5py/HDF5 failures into a CheckpointError naming the file."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupted or unreadable HDF5 file "
                              f"({type(e).__name__}: {e})") from None


def rows_schema(table, group, rows_key, evicted_key):
    """Datasets of a table's row fields under group: name -> (dtype, shape of an entry)."""
    out = {}
    for f, arr in table.export_rows(np.empty(0, np.int64)).items():
        if f not in SKIPPED_FIELDS:
            out[f"{group}/{f}"] = (arr.dtype, lambda e, t=arr.shape[1:]: (e[rows_key],) + t)
    out[f"{group}/evicted"] = (np.dtype(np.int64), lambda e: (e[evicted_key],))
    return out


def tables_schema(sparse, dense, admission=None):
    """Expected datasets: name -> (dtype, shape given the shard's manifest entry).

    With ``admission`` (the AdmittedTable loaded into), the ``/admission/`` datasets too;
    shards saved without them (older checkpoints, runs without --entry) are read as
    holding no waiting counts.  A dense table with a moving average (``--dense-average``)
    reads ``/dense/average`` where a shard has it (older checkpoints and runs without one
    do not: the average starts at the values).
    """
    out = rows_schema(sparse, "sparse", "rows", "evicted")
    for name, per_el in dense_fields(dense):
        out[f"dense/{name}"] = (np.dtype(np.float32),
                                (lambda e: (e["dense_size"],)) if per_el else (lambda e: (1,)))
    if dense.average:
        out["dense/average"] += (AVERAGE,)
    if admission is not None:
        adm = rows_schema(admission.counts, "admission", "admission_rows", "admission_evicted")
        adm["admission/admitted"] = (np.dtype(np.int64), lambda e: (1,))
        out.update({k: v + (True,) for k, v in adm.items()})
    return out


def for_entry(schema, entry):
    """The part of the schema a shard entry has: optional (admission) datasets if saved."""
    has_adm = "admission_rows" in entry
    return {k: v[:2] for k, v in schema.items() if len(v) == 2
            or (has_adm if v[2] is True else k in entry["datasets"])}


class Shard:
    """One shard file, opened and checked against its manifest entry and the schema."""

    def __init__(self, ckpt_dir, entry, schema):
        self.path = os.path.join(ckpt_dir, entry["file"])
        self.entry = entry
        schema = for_entry(schema, entry)
        self.has_admission = "admission/keys" in schema
        if not os.path.exists(self.path):
            raise CheckpointError(f"{self.path}: shard file listed in {MANIFEST} is missing")
        size = os.path.getsize(self.path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{self.path}: file is {size} bytes, {MANIFEST} says "
                                  f"{entry['bytes']} (truncated or overwritten)")
        self._check_entry(schema, size)
        with h5_errors(self.path):
            self.file = h5py.File(self.path, "r", locking=False)
            try:
                for name in schema:
                    self._check_dataset(name)
            except BaseException:
                self.file.close()
                raise

    def _check_entry(self, schema, size):
        e = self.entry
        missing = sorted(set(schema) - set(e["datasets"]))
        if missing:
            raise CheckpointError(f"{self.path}: lacks datasets {missing} (saved with a "
                                  "different optimizer?)")
        total = 0
        for name, (dtype, shape_fn) in schema.items():
            d = e["datasets"][name]
            want = list(shape_fn(e))
            if np.dtype(d["dtype"]) != dtype or d["shape"] != want:
                raise CheckpointError(f"{self.path}: {name} is {d['dtype']} {d['shape']}; "
                                      f"expected {dtype.name} {want}")
            total += int(np.prod(want, dtype=np.float64)) * dtype.itemsize
        if total > size:
            raise CheckpointError(f"{self.path}: claims {e['rows']} rows, {e['evicted']} "
                                  f"evicted ids and {e['dense_size']} dense values "
                                  f"({total} bytes) but the file holds {size} bytes")

    def _check_dataset(self, name):
        if name not in self.file:
            raise CheckpointError(f"{self.path}: dataset {name} is missing")
        ds = self.file[name]
        d = self.entry["datasets"][name]
        if ds.dtype != np.dtype(d["dtype"]) or list(ds.shape) != d["shape"]:
            raise CheckpointError(f"{self.path}: dataset {name} is {ds.dtype} {list(ds.shape)}; "
                                  f"{MANIFEST} says {d['dtype']} {d['shape']}")
        nbytes = int(np.prod(ds.shape, dtype=np.float64)) * ds.dtype.itemsize
        if ds.chunks is not None or ds.compression is not None or (
                nbytes and ds.id.get_storage_size() != nbytes):
            raise CheckpointError(f"{self.path}: dataset {name} is not stored as a whole "
                                  f"contiguous array of {nbytes} bytes")

    def verify(self, name):
        """Check a dataset's CRC-32, reading it in pieces of about VERIFY_BYTES."""
        with h5_errors(self.path):
            ds = self.file[name]
            row = max(int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize, 1)
            step = max(VERIFY_BYTES // row, 1)
            crc = 0
            for lo in range(0, ds.shape[0] if ds.shape else 1, step):
                crc = zlib.crc32(np.ascontiguousarray(ds[lo:lo + step] if ds.shape else ds[()]),
                                 crc)
        self._verify(name, crc)

    def read(self, name):
        """A whole dataset, checksum verified."""
        with h5_errors(self.path):
            arr = self.file[name][()]
        self._verify(name, zlib.crc32(np.ascontiguousarray(arr)))
        return arr

    def _verify(self, name, crc):
        if crc != self.entry["datasets"][name]["crc32"]:
            raise CheckpointError(f"{self.path}: checksum mismatch in dataset {name} "
                                  "(the file is corrupted)")

    def import_into(self, sparse, fields, server_id, n_servers, removed, group="sparse"):
        """Import the rows of ``group`` server_id owns, except ids in ``removed`` (sorted);
        CRC checked.  Returns the number of rows owned by server_id.
        """
        n = self.entry["rows" if group == "sparse" else "admission_rows"]
        owned = 0
        crcs = dict.fromkeys(fields, 0)
        for lo in range(0, n, LOAD_ROWS):
            with h5_errors(self.path):
                chunk = {f: self.file[f"{group}/{f}"][lo:lo + LOAD_ROWS] for f in fields}
            for f in fields:
                crcs[f] = zlib.crc32(chunk[f], crcs[f])
            keep = None if n_servers == 1 else owners(chunk["keys"], n_servers) == server_id
            owned += len(chunk["keys"]) if keep is None else int(keep.sum())
            if len(removed):
                alive = ~in_sorted(chunk["keys"], removed)
                keep = alive if keep is None else keep & alive
            if keep is not None:
                chunk = {f: a[keep] for f, a in chunk.items()}
            if len(chunk["keys"]):
                sparse.import_rows(chunk)
        for f in fields:
            self._verify(f"{group}/{f}", crcs[f])
        return owned

    def close(self):
        self.file.close()

# ------------------------------------------------------------------ id sets
def sorted_unique(x):
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if len(x) else x


def in_sorted(x, table):
    """Bool mask: which of ``x`` are in the sorted unique int64 array ``table``."""
    if not len(table):
        return np.zeros(len(x), np.bool_)
    pos = np.minimum(np.searchsorted(table, x), len(table) - 1)
    return table[pos] == x

def fold_removed(removed, evicted, keys):
    """Ids whose last event is an eviction (sorted unique), after one more checkpoint
    element: ``removed`` so far (sorted unique), plus the element's ``evicted`` ids, less
    its row ``keys`` (any order; an id evicted and re-created in one element keeps its
    row)."""
    removed = sorted_unique(np.concatenate([removed, evicted]))
    keys = sorted_unique(keys)
    return removed[~in_sorted(removed, keys)] if len(keys) else removed


# ------------------------------------------------------------------ one element
def manifest_schema(manifest):
    """The dataset schema of the tables a checkpoint manifest describes (no admission)."""
    opt = OptimizerConfig(**manifest["optimizer"])
    return tables_schema(SparseTable(manifest["embedding_dim"], opt, 0, capacity=16),
                         DenseTable(np.zeros(1, np.float32), opt,
                                    0.5 if has_average(manifest) else 0.0))


def element_rows(ckpt_dir, manifest):
    """(keys, values, evicted) of one checkpoint element, all shards, CRCs verified."""
    schema = manifest_schema(manifest)
    keys, values, evicted = [], [], []
    for entry in manifest["shards"]:
        shard = Shard(ckpt_dir, entry, schema)
        try:
            keys.append(shard.read("sparse/keys"))
            values.append(shard.read("sparse/values"))
            evicted.append(shard.read("sparse/evicted"))
        finally:
            shard.close()
    dim = manifest["embedding_dim"]
    return (np.concatenate(keys) if keys else np.empty(0, np.int64),
            np.concatenate(values) if values else np.empty((0, dim), np.float32),
            np.concatenate(evicted) if evicted else np.empty(0, np.int64))


def dense_slice(ckpt_dir, m, schema, dense, lo, hi):
    """Dense state of [lo, hi) assembled from the saved slices of the last element (the
    ``average`` from the values where a shard has none)."""
    per_el = dict(dense_fields(dense))
    out = {k: np.empty(hi - lo if p else 1, np.float32) for k, p in per_el.items()}
    covered, have_scalars = 0, False
    for entry in m["shards"]:
        slo, shi = entry["dense_lo"], entry["dense_lo"] + entry["dense_size"]
        a, b = max(lo, slo), min(hi, shi)
        if b <= a and (have_scalars or lo != hi):
            continue
        shard = Shard(ckpt_dir, entry, schema)
        try:
            for k, p in per_el.items():
                arr = shard.read(f"dense/{k}" if f"dense/{k}" in shard.entry["datasets"]
                                 else "dense/values")
                if p and b > a:
                    out[k][a - lo:b - lo] = arr[a - slo:b - slo]
                elif not p and not have_scalars:
                    out[k][:] = arr
        finally:
            shard.close()
        covered += max(b - a, 0)
        have_scalars = True
    if covered != hi - lo:
        raise CheckpointError(f"{ckpt_dir}: dense slices do not cover [{lo}, {hi})")
    return out


def has_average(manifest):
    """Whether a checkpoint element's shards hold the dense weights' moving average."""
    return all("dense/average" in e["datasets"] for e in manifest["shards"])


def dense_values(ckpt_dir, manifest, raw=False):
    """The whole dense vector (P,) float32 of one checkpoint element: the weights to
    evaluate and serve, its moving average where it has one (``--dense-average``), else
    (or with ``raw``) the trained values."""
    avg = has_average(manifest) and not raw
    dense = DenseTable(np.zeros(1, np.float32), OptimizerConfig(**manifest["optimizer"]),
                       0.5 if avg else 0.0)           # (any B: a table that keeps one)
    return dense_slice(ckpt_dir, manifest, manifest_schema(manifest), dense, 0,
                       manifest["n_params"])["average" if avg else "values"]
