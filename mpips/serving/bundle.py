"""Serving bundles: the values a predictor needs, from a checkpoint, in one HDF5 file.

A bundle (``kind`` ``full``) holds::

    /sparse/keys     int64 (n,)          ids with a row
    /sparse/values   float32|16 (n, dim) their embeddings (no optimizer state)
    /sparse/evicted  int64 (0,)
    /dense/values    float32 (n_params,) the dense network, flat (the network's layout)

A *patch* (``kind`` ``patch``) has the same datasets: the rows changed since the bundle
it names in ``since`` (its checkpoint), the ids evicted since then, and the whole dense
vector.  Applying it is :func:`merge_rows`, the same step that folds a checkpoint's
base..delta chain into one table, so a chain of patches equals a bundle of the last
checkpoint (a test holds it to that).

The manifest is the JSON attribute ``manifest`` of the file: format, version, kind,
dtype, the model config, the feature schema (``schema``: ``Schema.to_dict()``; bundles
written before schemas have none and read as Criteo's), the data settings (format, ``hash_bucket``, normalisation
``cont_min``/``cont_diff`` resolved at export time), the checkpoint it came from
(``name``, ``seq``, ``lineage`` = its base checkpoint, and for a patch ``since``), and
per dataset its shape, dtype and CRC-32, checked on every load with the checkpoint
module's shard reader.  A file is written to ``.tmp`` and renamed, so a reader sees a
whole bundle or none; any problem raises one :class:`BundleError`.

Rows are read from the checkpoint's shard files directly, keys and values only: the
optimizer state (2x the values for Adam) is never read.
"""
import json
import os
import time
import zlib

import h5py
import numpy as np

from mpips.checkpoint.h5io import (Shard, dense_values, element_rows, fold_removed, in_sorted,
                                   sorted_unique, write_whole)
from mpips.checkpoint.load import resolve
from mpips.checkpoint.manifest import CheckpointError, chain_manifests, fsync, saved_settings
from mpips.checkpoint.compat import check_compatible, check_elements
from mpips.data.criteo import make_norm
from mpips.data.binary import load_stats
from mpips.models.spec import digest as net_digest
from mpips.models.zoo import stored_network
from mpips.schema import SchemaError, stored_schema

FORMAT = "mpips-bundle"
VERSION = 1
KINDS = ("full", "patch")
DTYPES = ("float32", "float16")
MANIFEST_ATTR = "manifest"
DATASETS = ("sparse/keys", "sparse/values", "sparse/evicted", "dense/values")


class BundleError(ValueError):
    """A bundle or patch is missing, truncated, corrupted or does not fit."""


# ------------------------------------------------------------------ table algebra
def merge_rows(keys, values, new_keys, new_values, evicted):
    """Fold one change set into a table: drop ``evicted`` and ``new_keys``, append the new rows.

    keys (n,) int64 unique, values (n, dim); new_keys (m,) unique with new_values (m, dim);
    evicted (k,) int64 (any order).  An id both evicted and in ``new_keys`` keeps its new
    row (within one delta, evictions come before rows).  Returns (keys, values), new arrays
    or, when ``keys`` is empty, the new rows themselves.
    """
    if len(keys):
        drop = sorted_unique(np.concatenate([np.asarray(evicted, np.int64), new_keys]))
        if len(drop):
            keep = ~in_sorted(keys, drop)
            keys, values = keys[keep], values[keep]
    else:                                        # nothing to drop from: no copy
        return new_keys, new_values.astype(values.dtype, copy=False)
    return (np.concatenate([keys, new_keys]),
            np.concatenate([values, new_values.astype(values.dtype, copy=False)]))


# ------------------------------------------------------------- checkpoint reading
def read_changes(elements, dim, removed=True):
    """Fold checkpoint elements [(dir, manifest)] in order: (keys, values, removed ids).

    ``removed=False`` skips tracking the removed ids (None is returned for them).
    """
    keys, values = np.empty(0, np.int64), np.empty((0, dim), np.float32)
    gone = np.empty(0, np.int64) if removed else None
    for d, m in elements:
        k, v, e = element_rows(d, m)
        keys, values = merge_rows(keys, values, k, v, e)
        if removed:
            gone = fold_removed(gone, e, k)
    return keys, values, gone


class Snapshot:
    """A checkpoint's serving values: ``keys``, ``values`` (float32), ``dense``, manifests.

    ``load=False`` reads the manifests only (the arrays stay None).
    """

    def __init__(self, path, warn=None, load=True):
        self.path = resolve(path, warn)
        self.elements = chain_manifests(self.path)
        self.manifest = self.elements[-1][1]
        check_elements(self.elements)
        self.dim = self.manifest["embedding_dim"]
        self.keys = self.values = self.dense = None
        if load:
            self.keys, self.values, _ = read_changes(self.elements, self.dim, removed=False)
            self.dense = dense_values(*self.elements[-1])

    @property
    def name(self):
        return os.path.basename(os.path.normpath(self.path))

    def lineage(self):
        """Identity of the chain's base: its name and creation time."""
        d, m = self.elements[0]
        return f"{os.path.basename(os.path.normpath(d))}@{m['created']:.6f}"


