"""HDF5 checkpoints: full, base and delta saves, atomic commit, chains, re-sharding on load.

Layout of a checkpoint root::

    ROOT/ckpt-000001-base/shard-00000-of-00002.h5    one file per server (h5py, no pickle)
                         /shard-00001-of-00002.h5
                         /MANIFEST.json             written LAST: its presence commits
    ROOT/ckpt-000002-delta/...                      parent: ckpt-000001-base

Modes (Paddle's ``save_persistables(mode)`` 0/1/2):

* ``full``  every row with its optimizer state and metadata; change tracking untouched;
* ``base``  the same, then ``clear_dirty()``/``clear_evicted()``: tracking starts here;
* ``delta`` the rows changed (dirty) and the ids evicted since the last base/delta, then
  clear.  Its manifest names its ``parent`` (the previous base or delta) so
  ``chain(delta)`` walks back to a base.
The dense slice of each server and its optimizer state are saved in every mode.

A shard file holds ``/sparse/<field>`` for each row field of the table but ``dirty``
(``keys`` int64 (n,), ``values`` float32 (n, dim), optimizer state, ``unseen``,
``seen_count``, ``seen_flag``), ``/sparse/evicted`` int64 (k,) and ``/dense/<name>``
(``values`` and the optimizer state of the slice at ``dense_lo``).  Datasets are
contiguous and uncompressed.  The manifest records, per shard, the file size and for
every dataset its shape, dtype and CRC-32; all are verified on load.  Any problem
raises :class:`CheckpointError` (a ``ValueError``) naming the directory or file and what
is wrong.

Saving is collective in the caller's hands: one rank makes the directory
(:func:`new_checkpoint_dir`), every server calls :func:`save_shard` on its quiesced
tables, and one rank gathers the returned dicts and calls :func:`write_manifest`.
Loading: every server calls :func:`load_shard_into` with its own index and the new
server count; ids are re-assigned by ``owner_of`` so S servers' files load into any S'.

Known limit of deltas: row metadata that changes without marking a row dirty (``unseen``
and ``seen_flag`` aged by ``shrink``, ``seen_count`` of pulls that were never pushed) is
as of the row's last save.  Shrinking right before a base, as DESIGN.md's online schedule
does, keeps base + deltas exact.
"""
import dataclasses
import json
import os
import re
import sys
import time
import zlib
from contextlib import contextmanager

import h5py
import numpy as np

from mpips.sharding import owners

FORMAT = "mpips-checkpoint"
VERSION = 1
MODES = ("full", "base", "delta")      # Paddle save_persistables mode 0, 1, 2
MANIFEST = "MANIFEST.json"
CHUNK_ROWS = 1 << 18                   # rows per HDF5 write (bounds the extra memory)
LOAD_ROWS = 1 << 16                    # rows per read + import_rows call (its np.unique
                                       # is ~4x faster per row on cache-sized pieces)
SKIPPED_FIELDS = ("dirty",)            # save tracking, meaningless inside a checkpoint
_DIR_RE = re.compile(r"^ckpt-(\d{6,})-(full|base|delta)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, partial, corrupted or does not fit the tables."""


def _stderr_warn(msg):
    print(f"mpips.checkpoint: {msg}", file=sys.stderr, flush=True)


def shard_name(server_id, n_servers):
    return f"shard-{server_id:05d}-of-{n_servers:05d}.h5"


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"checkpoint mode must be one of {', '.join(MODES)}; got {mode!r}")


def _fsync(path):
    """fsync a file or a directory (the latter makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ directories
def _scan(root):
    """[(seq, mode, name)] of checkpoint-like directories in root, by seq."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _DIR_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), m.group(2), name))
    return sorted(found)


