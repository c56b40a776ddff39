"""Checkpoint directories and manifests: naming, discovery, validation, atomic commit.

A checkpoint directory ``ROOT/ckpt-<seq>-<mode>`` is committed by its ``MANIFEST.json``,
written last and atomically (:func:`write_manifest`); :func:`read_manifest` validates one
and :func:`chain` walks a delta back to its base (``mpips.checkpoint.load`` chooses which
one to load).  The package docstring (``mpips.checkpoint``) has the layout.

A manifest is sealed: its ``checksum`` field is the SHA-256 of its canonical JSON without
that field, so an edited or damaged manifest is refused (it is not a signature: whoever
recomputes the checksum can forge one).  Its ``settings`` record what the run's numbers
mean beyond its config: the feature-id hashing and the normalisation statistics' values.
Version 1 manifests (before the seal) still load, with a one-line note.
"""
import copy
import hashlib
import json
import os
import re
import sys
import time

from mpips.data.binary import load_stats
from mpips.data.criteo import ID_HASH
from mpips.models.spec import digest as net_digest
from mpips.schema import Schema, SchemaError

FORMAT = "mpips-checkpoint"
VERSION = 2                            # 2: sealed ("checksum") and with "settings"
LEGACY_VERSIONS = (1,)                 # read unsealed, with a note
CHECKSUM = "checksum"
MODES = ("full", "base", "delta")      # Paddle save_persistables mode 0, 1, 2
MANIFEST = "MANIFEST.json"
SKIPPED_FIELDS = ("dirty",)            # save tracking, meaningless inside a checkpoint
OPTIONAL_ENTRY_KEYS = ("shrinks",            # shrink calls since the parent (default 0)
                       "admission_rows",     # rows of /admission/ (absent: no admission data)
                       "admission_evicted")
_DIR_RE = re.compile(r"^ckpt-(\d{6,})-(full|base|delta)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, partial, corrupted or does not fit the tables."""


def stderr_warn(msg):
    print(f"mpips.checkpoint: {msg}", file=sys.stderr, flush=True)


def shard_name(server_id, n_servers):
    return f"shard-{server_id:05d}-of-{n_servers:05d}.h5"


def check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"checkpoint mode must be one of {', '.join(MODES)}; got {mode!r}")


def fsync(path):
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


def new_checkpoint_dir(root, mode, parent=None):
    """Create and return ``ROOT/ckpt-<next seq>-<mode>`` (one rank calls this).

    A delta needs a committed base or delta in ``root`` to be its parent: ``parent`` (a
    directory name), by default the newest one.
    """
    check_mode(mode)
    os.makedirs(root, exist_ok=True)
    if mode == "delta" and parent is not None:
        pm = read_manifest(os.path.join(root, parent))
        if pm["mode"] not in ("base", "delta"):
            raise CheckpointError(f"cannot save a delta on {parent}: a {pm['mode']} save")
    elif mode == "delta" and _auto_parent(root, None) is None:
        raise CheckpointError(f"cannot save a delta in {root}: it holds no committed base "
                              "or delta to be its parent (save mode 'base' first)")
    while True:
        seqs = [s for s, _, _ in _scan(root)]
        path = os.path.join(root, f"ckpt-{(max(seqs) + 1 if seqs else 1):06d}-{mode}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        fsync(root)
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


class Lineage:
    """The parent of the next delta: the checkpoint the tables were loaded from or last
    saved as base/delta, not the newest one in the root (which may belong to an abandoned
    run resumed from an older checkpoint).  With none in ``root`` (a fresh root, a full
    checkpoint, one from another root) a delta is saved as a base instead."""

    def __init__(self, root, loaded=None):
        self.root, self.parent = os.path.normpath(root), None
        self.first = None           # the first checkpoint this run saved (its seq)
        if loaded and os.path.normpath(os.path.dirname(os.path.normpath(loaded))) == self.root:
            if read_manifest(loaded)["mode"] in ("base", "delta"):
                self.parent = os.path.basename(os.path.normpath(loaded))

    def mode(self, mode):
        """The mode to save for a requested one."""
        return "base" if mode == "delta" and self.parent is None else mode

    def saved(self, path, mode):
        if self.first is None:
            self.first = int(_DIR_RE.match(os.path.basename(os.path.normpath(path))).group(1))
        if mode in ("base", "delta"):
            self.parent = os.path.basename(os.path.normpath(path))


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
    for key in OPTIONAL_ENTRY_KEYS:
        _need(key not in sh or (_is_int(sh[key]) and sh[key] >= 0), where,
              f"shard {i}: bad {key!r}")
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


def _check_settings(where, st, schema):
    """``schema``: the manifest's stored schema dict (None: Criteo's)."""
    _need(isinstance(st, dict) and isinstance(st.get("ids"), str), where, "bad settings")
    try:
        n = Schema.from_dict(schema).n_dense
    except (SchemaError, TypeError, ValueError, KeyError):
        n = None                                 # the schema check reports it
    norm = st.get("norm")
    ok = norm is None or (isinstance(norm, dict) and all(
        isinstance(norm.get(k), list) and len(norm[k]) == len(norm["cont_min"]) >= 1
        and (n is None or len(norm[k]) == n)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in norm[k])
        for k in ("cont_min", "cont_diff")))
    _need(ok, where, f"settings.norm must be null or cont_min/cont_diff lists of "
                     f"{n or 'the schema'}'s dense width numbers")


