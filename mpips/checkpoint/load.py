"""Choosing and loading a checkpoint: a base..delta chain into any number of servers,
every byte checked.

:func:`latest` / :func:`resolve` choose the checkpoint of a root: the newest whose whole
chain verifies (:func:`verify`: manifests, file sizes, and every dataset's CRC-32).  Every
server then calls :func:`load_shard_into` with its own index and the new server count;
ids are re-assigned by ``owner_of``, so S servers' files load into any S'.  Sizes, shapes,
dtypes and CRC-32s are verified against the manifest again as the rows are read; any
problem raises CheckpointError.  The files themselves are read by ``mpips.checkpoint.h5io``.
"""
import argparse
import os

import numpy as np

from mpips.checkpoint.h5io import Shard, dense_slice, fold_removed, tables_schema
from mpips.config import MODELS
from mpips.checkpoint.manifest import (_DIR_RE, MANIFEST, SKIPPED_FIELDS, CheckpointError,
                                       chain_manifests, list_checkpoints, read_manifest,
                                       stderr_warn)


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
        keys = np.concatenate([s.read(f"{name}/keys") for s in group])
        removed = fold_removed(removed, evicted, keys)
    return removed


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
    schema = tables_schema(sparse, dense, admission)
    tables = [("sparse", sparse)] + ([("admission", admission.counts)] if admission is not None
                                     else [])
    groups = []                           # per element: its shard files this server reads
    try:
        for d, m in elements:
            same = m["n_servers"] == n_servers
            groups.append([Shard(d, e, schema)
                           for e in ([m["shards"][server_id]] if same else m["shards"])])
        d, m = elements[-1]
        state = dense_slice(d, m, schema, dense, bounds[server_id], bounds[server_id + 1])
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
        shard = Shard(ckpt_dir, entry, _listed_schema(entry))
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


# --- mpips.infer / mpips.export: the checkpoint to read (their --checkpoint flag) --------
class _ModelAlias(argparse.Action):
    """``--model`` in infer/export: the old name of ``--checkpoint`` (recorded, to note)."""

    def __call__(self, parser, ns, values, option_string=None):
        ns.checkpoint, ns.model_alias = values, True


def add_checkpoint_option(p):
    """``--checkpoint DIR`` (required), with ``--model`` kept as an alias."""
    p.add_argument("--checkpoint", default="", help="checkpoint directory, or a root holding "
                   "ckpt-* directories (its newest checkpoint whose chain verifies)")
    p.add_argument("--model", action=_ModelAlias, dest="checkpoint", metavar="CHECKPOINT",
                   help="the old name of --checkpoint (in mpips.train --model is the network)")


def checkpoint_arg(p, args, warn):
    """The --checkpoint path; errors (``p.error``) when missing or when ``--model`` names
    a network, and ``warn``s once when the alias was used."""
    if not args.checkpoint:
        p.error("--checkpoint DIR is required (a checkpoint directory or a --save-dir root)")
    if getattr(args, "model_alias", False):
        if args.checkpoint in MODELS:
            p.error(f"--model {args.checkpoint} names a network, but here --model is the old "
                    f"name of --checkpoint: give --checkpoint DIR (the network is stored in "
                    f"the checkpoint; --network {args.checkpoint} checks it)")
        warn(f"{p.prog}: note: --model is the old name of --checkpoint here (in mpips.train "
             f"--model is the network); use --checkpoint {args.checkpoint}")
    return args.checkpoint