def new_checkpoint_dir(root, mode):
    """Create and return ``ROOT/ckpt-<next seq>-<mode>`` (one rank calls this).

    A delta needs an earlier committed base or delta in ``root`` to be its parent.
    """
    _check_mode(mode)
    os.makedirs(root, exist_ok=True)
    if mode == "delta" and _auto_parent(root, None) is None:
        raise CheckpointError(f"cannot save a delta in {root}: it holds no committed base "
                              "or delta to be its parent (save mode 'base' first)")
    while True:
        seqs = [s for s, _, _ in _scan(root)]
        path = os.path.join(root, f"ckpt-{(max(seqs) + 1 if seqs else 1):06d}-{mode}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        _fsync(root)
        return path


def list_checkpoints(root):
    """Checkpoint directories of root by seq: dicts path, name, seq, mode, valid, error."""
    out = []
    for seq, mode, name in _scan(root):
        path = os.path.join(root, name)
        try:
            read_manifest(path)
            valid, error = True, None
        except CheckpointError as e:
            valid, error = False, str(e)
        out.append({"path": path, "name": name, "seq": seq, "mode": mode, "valid": valid,
                    "error": error})
    return out


def latest(root, warn=None):
    """Path of the newest committed checkpoint in root, or None.

    Newer directories without a valid manifest (interrupted saves) are skipped with a
    warning through ``warn`` (default: stderr).
    """
    warn = warn or _stderr_warn
    for info in reversed(list_checkpoints(root)):
        if info["valid"]:
            return info["path"]
        warn(f"ignoring {info['error']}")
    return None


def resolve(path, warn=None):
    """A checkpoint directory from ``path``: itself, or the latest one if it is a root."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint or checkpoint root")
    if os.path.exists(os.path.join(path, MANIFEST)) or _DIR_RE.match(os.path.basename(path)):
        return path
    found = latest(path, warn)
    if found is None:
        raise CheckpointError(f"{path}: holds no committed checkpoint (no ckpt-*/{MANIFEST})")
    return found


# ------------------------------------------------------------------- manifest
def _need(cond, where, what):
    if not cond:
        raise CheckpointError(f"{where}: invalid {MANIFEST}: {what}")


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _check_shard_entry(where, sh, i, n_servers):
    _need(isinstance(sh, dict), where, f"shard {i} is not an object")
    for key in ("bytes", "rows", "evicted", "dense_lo", "dense_size", "server_id"):
        _need(_is_int(sh.get(key)) and sh[key] >= 0, where, f"shard {i}: bad {key!r}")
    name = sh.get("file")
    _need(name == shard_name(i, n_servers) and sh["server_id"] == i, where,
          f"shard {i}: file must be {shard_name(i, n_servers)}; got {name!r}")
    ds = sh.get("datasets")
    _need(isinstance(ds, dict) and ds, where, f"shard {i}: no datasets")
    for dname, d in ds.items():
        ok = (isinstance(d, dict) and isinstance(d.get("shape"), list)
              and all(_is_int(x) and x >= 0 for x in d["shape"])
              and isinstance(d.get("dtype"), str) and _is_int(d.get("crc32")))
        _need(ok, where, f"shard {i}: bad entry for dataset {dname!r}")


def _check_manifest(path, m):
    where = path
    _need(isinstance(m, dict) and m.get("format") == FORMAT, where, f"format is not {FORMAT}")
    _need(m.get("version") == VERSION, where,
          f"format version {m.get('version')!r}; this mpips reads version {VERSION}")
    match = _DIR_RE.match(os.path.basename(os.path.normpath(path)))
    if match:
        _need(m.get("seq") == int(match.group(1)) and m.get("mode") == match.group(2), where,
              "seq/mode do not match the directory name")
    _need(m.get("mode") in MODES and _is_int(m.get("seq")), where, "bad mode or seq")
    _need((m.get("parent") is None) == (m["mode"] != "delta"), where,
          "a delta needs a parent, other modes none")
    if m["mode"] == "delta":
        pm = _DIR_RE.match(str(m["parent"]))
        _need(pm is not None and int(pm.group(1)) < m["seq"], where,
              f"parent {m['parent']!r} is not an earlier checkpoint directory")
    S = m.get("n_servers")
    _need(_is_int(S) and S >= 1, where, "bad n_servers")
    _need(_is_int(m.get("embedding_dim")) and m["embedding_dim"] >= 1, where, "bad embedding_dim")
    _need(isinstance(m.get("optimizer"), dict) and "name" in m["optimizer"], where,
          "bad optimizer")
    _need(isinstance(m.get("config"), dict), where, "config is not an object")
    shards = m.get("shards")
    _need(isinstance(shards, list) and len(shards) == S, where, f"needs {S} shard entries")
    for i, sh in enumerate(shards):
        _check_shard_entry(where, sh, i, S)
    bounds = m.get("dense_bounds")
    want = [sh["dense_lo"] for sh in shards] + [shards[-1]["dense_lo"] + shards[-1]["dense_size"]]
    _need(bounds == want and bounds[0] == 0 and bounds == sorted(bounds)
          and bounds[-1] == m.get("n_params"), where, "dense_bounds do not tile n_params")


def read_manifest(path):
    """The validated manifest of checkpoint directory ``path`` (CheckpointError if none)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"partial checkpoint {path}: no {MANIFEST} (the save did not "
                              "finish); use an earlier checkpoint")
    try:
        with open(mpath, "rb") as fh:
            m = json.loads(fh.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable {MANIFEST} ({e})") from None
    _check_manifest(path, m)
    return m


def _auto_parent(root, below_seq):
    """Name of the newest committed base/delta in root (with seq < below_seq), or None."""
    for info in reversed(list_checkpoints(root)):
        if below_seq is not None and info["seq"] >= below_seq:
            continue
        if info["valid"] and info["mode"] in ("base", "delta"):
            return info["name"]
    return None


def _config_dict(config):
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, str):
        return json.loads(config)
    return json.loads(config.to_json())