def _check_manifest(path, m):
    where = path
    _need(isinstance(m, dict) and m.get("format") == FORMAT, where, f"format is not {FORMAT}")
    _need(m.get("version") in LEGACY_VERSIONS + (VERSION,), where,
          f"format version {m.get('version')!r}; this mpips reads versions "
          f"{', '.join(map(str, LEGACY_VERSIONS + (VERSION,)))}")
    if m["version"] == VERSION:
        _check_settings(where, m.get("settings"), m.get("schema"))
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
    _need(isinstance(m.get("schema", {}), dict), where, "schema is not an object")
    net = m.get("network", {"name": "", "text": ""})
    _need(isinstance(net, dict) and isinstance(net.get("name"), str)
          and isinstance(net.get("text"), str), where, "network is not {name, text}")
    shards = m.get("shards")
    _need(isinstance(shards, list) and len(shards) == S, where, f"needs {S} shard entries")
    for i, sh in enumerate(shards):
        _check_shard_entry(where, sh, i, S)
    bounds = m.get("dense_bounds")
    want = [sh["dense_lo"] for sh in shards] + [shards[-1]["dense_lo"] + shards[-1]["dense_size"]]
    _need(bounds == want and bounds[0] == 0 and bounds == sorted(bounds)
          and bounds[-1] == m.get("n_params"), where, "dense_bounds do not tile n_params")


_READ = {}          # MANIFEST.json path -> (its stat identity, validated manifest)
_READ_MAX = 4096    # entries kept (a long stream's root holds many checkpoints)


def _read_file(mpath):
    """The one place a MANIFEST.json is read (tests count the calls)."""
    with open(mpath, "rb") as fh:
        return fh.read()


