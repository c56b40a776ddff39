"""Writing a checkpoint: each server's shard file, and a one-process save.

A shard file holds ``/sparse/<field>`` per row field, ``/sparse/evicted``,
``/dense/<name>`` and, with admission, ``/admission/<field>``, ``/admission/evicted`` and
``/admission/admitted``, written whole and contiguous, with a CRC-32 per dataset returned for
the manifest (see ``mpips.checkpoint``).
"""
import dataclasses
import errno
import json
import os
import re
import zlib

import h5py
import numpy as np

from mpips.checkpoint.h5io import write_whole
from mpips.checkpoint.manifest import (FORMAT, MANIFEST, MODES, SKIPPED_FIELDS, VERSION,
                                       check_mode, fsync, new_checkpoint_dir, shard_name,
                                       write_manifest)

CHUNK_ROWS = 1 << 18                   # rows per HDF5 write (bounds the extra memory)
DATASET_OVERHEAD = 8 << 10             # bytes of HDF5 headers allowed per dataset
FILE_OVERHEAD = 256 << 10              # and per file (superblock, groups, attributes)


def _tracked(table, mode):
    """(whether only changed rows are saved, their count, evicted ids) of a table in mode."""
    if mode != "delta":
        return False, len(table), np.empty(0, np.int64)
    return True, table.count_rows(True), table.evicted_keys().astype(np.int64)


def _write_rows(group, sparse, dirty_only, n, datasets):
    """Write the fields of the table's n rows (all, or the changed ones) in chunks of at most
    CHUNK_ROWS, as the table yields them (a disk tier streams its rows from disk)."""
    template = sparse.export_rows(np.empty(0, np.int64))
    fields = [f for f in template if f not in SKIPPED_FIELDS]
    dsets = {f: group.create_dataset(f, shape=(n,) + template[f].shape[1:],
                                     dtype=template[f].dtype) for f in fields}
    crcs = dict.fromkeys(fields, 0)
    lo = 0
    for chunk in sparse.iter_rows(dirty_only, CHUNK_ROWS):
        hi = lo + len(chunk["keys"])
        if hi > n:
            raise RuntimeError(f"the table yielded more than the {n} rows it counted")
        for f in fields:
            arr = np.ascontiguousarray(chunk[f])
            dsets[f].write_direct(arr, dest_sel=np.s_[lo:hi])
            crcs[f] = zlib.crc32(arr, crcs[f])
        lo = hi
    if lo != n:
        raise RuntimeError(f"the table yielded {lo} rows; it counted {n}")
    for f in fields:
        datasets[f"{group.name.strip('/')}/{f}"] = {"shape": list(dsets[f].shape),
                                   "dtype": template[f].dtype.name, "crc32": crcs[f]}


def _write_groups(f, sparse, rows, n, evicted, state, datasets):
    """/sparse/ and /dense/ of a shard (in a function of their own: no group or dataset
    object outlives it, so a failed write ends here, not in a later deallocation)."""
    grp = f.create_group("sparse")
    _write_rows(grp, sparse, rows, n, datasets)
    write_whole(grp, "evicted", evicted, datasets)
    dgrp = f.create_group("dense")
    for key, arr in state.items():
        write_whole(dgrp, key, arr, datasets)


def _write_admission(f, counts, c_rows, c_n, c_evicted, admission, datasets):
    agrp = f.create_group("admission")
    _write_rows(agrp, counts, c_rows, c_n, datasets)
    write_whole(agrp, "evicted", c_evicted, datasets)
    write_whole(agrp, "admitted", np.array([admission.admitted], np.int64), datasets)


def _row_bytes(table):
    """Bytes per row of a table's saved fields."""
    template = table.export_rows(np.empty(0, np.int64))
    return sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for f, a in template.items()
               if f not in SKIPPED_FIELDS)


def _shard_bytes(sparse, n, evicted, state, counts, c_n, c_evicted):
    """An upper bound of a shard file's size: its data plus HDF5's headers (about 1 KiB a
    dataset, measured; bounded here by DATASET_OVERHEAD)."""
    data = n * _row_bytes(sparse) + evicted.nbytes + sum(a.nbytes for a in state.values())
    n_sets = len(sparse.export_rows(np.empty(0, np.int64))) + 1 + len(state)
    if counts is not None:
        data += c_n * _row_bytes(counts) + c_evicted.nbytes + 8
        n_sets += len(counts.export_rows(np.empty(0, np.int64))) + 2
    return data + n_sets * DATASET_OVERHEAD + FILE_OVERHEAD


def _reserve(tmp, need):
    """Create ``tmp`` as an empty HDF5 file with ``need`` bytes allocated to it.

    HDF5 does not survive a write that fails for want of space (its objects are left
    half-closed, and freeing them later crashes the process).  So the space is taken
    first, where running out is a plain OSError; the shard is then written into blocks
    the file already owns, and HDF5 cuts the file to its real size when it closes it."""
    st = os.statvfs(os.path.dirname(tmp) or ".")
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the shard needs about "
                      f"{_mib(need)}, {_mib(free)} free")
    with h5py.File(tmp, "w", locking=False):
        pass
    fd = os.open(tmp, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, need)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):   # a file system without it
            raise
    finally:
        os.close(fd)


def _mib(n):
    return f"{n / (1 << 20):.1f} MiB"