def write_manifest(ckpt_dir, info):
    """Commit ``ckpt_dir``: validate the shards and write MANIFEST.json atomically.

    ``info``: ``shards`` (the dicts save_shard returned, any order), optional ``config``
    (a Config, its JSON or a dict), ``meta`` (anything JSON: epoch, step, pass, data
    position) and, for a delta, ``parent`` (directory name; default: the newest committed
    base/delta before it in the same root).  Returns the manifest.
    """
    name = os.path.basename(os.path.normpath(ckpt_dir))
    match = _DIR_RE.match(name)
    if not match:
        raise CheckpointError(f"{ckpt_dir}: not a checkpoint directory name (ckpt-NNNNNN-mode)")
    seq, mode = int(match.group(1)), match.group(2)
    shards = sorted(info["shards"], key=lambda s: s["server_id"])
    S = shards[0]["n_servers"] if shards else 0
    if [s["server_id"] for s in shards] != list(range(S)) or S < 1:
        raise CheckpointError(f"{ckpt_dir}: need shards 0..{S - 1} exactly once; got server ids "
                              f"{[s['server_id'] for s in shards]}")
    first = shards[0]
    for key, want in (("n_servers", S), ("mode", mode), ("embedding_dim", first["embedding_dim"]),
                      ("optimizer", first["optimizer"])):
        bad = [s["server_id"] for s in shards if s[key] != want]
        if bad:
            raise CheckpointError(f"{ckpt_dir}: shards {bad} disagree on {key} (want {want!r})")
    parent = None
    if mode == "delta":
        root = os.path.dirname(os.path.normpath(ckpt_dir))
        parent = info.get("parent") or _auto_parent(root, seq)
        if parent is None:
            raise CheckpointError(f"delta {ckpt_dir} has no committed base/delta before it")
    entries = [{k: s[k] for k in ("file", "bytes", "server_id", "rows", "evicted", "dense_lo",
                                  "dense_size", "datasets")} for s in shards]
    last = shards[-1]
    end = last["dense_lo"] + last["dense_size"]
    manifest = {"format": FORMAT, "version": VERSION, "seq": seq, "mode": mode,
                "parent": parent, "n_servers": S, "n_params": end,
                "dense_bounds": [s["dense_lo"] for s in shards] + [end],
                "embedding_dim": shards[0]["embedding_dim"], "optimizer": shards[0]["optimizer"],
                "rows": sum(s["rows"] for s in shards), "created": time.time(),
                "config": _config_dict(info.get("config")), "meta": info.get("meta") or {},
                "shards": entries}
    _check_manifest(ckpt_dir, manifest)
    try:
        text = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt_dir}: meta/config is not JSON-serialisable ({e})") from None
    tmp = os.path.join(ckpt_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, MANIFEST))
    _fsync(ckpt_dir)
    return manifest


def chain(path):
    """Checkpoint directories to load for ``path``, base first (``[path]`` unless a delta)."""
    return [d for d, _ in _chain(path)]


def _chain(path):
    path = os.path.normpath(path)
    m = read_manifest(path)
    out = [(path, m)]
    while m["mode"] == "delta":
        parent = os.path.join(os.path.dirname(path), m["parent"])
        try:
            pm = read_manifest(parent)
        except CheckpointError as e:
            raise CheckpointError(f"delta {path} needs its base {m['parent']}: {e}") from None
        if pm["mode"] == "full":
            raise CheckpointError(f"delta {path}: parent {m['parent']} is a full save, not a "
                                  "base or delta")
        path, m = parent, pm
        out.append((path, m))
    return out[::-1]


# ----------------------------------------------------------------------- save
def _write_whole(group, name, arr, datasets):
    arr = np.ascontiguousarray(arr)
    group.create_dataset(name, data=arr)
    datasets[f"{group.name.strip('/')}/{name}"] = {
        "shape": list(arr.shape), "dtype": arr.dtype.name, "crc32": zlib.crc32(arr)}


