"""Choosing and loading a checkpoint: a base..delta chain into any number of servers,
every byte checked.

:func:`latest` / :func:`resolve` choose the checkpoint of a root: the newest whose whole
chain verifies (:func:`verify`: manifests, file sizes, and every dataset's CRC-32).  Every
server then calls :func:`load_shard_into` with its own index and the new server count;
ids are re-assigned by ``owner_of``, so S servers' files load into any S'.  Sizes, shapes,
dtypes and CRC-32s are verified against the manifest again as the rows are read; any
problem raises CheckpointError.
"""
import os
import zlib
from contextlib import contextmanager

import h5py
import numpy as np

from mpips.checkpoint.manifest import (_DIR_RE, MANIFEST, SKIPPED_FIELDS, CheckpointError,
                                       chain_manifests, list_checkpoints, read_manifest,
                                       stderr_warn)
from mpips.tables.ownership import owners

LOAD_ROWS = 1 << 16                    # rows per read + import_rows call (its np.unique
                                       # is ~4x faster per row on cache-sized pieces)
VERIFY_BYTES = 1 << 24                 # bytes per read while verifying a dataset's CRC


@contextmanager
def _h5_errors(path):
    """Turn h5py/HDF5 failures into a CheckpointError naming the file."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupted or unreadable HDF5 file "
                              f"({type(e).__name__}: {e})") from None


def _rows_schema(table, group, rows_key, evicted_key):
    """Datasets of a table's row fields under group: name -> (dtype, shape of an entry)."""
    out = {}
    for f, arr in table.export_rows(np.empty(0, np.int64)).items():
        if f not in SKIPPED_FIELDS:
            out[f"{group}/{f}"] = (arr.dtype, lambda e, t=arr.shape[1:]: (e[rows_key],) + t)
    out[f"{group}/evicted"] = (np.dtype(np.int64), lambda e: (e[evicted_key],))
    return out


def _schema(sparse, dense, admission=None):
    """Expected datasets: name -> (dtype, shape given the shard's manifest entry).

    With ``admission`` (the AdmittedTable loaded into), the ``/admission/`` datasets too;
    shards saved without them (older checkpoints, runs without --entry) are read as
    holding no waiting counts.
    """
    out = _rows_schema(sparse, "sparse", "rows", "evicted")
    out["dense/values"] = (np.dtype(np.float32), lambda e: (e["dense_size"],))
    for name, per_el in dense.opt.state_arrays():
        out[f"dense/{name}"] = (np.dtype(np.float32),
                                (lambda e: (e["dense_size"],)) if per_el else (lambda e: (1,)))
    if admission is not None:
        adm = _rows_schema(admission.counts, "admission", "admission_rows", "admission_evicted")
        adm["admission/admitted"] = (np.dtype(np.int64), lambda e: (1,))
        out.update({k: v + (True,) for k, v in adm.items()})
    return out


def _for_entry(schema, entry):
    """The part of the schema a shard entry has: optional (admission) datasets if saved."""
    has_adm = "admission_rows" in entry
    return {k: v[:2] for k, v in schema.items() if len(v) == 2 or has_adm}


class _Shard:
    """One shard file, opened and checked against its manifest entry and the schema."""

    def __init__(self, ckpt_dir, entry, schema):
        self.path = os.path.join(ckpt_dir, entry["file"])
        self.entry = entry
        schema = _for_entry(schema, entry)
        self.has_admission = "admission/keys" in schema
        if not os.path.exists(self.path):
            raise CheckpointError(f"{self.path}: shard file listed in {MANIFEST} is missing")
        size = os.path.getsize(self.path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{self.path}: file is {size} bytes, {MANIFEST} says "
                                  f"{entry['bytes']} (truncated or overwritten)")
        self._check_entry(schema, size)
        with _h5_errors(self.path):
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
        with _h5_errors(self.path):
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
        with _h5_errors(self.path):
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
            with _h5_errors(self.path):
                chunk = {f: self.file[f"{group}/{f}"][lo:lo + LOAD_ROWS] for f in fields}
            for f in fields:
                crcs[f] = zlib.crc32(chunk[f], crcs[f])
            keep = None if n_servers == 1 else owners(chunk["keys"], n_servers) == server_id
            owned += len(chunk["keys"]) if keep is None else int(keep.sum())
            if len(removed):
                alive = ~_in_sorted(chunk["keys"], removed)
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