# ------------------------------------------------------------------ settings
def data_settings(manifest, stats=""):
    """How the predictor must parse: format, hash_bucket and the resolved normalisation.

    The normalisation is the values the checkpoint recorded from its run's ``--stats``
    (a version 1 checkpoint: that file as it reads now), else Paddle's constants (Criteo),
    one pair per dense value of the stored schema; None for a schema with no min-max
    dense value.  ``stats`` names a statistics file to use instead; it must hold the
    recorded values (a checkpoint that recorded none takes it as it is)."""
    config = manifest["config"]
    schema = schema_of_manifest(manifest)
    if stats:
        check_compatible(manifest, dict(config, stats=stats), schema=schema,
                         fix="leave --stats out (the checkpoint holds the values it was "
                             "trained with)")
    saved = saved_settings(manifest)["norm"]
    out = {"data_format": config.get("data_format", "auto"),
           "hash_bucket": int(config.get("hash_bucket", 0)), "cont_min": None,
           "cont_diff": None}
    if "minmax" not in schema.dense_options("norm"):
        return out
    if stats or not isinstance(saved, dict):
        path = stats or config.get("stats", "")
        norm = (make_norm(*load_stats(path, schema.n_dense), schema.n_dense) if path
                else make_norm(n_dense=schema.n_dense))
    else:
        norm = make_norm(saved["cont_min"], saved["cont_diff"], schema.n_dense)
    return dict(out, cont_min=norm[0].tolist(), cont_diff=norm[1].tolist())


def model_settings(manifest):
    """The network of a checkpoint manifest: ``model`` (its --model; none saved: dnn),
    ``embedding_dim`` (the table's row width: dim, or dim + 1 for models with w), fc,
    n_params, and ``network``: its {name, text} (one saved before networks were files: the
    built-in file of its name)."""
    cfg = manifest["config"]
    try:
        name, text = stored_network(manifest)
    except ValueError as e:
        raise BundleError(f"bad stored network: {e}") from None
    return {"model": cfg.get("model", "dnn"), "embedding_dim": int(manifest["embedding_dim"]),
            "fc": cfg.get("fc", "400,400,400"), "n_params": int(manifest["n_params"]),
            "network": {"name": name, "text": text}}


def same_model(a, b):
    """Whether two bundles' ``model`` records describe one network (a record written
    before models had names is a dnn's; one before networks were files, its built-in
    file's)."""
    def key(r):
        r = dict({"model": "dnn"}, **r)
        r["network"] = net_digest(stored_network(r)[1])
        return r
    return key(a) == key(b)


# ------------------------------------------------------------------ writing
def write_bundle(path, kind, keys, values, evicted, dense, info, dtype="float32"):
    """Write a bundle/patch file atomically (tmp + fsync + rename); return its manifest."""
    if kind not in KINDS or dtype not in DTYPES:
        raise ValueError(f"kind must be one of {KINDS} and dtype one of {DTYPES}; got "
                         f"{kind!r}, {dtype!r}")
    datasets = {}
    tmp = path + ".tmp"
    with h5py.File(tmp, "w", locking=False) as f:
        sp, dn = f.create_group("sparse"), f.create_group("dense")
        write_whole(sp, "keys", np.asarray(keys, np.int64), datasets)
        write_whole(sp, "values", np.asarray(values).astype(dtype, copy=False), datasets)
        write_whole(sp, "evicted", np.asarray(evicted, np.int64), datasets)
        write_whole(dn, "values", np.asarray(dense, np.float32), datasets)
        manifest = dict(info, format=FORMAT, version=VERSION, kind=kind, dtype=dtype,
                        rows=len(keys), evicted=len(evicted), created=time.time(),
                        datasets=datasets)
        text = json.dumps(manifest, sort_keys=True, allow_nan=False)
        f.attrs[MANIFEST_ATTR] = text
        f.attrs[MANIFEST_ATTR + "_crc32"] = zlib.crc32(text.encode())
    fsync(tmp)
    os.replace(tmp, path)
    fsync(os.path.dirname(os.path.abspath(path)))
    return manifest


def schema_of_manifest(m):
    """The feature schema a checkpoint or bundle manifest stores (none: Criteo's)."""
    try:
        return stored_schema(m)
    except SchemaError as e:
        raise BundleError(f"bad stored schema: {e}") from None


def bundle_info(snap, stats=""):
    """The manifest fields describing the model and where it came from."""
    return {"model": model_settings(snap.manifest),
            "schema": schema_of_manifest(snap.manifest).to_dict(),
            "data": data_settings(snap.manifest, stats),
            "checkpoint": {"name": snap.name, "seq": snap.manifest["seq"],
                           "lineage": snap.lineage(), "meta": snap.manifest["meta"]}}