def _write_rows(group, sparse, rows, n, datasets):
    """Write the fields of n table rows (``rows`` indices, None = all) in chunks."""
    template = sparse.export_rows(np.empty(0, np.int64))
    fields = [f for f in template if f not in SKIPPED_FIELDS]
    dsets = {f: group.create_dataset(f, shape=(n,) + template[f].shape[1:],
                                     dtype=template[f].dtype) for f in fields}
    crcs = dict.fromkeys(fields, 0)
    for lo in range(0, n, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, n)
        idx = np.arange(lo, hi, dtype=np.int64) if rows is None else rows[lo:hi]
        chunk = sparse.export_rows(idx)
        for f in fields:
            arr = np.ascontiguousarray(chunk[f])
            dsets[f].write_direct(arr, dest_sel=np.s_[lo:hi])
            crcs[f] = zlib.crc32(arr, crcs[f])
    for f in fields:
        datasets[f"sparse/{f}"] = {"shape": list(dsets[f].shape),
                                   "dtype": template[f].dtype.name, "crc32": crcs[f]}


def save_shard(ckpt_dir, server_id, n_servers, sparse, dense, dense_lo, mode):
    """Write this server's shard file into ``ckpt_dir``; return its entry for the manifest.

    Call on quiesced tables (no push may land during the call).  ``dense_lo`` is the
    offset of ``dense``'s slice in the flat dense vector.  base/delta clear the table's
    change tracking once the file is safely on disk.
    """
    _check_mode(mode)
    if not 0 <= server_id < n_servers:
        raise ValueError(f"server_id must be in [0, {n_servers}); got {server_id}")
    name = shard_name(server_id, n_servers)
    final = os.path.join(ckpt_dir, name)
    tmp = final + ".tmp"
    rows = sparse.dirty_rows() if mode == "delta" else None
    n = len(sparse) if rows is None else len(rows)
    evicted = sparse.evicted_keys() if mode == "delta" else np.empty(0, np.int64)
    opt = dataclasses.asdict(sparse.opt)
    datasets = {}
    with h5py.File(tmp, "w", locking=False) as f:
        f.attrs.update(format=FORMAT, version=VERSION, mode=mode, server_id=server_id,
                       n_servers=n_servers, embedding_dim=sparse.dim, optimizer=opt["name"],
                       rows=n, evicted=len(evicted), dense_lo=int(dense_lo),
                       dense_size=len(dense))
        grp = f.create_group("sparse")
        _write_rows(grp, sparse, rows, n, datasets)
        _write_whole(grp, "evicted", evicted.astype(np.int64), datasets)
        dgrp = f.create_group("dense")
        for key, arr in dense.export_state().items():
            _write_whole(dgrp, key, arr, datasets)
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync(ckpt_dir)
    if mode in ("base", "delta"):
        sparse.clear_dirty()
        sparse.clear_evicted()
    return {"file": name, "bytes": os.path.getsize(final), "server_id": int(server_id),
            "n_servers": int(n_servers), "mode": mode, "rows": int(n),
            "evicted": len(evicted), "dense_lo": int(dense_lo), "dense_size": len(dense),
            "embedding_dim": sparse.dim, "optimizer": opt, "datasets": datasets}


# ----------------------------------------------------------------------- load
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


def _schema(sparse, dense):
    """Expected datasets: name -> (dtype, shape given (rows, evicted, dense_size))."""
    template = sparse.export_rows(np.empty(0, np.int64))
    out = {}
    for f, arr in template.items():
        if f not in SKIPPED_FIELDS:
            out[f"sparse/{f}"] = (arr.dtype, lambda r, e, d, t=arr.shape[1:]: (r,) + t)
    out["sparse/evicted"] = (np.dtype(np.int64), lambda r, e, d: (e,))
    out["dense/values"] = (np.dtype(np.float32), lambda r, e, d: (d,))
    for name, per_el in dense.opt.state_arrays():
        out[f"dense/{name}"] = (np.dtype(np.float32),
                                (lambda r, e, d: (d,)) if per_el else (lambda r, e, d: (1,)))
    return out


class _Shard:
    """One shard file, opened and checked against its manifest entry and the schema."""

    def __init__(self, ckpt_dir, entry, schema):
        self.path = os.path.join(ckpt_dir, entry["file"])
        self.entry = entry
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
            want = list(shape_fn(e["rows"], e["evicted"], e["dense_size"]))
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

    def import_into(self, sparse, fields, server_id, n_servers, removed):
        """Import the rows server_id owns, except ids in ``removed`` (sorted); CRC checked.

        Returns the number of rows owned by server_id.
        """
        n, owned = self.entry["rows"], 0
        crcs = dict.fromkeys(fields, 0)
        for lo in range(0, n, LOAD_ROWS):
            with _h5_errors(self.path):
                chunk = {f: self.file[f"sparse/{f}"][lo:lo + LOAD_ROWS] for f in fields}
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
            self._verify(f"sparse/{f}", crcs[f])
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