def _remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_error(tmp, e):
    """One line for a failed shard write: the path, the errno and what was kept."""
    code = getattr(e, "errno", None)
    if code is None:    # HDF5's RuntimeErrors carry the errno in their text
        found = re.search(r"errno = (\d+)", str(e))
        code = int(found.group(1)) if found else None
    text = getattr(e, "strerror", None) or ""
    if not (code and text.startswith(os.strerror(code))):   # HDF5's text runs over lines
        text = os.strerror(code) if code else " ".join(str(e).split())[:300]
    err = OSError(f"{tmp}: writing the checkpoint shard failed: "
                  f"{f'[Errno {code}] ' if code else ''}{text}; removed it (nothing "
                  f"committed: the last committed checkpoint is kept)")
    err.errno = code or errno.EIO
    return err


def save_shard(ckpt_dir, server_id, n_servers, sparse, dense, dense_lo, mode, admission=None):
    """Write this server's shard file into ``ckpt_dir``; return its entry for the manifest.

    Call on quiesced tables (no push may land during the call).  ``dense_lo`` is the
    offset of ``dense``'s slice in the flat dense vector.  ``admission``: the
    AdmittedTable in front of ``sparse``, whose waiting counts (``/admission/<field>``,
    ``/admission/evicted``) and ``admitted`` counter are saved with the same base/delta
    semantics.  The entry's ``shrinks`` is the number of shrink calls since the last
    base/delta (a delta's loader ages the older rows by it).  base/delta clear the
    tables' change tracking once the file is safely on disk.
    """
    check_mode(mode)
    if not 0 <= server_id < n_servers:
        raise ValueError(f"server_id must be in [0, {n_servers}); got {server_id}")
    name = shard_name(server_id, n_servers)
    final = os.path.join(ckpt_dir, name)
    tmp = final + ".tmp"
    rows, n, evicted = _tracked(sparse, mode)
    counts = admission.counts if admission is not None else None
    opt = dataclasses.asdict(sparse.opt)
    datasets, extra = {}, {"shrinks": int(sparse.shrinks)}
    c_rows, c_n, c_evicted = _tracked(counts, mode) if counts is not None else (None, 0, None)
    state = dense.export_state()
    need = _shard_bytes(sparse, n, evicted, state, counts, c_n, c_evicted)
    try:
        _reserve(tmp, need)
        with h5py.File(tmp, "r+", locking=False) as f:
            f.attrs.update(format=FORMAT, version=VERSION, mode=mode, server_id=server_id,
                           n_servers=n_servers, embedding_dim=sparse.dim, optimizer=opt["name"],
                           rows=n, evicted=len(evicted), dense_lo=int(dense_lo),
                           dense_size=len(dense))
            _write_groups(f, sparse, rows, n, evicted, state, datasets)
            if counts is not None:
                _write_admission(f, counts, c_rows, c_n, c_evicted, admission, datasets)
                extra.update(admission_rows=int(c_n), admission_evicted=len(c_evicted))
        fsync(tmp)
        os.replace(tmp, final)
    except Exception as e:  # noqa: BLE001 - any failure: nothing half-written stays
        _remove(tmp)
        raise _write_error(tmp, e) from None
    fsync(ckpt_dir)
    if mode in ("base", "delta"):
        for table in (sparse, counts):
            if table is not None:
                table.clear_dirty()
                table.clear_evicted()
    return {"file": name, "bytes": os.path.getsize(final), "server_id": int(server_id),
            "n_servers": int(n_servers), "mode": mode, "rows": int(n),
            "evicted": len(evicted), "dense_lo": int(dense_lo), "dense_size": len(dense),
            "embedding_dim": sparse.dim, "optimizer": opt, "datasets": datasets, **extra}


def server_save_hooks(save_dir, server_id, n_servers, sparse, dense, dense_lo,
                      admission=None):
    """(on_save, save_check) for a Server: SAVE seq/mode writes this server's shard of
    ``save_dir/ckpt-<seq>-<mode>``; save_check says why a SAVE is refused (the worker
    creates the directory first, and a committed checkpoint is never written again).
    admission: the AdmittedTable in front of ``sparse`` (its counts are saved too)."""
    def path_of(seq, mode_index):
        return os.path.join(save_dir, f"ckpt-{seq:06d}-{MODES[mode_index]}")

    def on_save(seq, mode_index):
        info = save_shard(path_of(seq, mode_index), server_id, n_servers, sparse, dense,
                          int(dense_lo), MODES[mode_index], admission)
        return json.dumps(info).encode()

    def save_check(seq, mode_index):
        path = path_of(seq, mode_index)
        if seq < 1 or not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST)):
            return f"for {path}: not an uncommitted checkpoint directory"
        return None
    return on_save, save_check


def save_local(root, sparse, dense, mode, config=None, meta=None, admission=None,
               parent=None, schema=None, network=None):
    """Save one process's whole tables as a one-shard checkpoint; return its directory.

    parent: a delta's parent directory name (default: the newest base/delta in root);
    schema: the feature schema as a dict (``Schema.to_dict()``), stored in the manifest;
    network: the network's {name, text} (``mpips.models.zoo.network_record``), likewise.
    """
    d = new_checkpoint_dir(root, mode, parent)
    info = save_shard(d, 0, 1, sparse, dense, 0, mode, admission)
    write_manifest(d, {"shards": [info], "config": config, "meta": meta, "parent": parent,
                       "schema": schema, "network": network})
    return d
