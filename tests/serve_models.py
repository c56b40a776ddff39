"""Small serving models made in a second, for the server's tests and bench/bench_serve.py.

A model is random weights over the ids of given lines (so most lookups hit a row), written
with the bundle writer (``mpips.serving.bundle.write_bundle``); an export folder gets a full
bundle, patches (changed rows, evicted ids, a new dense vector) and its index in the
format ``mpips.serving.exports`` reads.  Scores are then compared with ``Predictor`` on the
same files: where the weights come from does not matter to that comparison.
"""
import json
import os

import numpy as np

from mpips.data.criteo import make_norm
from mpips.models.zoo import make_net
from mpips.data import parsers
from mpips.schema import Schema
from mpips.serving import bundle as bd
from mpips.serving import exports
from mpips.serving.predictor import line_parser, parse_lines

LINEAGE = "ckpt-000001-base@1.000000"


def ids_of(lines, schema, data, header=None):
    """The unique ids the lines' values hash to (the training parsers)."""
    if schema.is_criteo:
        _, ids, _ = parse_lines(lines, data)
        return np.unique(ids)
    piece, _ = parsers.parse_lines(lines, line_parser(_Shim(schema, data), header))
    return np.unique(piece[1])


class _Shim:
    """What ``line_parser`` reads of a model: its schema and data settings."""

    def __init__(self, schema, data):
        self.schema, self.data = schema, data


def info(schema, data, dim, fc, seq, since=None, model="dnn"):
    net = make_net(model, schema, dim, tuple(int(x) for x in fc.split(",")))
    rec = {"model": {"model": model, "embedding_dim": dim, "fc": fc, "n_params": net.n_params},
           "schema": schema.to_dict(), "data": data,
           "checkpoint": {"name": f"ckpt-{seq:06d}-{'base' if since is None else 'delta'}",
                          "seq": seq, "lineage": LINEAGE, "meta": {}}}
    if since is not None:
        rec["since"] = {"name": since["checkpoint"]["name"], "seq": since["checkpoint"]["seq"]}
    return rec, net.n_params


def criteo_data():
    lo, diff = make_norm()
    return {"data_format": "auto", "hash_bucket": 0, "cont_min": lo.tolist(),
            "cont_diff": diff.tolist()}


def write_full(path, keys, schema, data, dim=4, fc="16,8", seed=0, seq=1):
    rng = np.random.default_rng(seed)
    rec, n_params = info(schema, data, dim, fc, seq)
    values = rng.normal(0, 0.5, (len(keys), dim)).astype(np.float32)
    dense = rng.normal(0, 0.3, n_params).astype(np.float32)
    return bd.write_bundle(path, "full", keys, values, np.empty(0, np.int64), dense, rec)


def write_patch(path, prev, keys, seed, seq, frac=0.3, evict=0.05):
    """A patch after manifest ``prev``: new rows for a part of ``keys``, some evicted."""
    rng = np.random.default_rng(seed)
    m = prev["model"]
    rec, n_params = info(bd.schema_of_manifest(prev), prev["data"], m["embedding_dim"], m["fc"],
                         seq, since=prev, model=m["model"])
    pick = rng.random(len(keys))
    changed = keys[pick < frac]
    evicted = keys[pick > 1 - evict]
    values = rng.normal(0, 0.5, (len(changed), m["embedding_dim"])).astype(np.float32)
    dense = rng.normal(0, 0.3, n_params).astype(np.float32)
    return bd.write_bundle(path, "patch", changed, values, evicted, dense, rec)


def entry(folder, name, source=None):
    """The index entry of file ``name`` of ``folder`` (size and CRC of ``source`` if given:
    the file that should have been there, a test's way to commit a corrupted one)."""
    path = source or os.path.join(folder, name)
    m = bd.read_manifest(path)
    return {"file": name, "kind": m["kind"], "checkpoint": m["checkpoint"]["name"],
            "seq": m["checkpoint"]["seq"], "lineage": m["checkpoint"]["lineage"],
            "bytes": os.path.getsize(path), "crc32": bd.crc_of_file(path)}


def write_index(folder, entries):
    """Commit ``entries`` as ``folder``'s index (tmp + rename, as the export does)."""
    tmp = os.path.join(folder, exports.INDEX + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": exports.FORMAT, "version": exports.VERSION, "entries": entries}, fh)
    os.replace(tmp, os.path.join(folder, exports.INDEX))


def commit(folder, files, source=None):
    """Write ``folder``'s index listing ``files`` (names, in order); ``source`` {name:
    path}: take that entry's size and CRC from another file (see ``entry``)."""
    write_index(folder, [entry(folder, f, (source or {}).get(f)) for f in files])


def criteo_lines(n, seed=0):
    """n Criteo TSV lines with labels: some empty fields, ids from small vocabularies."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dense = ["" if rng.random() < 0.1 else str(int(rng.integers(0, 50))) for _ in range(13)]
        sparse = ["" if rng.random() < 0.05 else f"{int(rng.integers(0, 40)) * 7919 + k:08x}"
                  for k in range(26)]
        out.append("\t".join([str(int(rng.random() < 0.3))] + dense + sparse))
    return out


def criteo_schema():
    return Schema.criteo()