def read_manifest(path):
    """The validated manifest of checkpoint directory ``path`` (CheckpointError if none).

    A manifest is read, its seal hashed and its fields checked once per process: a
    committed MANIFEST.json is never rewritten (a new save is a new directory), so later
    calls get a copy of the first read's result while the file is unchanged (same inode,
    size and times; an edited file is read and checked again)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    mpath = os.path.join(path, MANIFEST)
    try:
        st = os.stat(mpath)
    except FileNotFoundError:
        raise CheckpointError(f"partial checkpoint {path}: no {MANIFEST} (the save did not "
                              "finish); use an earlier checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable {MANIFEST} ({e})") from None
    ident = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    key = os.path.abspath(mpath)
    hit = _READ.get(key)
    if hit is None or hit[0] != ident:
        try:
            m = json.loads(_read_file(mpath).decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable {MANIFEST} ({e})") from None
        _check_seal(path, m)
        _check_manifest(path, m)
        if len(_READ) >= _READ_MAX:
            _READ.clear()
        _READ[key] = hit = (ident, m)
    return copy.deepcopy(hit[1])


def manifest_checksum(m):
    """``sha256:<hex>`` of the manifest's canonical JSON (sorted keys, no spaces), without
    its ``checksum`` field."""
    body = {k: v for k, v in m.items() if k != CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal(m):
    """``m`` (JSON-able) as it reads back from disk, with its checksum set."""
    m = json.loads(json.dumps({k: v for k, v in m.items() if k != CHECKSUM}, allow_nan=False))
    m[CHECKSUM] = manifest_checksum(m)
    return m


_NOTED = set()                # roots whose legacy manifests were noted in this process


def _check_seal(path, m):
    if not isinstance(m, dict) or m.get("version") in LEGACY_VERSIONS and CHECKSUM not in m:
        root = os.path.dirname(os.path.abspath(path))
        if isinstance(m, dict) and root not in _NOTED:          # once per root
            _NOTED.add(root)
            stderr_warn(f"note: {path}: a version {m['version']} {MANIFEST} (written before "
                        "manifests were sealed): read as it is, edits to it cannot be detected")
        return
    try:
        ok = m.get(CHECKSUM) == manifest_checksum(m)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: {MANIFEST} was edited or damaged after it was written "
                              f"(its {CHECKSUM} does not match its contents); restore it, or "
                              "use another checkpoint")


def run_settings(config, schema=None):
    """The manifest's ``settings`` for a run config (dict) with feature ``schema`` (a Schema
    or its dict; None: Criteo's): the id hashing, and the values of its ``--stats``, one
    pair per dense value of the schema (None: the defaults, Paddle's constants or a binary
    set's own; also None when no dense value of the schema is normalised by min-max)."""
    stats = (config or {}).get("stats") or ""
    norm = None
    if stats:
        schema = schema if isinstance(schema, Schema) else Schema.from_dict(schema)
        if "minmax" not in schema.dense_options("norm"):
            return {"ids": ID_HASH, "norm": None}
        try:
            lo, diff = load_stats(stats, schema.n_dense)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read the normalisation statistics --stats {stats} "
                                  f"({e})") from None
        norm = {"cont_min": lo.tolist(), "cont_diff": diff.tolist()}
    return {"ids": ID_HASH, "norm": norm}


UNKNOWN = "unknown"                     # a legacy setting that cannot be recovered


def saved_settings(m):
    """The ``settings`` a checkpoint was saved with.  A version 1 manifest has none: its ids
    are this hashing (unchanged since), its statistics those of its ``--stats`` file if that
    still reads (else UNKNOWN)."""
    if "settings" in m:
        return m["settings"]
    try:
        return run_settings(m.get("config"))
    except CheckpointError:
        return {"ids": ID_HASH, "norm": UNKNOWN}


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
    (a Config, its JSON or a dict), ``schema`` (the feature schema's dict; absent in
    checkpoints written before schemas, which load as Criteo's), ``meta`` (anything JSON: epoch, step, pass, data
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
                                  "dense_size", "datasets") + OPTIONAL_ENTRY_KEYS if k in s}
               for s in shards]
    last = shards[-1]
    end = last["dense_lo"] + last["dense_size"]
    config = _config_dict(info.get("config"))
    manifest = {"format": FORMAT, "version": VERSION, "seq": seq, "mode": mode,
                "parent": parent, "n_servers": S, "n_params": end,
                "dense_bounds": [s["dense_lo"] for s in shards] + [end],
                "embedding_dim": shards[0]["embedding_dim"], "optimizer": shards[0]["optimizer"],
                "rows": sum(s["rows"] for s in shards), "created": time.time(),
                "config": config, "settings": run_settings(config, info.get("schema")),
                "meta": info.get("meta") or {}, "shards": entries}
    if info.get("schema") is not None:
        manifest["schema"] = info["schema"]
    if info.get("network") is not None:       # the network's text and its digest
        manifest["network"] = dict(info["network"])
        manifest["settings"]["network"] = net_digest(info["network"]["text"])
    try:
        manifest = seal(manifest)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt_dir}: meta/config is not JSON-serialisable ({e})") from None
    _check_manifest(ckpt_dir, manifest)
    text = json.dumps(manifest, indent=1, sort_keys=True)
    tmp = os.path.join(ckpt_dir, MANIFEST + ".tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(ckpt_dir, MANIFEST))
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        err = OSError(f"{tmp}: writing the manifest failed: [Errno {e.errno}] {e.strerror}; "
                      f"removed it (not committed: the last committed checkpoint is kept)")
        err.errno = e.errno
        raise err from None
    fsync(ckpt_dir)
    return manifest


def chain(path):
    """Checkpoint directories to load for ``path``, base first (``[path]`` unless a delta)."""
    return [d for d, _ in chain_manifests(path)]


def chain_manifests(path):
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