def _check_target(path, m, sparse, dense, server_id, n_servers, bounds):
    if m["embedding_dim"] != sparse.dim:
        raise CheckpointError(f"{path}: saved with embedding_dim {m['embedding_dim']}; the "
                              f"table has dim {sparse.dim}")
    if m["optimizer"]["name"] != sparse.opt.name or m["optimizer"]["name"] != dense.opt.name:
        raise CheckpointError(f"{path}: saved with optimizer {m['optimizer']['name']}; the "
                              f"tables use {sparse.opt.name}")
    if len(bounds) != n_servers + 1 or not 0 <= server_id < n_servers:
        raise ValueError(f"need 0 <= server_id < n_servers and n_servers+1 dense_bounds; got "
                         f"server {server_id} of {n_servers} with {len(bounds)} bounds")
    if bounds[-1] != m["n_params"]:
        raise CheckpointError(f"{path}: holds {m['n_params']} dense parameters; the model has "
                              f"{bounds[-1]} (different --fc or --embedding-dim?)")
    if len(dense) != bounds[server_id + 1] - bounds[server_id]:
        raise ValueError(f"dense table has {len(dense)} values; slice {server_id} of "
                         f"dense_bounds has {bounds[server_id + 1] - bounds[server_id]}")
    if len(sparse):
        raise ValueError(f"load needs an empty sparse table; this one has {len(sparse)} rows")


def _sorted_unique(x):
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if len(x) else x


def _in_sorted(x, table):
    """Bool mask: which of ``x`` are in the sorted unique int64 array ``table``."""
    if not len(table):
        return np.zeros(len(x), np.bool_)
    pos = np.minimum(np.searchsorted(table, x), len(table) - 1)
    return table[pos] == x


def _removed_ids(groups, name="sparse"):
    """Sorted ids whose last event in the chain is an eviction (never to be imported).

    Within one element evictions come before rows: an id evicted and re-created in the
    same period is in both, and its row wins.
    """
    removed = np.empty(0, np.int64)
    for group in groups:
        evicted = np.concatenate([s.read(f"{name}/evicted") for s in group])
        if not len(removed) and not len(evicted):
            continue
        keys = _sorted_unique(np.concatenate([s.read(f"{name}/keys") for s in group]))
        removed = _sorted_unique(np.concatenate([removed, evicted]))
        if len(keys):
            removed = removed[~_in_sorted(removed, keys)]
    return removed


def _dense_slice(ckpt_dir, m, schema, dense, lo, hi):
    """Dense state of [lo, hi) assembled from the saved slices of the last element."""
    per_el = dict(dense.opt.state_arrays(), values=True)
    out = {k: np.empty(hi - lo if p else 1, np.float32) for k, p in per_el.items()}
    covered, have_scalars = 0, False
    for entry in m["shards"]:
        slo, shi = entry["dense_lo"], entry["dense_lo"] + entry["dense_size"]
        a, b = max(lo, slo), min(hi, shi)
        if b <= a and (have_scalars or lo != hi):
            continue
        shard = _Shard(ckpt_dir, entry, schema)
        try:
            for k, p in per_el.items():
                arr = shard.read(f"dense/{k}")
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


def load_shard_into(path, sparse, dense, server_id, n_servers, dense_bounds, admission=None):
    """Load checkpoint ``path`` (base..delta chain) into this server's empty tables.

    Keeps the ids that ``owner_of(id, n_servers) == server_id`` and the dense slice
    ``[dense_bounds[server_id], dense_bounds[server_id+1])``, whatever the number of
    servers that wrote it.  Before each delta's rows are imported, the rows loaded so far
    are aged by the delta's ``shrinks`` (what the shrinks between the saves did to rows
    that were not seen, hence not saved again).  ``admission``: the AdmittedTable in front
    of ``sparse``; its waiting counts and ``admitted`` counter are loaded the same way
    (the counter goes to server 0 when the number of servers changes).  Manifests, file
    sizes, shapes, dtypes, the ids, evictions and the dense slice are verified before the
    tables change; the other row data are imported in chunks as their checksums
    accumulate, so after an error the tables hold part of the checkpoint and must be
    discarded.  Afterwards the tables count as saved (no dirty rows, no evicted ids).
    Returns the manifest of ``path``.
    """
    elements = chain_manifests(path)
    bounds = [int(b) for b in dense_bounds]
    for d, m in elements:
        _check_target(d, m, sparse, dense, server_id, n_servers, bounds)
    schema = _schema(sparse, dense, admission)
    tables = [("sparse", sparse)] + ([("admission", admission.counts)] if admission is not None
                                     else [])
    groups = []                           # per element: its shard files this server reads
    try:
        for d, m in elements:
            same = m["n_servers"] == n_servers
            groups.append([_Shard(d, e, schema)
                           for e in ([m["shards"][server_id]] if same else m["shards"])])
        d, m = elements[-1]
        state = _dense_slice(d, m, schema, dense, bounds[server_id], bounds[server_id + 1])
        for name, table in tables:
            _import_chain(elements, groups, name, table, server_id, n_servers)
        if admission is not None and groups[-1][0].has_admission:
            admission.admitted = _admitted(groups[-1], server_id, m["n_servers"] == n_servers)
    finally:
        for group in groups:
            for shard in group:
                shard.close()
    dense.import_state(state)
    for _, table in tables:
        table.clear_dirty()
        table.clear_evicted()
    return m