def _removed_ids(groups):
    """Sorted ids whose last event in the chain is an eviction (never to be imported).

    Within one element evictions come before rows: an id evicted and re-created in the
    same period is in both, and its row wins.
    """
    removed = np.empty(0, np.int64)
    for group in groups:
        evicted = np.concatenate([s.read("sparse/evicted") for s in group])
        if not len(removed) and not len(evicted):
            continue
        keys = _sorted_unique(np.concatenate([s.read("sparse/keys") for s in group]))
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


def load_shard_into(path, sparse, dense, server_id, n_servers, dense_bounds):
    """Load checkpoint ``path`` (base..delta chain) into this server's empty tables.

    Keeps the ids that ``owner_of(id, n_servers) == server_id`` and the dense slice
    ``[dense_bounds[server_id], dense_bounds[server_id+1])``, whatever the number of
    servers that wrote it.  Manifests, file sizes, shapes, dtypes, the ids, evictions and
    the dense slice are verified before the tables change; the other row data are
    imported in chunks as their checksums accumulate, so after an error the tables hold
    part of the checkpoint and must be discarded.  Afterwards the tables count as saved
    (no dirty rows, no evicted ids).  Returns the manifest of ``path``.
    """
    elements = _chain(path)
    bounds = [int(b) for b in dense_bounds]
    for d, m in elements:
        _check_target(d, m, sparse, dense, server_id, n_servers, bounds)
    schema = _schema(sparse, dense)
    fields = [k[7:] for k in schema if k.startswith("sparse/") and k != "sparse/evicted"]
    groups = []                           # per element: its shard files this server reads
    try:
        for d, m in elements:
            same = m["n_servers"] == n_servers
            groups.append([_Shard(d, e, schema)
                           for e in ([m["shards"][server_id]] if same else m["shards"])])
        removed = _removed_ids(groups)
        d, m = elements[-1]
        state = _dense_slice(d, m, schema, dense, bounds[server_id], bounds[server_id + 1])
        for (d, m), group in zip(elements, groups):
            for shard in group:
                owned = shard.import_into(sparse, fields, server_id, n_servers, removed)
                if m["n_servers"] == n_servers and owned != shard.entry["rows"]:
                    raise CheckpointError(f"{shard.path}: holds ids of other servers (written "
                                          "with a different id -> server mapping)")
    finally:
        for group in groups:
            for shard in group:
                shard.close()
    dense.import_state(state)
    sparse.clear_dirty()
    sparse.clear_evicted()
    return m


# ------------------------------------------------------------- config, local
def load_config(path, warn=None):
    """The run config stored in checkpoint ``path`` (a checkpoint dir or a root), as a dict."""
    return read_manifest(resolve(path, warn))["config"]


def _fc(value):
    if isinstance(value, str):
        return tuple(int(x) for x in value.split(",") if x.strip())
    return tuple(int(x) for x in value)


def check_compatible(manifest, cfg):
    """Raise CheckpointError naming the first field where ``cfg`` cannot use the checkpoint."""
    now = cfg if isinstance(cfg, dict) else json.loads(cfg.to_json())
    saved = dict(manifest["config"])
    saved.setdefault("embedding_dim", manifest["embedding_dim"])
    saved.setdefault("optimizer", manifest["optimizer"]["name"])
    checks = (("embedding_dim", int), ("fc", _fc), ("optimizer", str))
    for key, norm in checks:
        if key in saved and key in now and norm(saved[key]) != norm(now[key]):
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(
                f"checkpoint seq {manifest['seq']} was saved with {flag} {saved[key]}; this "
                f"run has {flag} {now[key]} (use the same {flag}, or do not resume from it)")


def save_local(root, sparse, dense, mode, config=None, meta=None):
    """Save one process's whole tables as a one-shard checkpoint; return its directory."""
    d = new_checkpoint_dir(root, mode)
    info = save_shard(d, 0, 1, sparse, dense, 0, mode)
    write_manifest(d, {"shards": [info], "config": config, "meta": meta})
    return d


def load_local(path, sparse, dense):
    """Load checkpoint ``path`` (dir or root) whole into one process's empty tables."""
    return load_shard_into(resolve(path), sparse, dense, 0, 1, [0, len(dense)])