def export_full(ckpt, out, dtype="float32", stats="", snap=None):
    """Bundle of checkpoint ``ckpt`` (dir or root); returns its manifest."""
    snap = snap or Snapshot(ckpt)
    return write_bundle(out, "full", snap.keys, snap.values, np.empty(0, np.int64), snap.dense,
                        bundle_info(snap, stats), dtype)


def export_patch(ckpt, since, out, dtype="float32", stats=""):
    """Patch from bundle/patch ``since`` (path or its manifest) to checkpoint ``ckpt``.

    The rows changed and ids evicted in the delta checkpoints after the one ``since`` was
    exported from; that checkpoint must be in ``ckpt``'s base..delta chain.
    """
    prev = since if isinstance(since, dict) else read_manifest(since)
    path = resolve(ckpt)
    elements = chain_manifests(path)
    check_elements(elements)
    names = [os.path.basename(os.path.normpath(d)) for d, _ in elements]
    want = prev["checkpoint"]
    base = elements[0]
    lineage = f"{names[0]}@{base[1]['created']:.6f}"
    if want["name"] not in names or want["lineage"] != lineage:
        raise BundleError(f"{path}: cannot patch from {want['name']} ({want['lineage']}): it is "
                          f"not in this checkpoint's chain {names} (a new base was saved); "
                          "export a full bundle instead")
    after = elements[names.index(want["name"]) + 1:]
    m = elements[-1][1]
    keys, values, removed = read_changes(after, m["embedding_dim"])
    info = {"model": model_settings(m), "schema": schema_of_manifest(m).to_dict(),
            "data": data_settings(m, stats),
            "checkpoint": {"name": names[-1], "seq": m["seq"], "lineage": lineage,
                           "meta": m["meta"]},
            "since": {"name": want["name"], "seq": want["seq"]}}
    if not same_model(info["model"], prev["model"]):
        raise BundleError(f"{path}: model {info['model']} differs from {prev['model']} of the "
                          "bundle to patch")
    diff = schema_of_manifest(prev).diff(schema_of_manifest(info))
    if diff:
        raise BundleError(f"{path}: feature schema differs from the bundle to patch: {diff} "
                          "(bundle vs checkpoint)")
    return write_bundle(out, "patch", keys, values, removed, dense_values(*elements[-1]), info,
                        dtype)


# ------------------------------------------------------------------ reading
def _open(path):
    if not os.path.isfile(path):
        raise BundleError(f"{path}: no such bundle file")
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        raise BundleError(f"{path}: not a readable bundle (truncated or corrupted HDF5: {e})") \
            from None
    try:
        text = f.attrs[MANIFEST_ATTR]
        if zlib.crc32(text.encode()) != int(f.attrs[MANIFEST_ATTR + "_crc32"]):
            raise ValueError("checksum mismatch (the file is corrupted)")
        m = json.loads(text)
    except (KeyError, OSError, TypeError, ValueError, AttributeError) as e:
        f.close()
        raise BundleError(f"{path}: no valid bundle manifest ({type(e).__name__}: {e})") from None
    return f, m


def _check(path, m):
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and m.get("kind") in KINDS
          and m.get("dtype") in DTYPES and isinstance(m.get("datasets"), dict)
          and all(k in m for k in ("model", "data", "checkpoint", "rows", "evicted")))
    if not ok:
        raise BundleError(f"{path}: not an {FORMAT} file (bad manifest)")
    if m.get("version") != VERSION:
        raise BundleError(f"{path}: bundle version {m.get('version')!r}; this mpips reads "
                          f"version {VERSION}")
    if m["kind"] == "patch" and not isinstance(m.get("since"), dict):
        raise BundleError(f"{path}: a patch must name the bundle it applies to ('since')")


def read_manifest(path):
    """The validated manifest of a bundle or patch file (no data read)."""
    f, m = _open(path)
    f.close()
    _check(path, m)
    return m


def _bundle_schema(m):
    dim, n_params = m["model"]["embedding_dim"], m["model"]["n_params"]
    return {"sparse/keys": (np.dtype(np.int64), lambda e: (e["rows"],)),
            "sparse/values": (np.dtype(m["dtype"]), lambda e: (e["rows"], dim)),
            "sparse/evicted": (np.dtype(np.int64), lambda e: (e["evicted"],)),
            "dense/values": (np.dtype(np.float32), lambda e: (n_params,))}


def read_bundle(path):
    """(manifest, {dataset: array}) of a bundle or patch, every dataset CRC-checked."""
    m = read_manifest(path)
    entry = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
             "rows": m["rows"], "evicted": m["evicted"],
             "dense_size": m["model"]["n_params"], "datasets": m["datasets"]}
    try:
        shard = Shard(os.path.dirname(os.path.abspath(path)), entry, _bundle_schema(m))
        try:
            arrays = {name: shard.read(name) for name in DATASETS}
        finally:
            shard.close()
    except CheckpointError as e:
        raise BundleError(str(e)) from None
    return m, arrays


def crc_of_file(path):
    """CRC-32 of a whole file (the export folder's manifest records it)."""
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc
