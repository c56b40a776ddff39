"""Export folders: a full bundle after each base checkpoint, a patch after each delta.

Layout of ``--export-dir DIR``::

    DIR/full-000001.h5       bundle of checkpoint ckpt-000001-base
    DIR/patch-000002.h5      patch ckpt-000001-base -> ckpt-000002-delta
    DIR/EXPORTS.json         the index, written last (tmp + rename): it commits a file

The index lists its entries in order (file, kind, checkpoint name, lineage, bytes,
CRC-32 of the whole file).  A file not in the index is not there yet.  When a new full
bundle is committed, files older than the previous full bundle are deleted (a reader
that is still loading one keeps its open file).

:func:`load_latest` builds the newest model (last full bundle + the patches after it);
:func:`catch_up` brings a model forward by patches when it can, else reloads.  Both
check every file against the index before they read it and build the result aside,
so after an error the caller still has its model.
"""
import json
import os

import mpips.serving.bundle as bd
from mpips.checkpoint.load import resolve
from mpips.checkpoint.manifest import fsync, read_manifest
from mpips.serving.model import ServingModel

INDEX = "EXPORTS.json"
FORMAT = "mpips-exports"
VERSION = 1


def read_index(folder):
    """The entries of ``folder``'s index ([] when it has none yet)."""
    path = os.path.join(folder, INDEX)
    if not os.path.exists(path):
        if not os.path.isdir(folder):
            raise bd.BundleError(f"{folder}: no such export folder")
        return []
    try:
        with open(path, "rb") as fh:
            idx = json.loads(fh.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise bd.BundleError(f"{path}: unreadable export index ({e})") from None
    if not (isinstance(idx, dict) and idx.get("format") == FORMAT and idx.get("version") == VERSION
            and isinstance(idx.get("entries"), list)):
        raise bd.BundleError(f"{path}: not an {FORMAT} version {VERSION} index")
    return idx["entries"]


def _write_index(folder, entries):
    path = os.path.join(folder, INDEX)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"format": FORMAT, "version": VERSION, "entries": entries}, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync(folder)


def _prune(folder, entries):
    """Index entries from the previous full bundle on; commit them, then delete the rest."""
    fulls = [i for i, e in enumerate(entries) if e["kind"] == "full"]
    keep = entries[fulls[-2]:] if len(fulls) >= 2 else entries
    _write_index(folder, keep)
    names = {e["file"] for e in keep}
    for e in entries:
        if e["file"] not in names:
            try:
                os.remove(os.path.join(folder, e["file"]))
            except FileNotFoundError:
                pass


def export_checkpoint(folder, ckpt, dtype="float32", stats=""):
    """Export checkpoint ``ckpt`` into ``folder``: a patch after the last export when
    ``ckpt`` continues its chain, else a full bundle.  Returns the new index entry."""
    os.makedirs(folder, exist_ok=True)
    entries = read_index(folder)
    path = resolve(ckpt)
    m = read_manifest(path)
    name = os.path.basename(os.path.normpath(path))
    prev = entries[-1] if entries else None
    out = os.path.join(folder, f"{{}}-{m['seq']:06d}.h5")
    man = None
    if m["mode"] == "delta" and prev is not None:
        try:
            man = bd.export_patch(path, _checked(folder, prev), out.format("patch"), dtype, stats)
        except bd.BundleError:
            man = None                        # not this chain (or unreadable): a full one
    if man is None:
        man = bd.export_full(path, out.format("full"), dtype, stats)
    fname = os.path.basename(out.format(man["kind"]))
    fpath = os.path.join(folder, fname)
    entry = {"file": fname, "kind": man["kind"], "checkpoint": name, "seq": m["seq"],
             "lineage": man["checkpoint"]["lineage"], "bytes": os.path.getsize(fpath),
             "crc32": bd.crc_of_file(fpath)}
    entries = [e for e in entries if e["file"] != fname] + [entry]
    _prune(folder, entries)
    return entry


def _checked(folder, entry):
    """Path of an indexed file after checking its size and CRC against the index."""
    path = os.path.join(folder, entry["file"])
    if not os.path.isfile(path):
        raise bd.BundleError(f"{path}: listed in {INDEX} but missing")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise bd.BundleError(f"{path}: {size} bytes, {INDEX} says {entry['bytes']} (truncated "
                             "or overwritten)")
    if bd.crc_of_file(path) != entry["crc32"]:
        raise bd.BundleError(f"{path}: checksum mismatch with {INDEX} (the file is corrupted)")
    return path


def _apply_all(folder, model, entries):
    for e in entries:
        m, arrays = bd.read_bundle(_checked(folder, e))
        model = ServingModel.from_arrays(m, arrays) if e["kind"] == "full" else \
            model.patched(m, arrays)
    return model


def load_latest(folder):
    """The ServingModel of the newest state in ``folder``."""
    entries = read_index(folder)
    fulls = [i for i, e in enumerate(entries) if e["kind"] == "full"]
    if not fulls:
        raise bd.BundleError(f"{folder}: holds no committed bundle yet ({INDEX} lists none)")
    return _apply_all(folder, None, entries[fulls[-1]:])


def catch_up(folder, model):
    """``model`` brought to the newest state of ``folder`` (itself when it is current)."""
    entries = read_index(folder)
    v = model.version
    pos = next((i for i, e in enumerate(entries) if e["checkpoint"] == v.get("name")
                and e["lineage"] == v.get("lineage")), None)
    if pos is not None:
        later = entries[pos + 1:]
        if not later:
            return model
        if all(e["kind"] == "patch" for e in later):
            return _apply_all(folder, model, later)
    return load_latest(folder)