def _import_chain(elements, groups, name, table, server_id, n_servers):
    """Import one table (``sparse`` or ``admission``) along the chain, ageing between."""
    fields = [f for f in table.export_rows(np.empty(0, np.int64)) if f not in SKIPPED_FIELDS]
    if name == "admission":           # elements saved without admission data hold none
        keep = [i for i, g in enumerate(groups) if g[0].has_admission]
        first = keep[0] if keep else len(groups)
        if any(i not in keep for i in range(first, len(groups))):
            raise CheckpointError(f"{elements[-1][0]}: admission counts saved in only part "
                                  "of the chain")
        elements, groups = elements[first:], groups[first:]
    if not groups:
        return
    removed = _removed_ids(groups, name)
    for i, ((d, m), group) in enumerate(zip(elements, groups)):
        if i:
            table.age(m["shards"][0].get("shrinks", 0))
        for shard in group:
            owned = shard.import_into(table, fields, server_id, n_servers, removed, name)
            want = shard.entry["rows" if name == "sparse" else "admission_rows"]
            if m["n_servers"] == n_servers and owned != want:
                raise CheckpointError(f"{shard.path}: holds ids of other servers (written "
                                      "with a different id -> server mapping)")


def _admitted(group, server_id, same):
    """This server's ``admitted`` counter from the last element's shards."""
    if same:
        return int(group[0].read("admission/admitted")[0])
    return sum(int(s.read("admission/admitted")[0]) for s in group) if server_id == 0 else 0


# ------------------------------------------------------------------ choosing
def _listed_schema(entry):
    """A schema of exactly the datasets a shard entry lists (what :func:`verify` checks)."""
    return {name: (np.dtype(d["dtype"]), lambda e, shape=d["shape"]: tuple(shape))
            for name, d in entry["datasets"].items()}


def verify_element(ckpt_dir, m):
    """Raise CheckpointError unless every shard file of one checkpoint directory is there,
    at its size, and every dataset its manifest lists matches its shape, dtype and CRC."""
    for entry in m["shards"]:
        shard = _Shard(ckpt_dir, entry, _listed_schema(entry))
        try:
            for name in entry["datasets"]:
                shard.verify(name)
        finally:
            shard.close()


def verify(path, verified=None):
    """Raise CheckpointError unless checkpoint ``path`` and every element of its chain
    verify (manifests, file sizes, every dataset's CRC-32).  ``verified``: a dict of
    directory -> error (None when it verified) shared between calls, so a base is read once
    while its deltas are tried one after the other."""
    verified = {} if verified is None else verified
    for d, m in chain_manifests(path):
        if d not in verified:
            try:
                verify_element(d, m)
                verified[d] = None
            except CheckpointError as e:
                verified[d] = str(e)
        if verified[d] is not None:
            raise CheckpointError(verified[d] if d == os.path.normpath(path) else
                                  f"{path} needs {os.path.basename(d)}: {verified[d]}")


def latest(root, warn=None):
    """Path of the newest checkpoint in root whose whole chain verifies, or None.

    Newer ones that do not (an interrupted save, an edited manifest, a delta whose chain is
    broken, a missing, truncated or corrupted shard file) are passed over with one line
    each through ``warn`` (default: stderr).  Verifying reads every byte of the chosen
    chain once (the load reads it again, mostly from the page cache).
    """
    warn = warn or stderr_warn
    verified = {}
    for info in reversed(list_checkpoints(root)):
        if info["valid"]:
            try:
                verify(info["path"], verified)
                return info["path"]
            except CheckpointError as e:
                info["error"] = str(e)
        warn(f"passing over {info['error']}")
    return None


def resolve(path, warn=None):
    """A checkpoint directory from ``path``: itself (checked when it is loaded), or the
    newest one that verifies (:func:`latest`) if it is a root."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint or checkpoint root")
    if os.path.exists(os.path.join(path, MANIFEST)) or _DIR_RE.match(os.path.basename(path)):
        return path
    found = latest(path, warn)
    if found is None:
        raise CheckpointError(f"{path}: holds no checkpoint that verifies (none committed, "
                              "or each failed a check named above)")
    return found


def load_config(path, warn=None):
    """The run config stored in checkpoint ``path`` (a checkpoint dir or a root), as a dict."""
    return read_manifest(resolve(path, warn))["config"]


# ------------------------------------------------------------------ loading
def load_local(path, sparse, dense, admission=None):
    """Load checkpoint ``path`` (dir or root) whole into one process's empty tables."""
    return load_shard_into(resolve(path), sparse, dense, 0, 1, [0, len(dense)], admission)
