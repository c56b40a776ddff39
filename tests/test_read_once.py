"""The run is worked out once: a process reads the --schema TOML once, and each checkpoint's
MANIFEST.json once (read, seal hashed, fields checked), however many parts of the run ask
(config checks, resume, compatibility, loading, the RESUME line, lineage, scoring, export).

Counted over real processes: a --local run that saves, the run resumed from it, infer and
export, each under a wrapper that counts the calls of the one function that reads each file
(``mpips.schema._read_toml``, ``mpips.checkpoint.manifest._read_file``).
"""
import collections
import json
import os

from mpips import checkpoint as ck
from mpips.checkpoint import manifest as mf
from mpips.config import Config
from mpips.schema import SchemaError, load_schema
from tests.conftest import run_cmd
from tests.test_checkpoint import trained

import pytest

COUNTER = """
import collections, json, runpy, sys
import mpips.checkpoint.manifest as mf
import mpips.schema as sc
out, mod = sys.argv[1], sys.argv[2]
counts = collections.Counter()
def counted(fn, name):
    def wrapper(path):
        counts[name + ':' + str(path)] += 1
        return fn(path)
    return wrapper
sc._read_toml = counted(sc._read_toml, 'schema')
mf._read_file = counted(mf._read_file, 'manifest')
sys.argv = [mod] + sys.argv[3:]
try:
    runpy.run_module(mod, run_name='__main__')
except SystemExit as e:
    if e.code:
        raise
finally:
    json.dump(counts, open(out, 'w'))
"""

CRITEO_TOML = """format = "criteo"
label = "label"
[[dense]]
names = [%s]
[[sparse]]
names = [%s]
""" % (", ".join(f'"I{k}"' for k in range(1, 14)), ", ".join(f'"C{k}"' for k in range(1, 27)))


def counted_run(tmp_path, name, module, *args):
    """{(kind, file name relative to tmp_path): reads} of one process running ``module``."""
    out = tmp_path / f"{name}.counts.json"
    proc = run_cmd(["-c", COUNTER, str(out), module, *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = collections.Counter()
    for key, n in json.loads(out.read_text()).items():
        kind, path = key.split(":", 1)
        reads[kind, os.path.relpath(path, tmp_path)] += n
    return reads, proc


def test_schema_and_manifests_are_read_once_per_process(tiny_data, tmp_path):
    train, test = tiny_data
    (tmp_path / "schema.toml").write_text(CRITEO_TOML)
    (tmp_path / "stats.json").write_text(json.dumps({"cont_min": [0.0] * 13,
                                                     "cont_diff": [20.0] * 13}))
    common = ["--local", "--train", train, "--test", test, "--schema", "schema.toml",
              "--stats", "stats.json", "--fc", "8", "--batch-size", "512",
              "--save-dir", "ck", "--save-mode", "delta", "--progress-every", "0",
              "--max-steps", "3"]
    common = [str(tmp_path / a) if a in ("schema.toml", "stats.json", "ck") else a
              for a in common]
    base, delta, delta2 = ("ck/ckpt-000001-base", "ck/ckpt-000002-delta",
                           "ck/ckpt-000003-delta")
    toml = ("schema", "schema.toml")

    reads, _ = counted_run(tmp_path, "first", "mpips.train", *common, "--epochs", "2")
    # the second save (a delta) reads its parent's manifest: the lineage's check
    assert reads == {toml: 1, ("manifest", f"{base}/MANIFEST.json"): 1}

    reads, proc = counted_run(tmp_path, "resumed", "mpips.train", *common, "--epochs", "3",
                              "--resume", str(tmp_path / "ck"))
    assert f"RESUME --> {tmp_path / delta} (after epoch 1)" in proc.stdout
    assert reads == {toml: 1, ("manifest", f"{base}/MANIFEST.json"): 1,
                     ("manifest", f"{delta}/MANIFEST.json"): 1}

    chain = {("manifest", f"{d}/MANIFEST.json"): 1 for d in (base, delta, delta2)}
    reads, _ = counted_run(tmp_path, "infer", "mpips.infer", "--checkpoint",
                           str(tmp_path / "ck"), "--data", test, "--schema",
                           str(tmp_path / "schema.toml"))
    assert reads == {**chain, toml: 1}
    bundle = str(tmp_path / "model.h5")
    reads, _ = counted_run(tmp_path, "export", "mpips.export", "--checkpoint",
                           str(tmp_path / "ck"), "--out", bundle, "--schema",
                           str(tmp_path / "schema.toml"), "--network", "dnn")
    assert reads == {**chain, toml: 1}
    reads, _ = counted_run(tmp_path, "patch", "mpips.export", "--checkpoint",
                           str(tmp_path / delta2), "--since", bundle, "--out",
                           str(tmp_path / "patch.h5"))
    assert reads == chain


def test_an_edited_file_is_read_again(tmp_path, monkeypatch):
    reads = []
    real = mf._read_file

    def counting(path):
        reads.append(path)
        return real(path)
    monkeypatch.setattr(mf, "_read_file", counting)
    root = tmp_path / "ck"
    sparse, dense, _ = trained(seed=3)
    path = ck.save_local(str(root), sparse, dense, "base", config=Config(embedding_dim=4, fc="3"))
    first = mf.read_manifest(path)
    first["meta"]["x"] = 1                      # a caller's copy: the next read is clean
    assert "x" not in mf.read_manifest(path)["meta"]
    assert len(reads) == 1
    text = (root / os.path.basename(path) / "MANIFEST.json").read_text()
    (root / os.path.basename(path) / "MANIFEST.json").write_text(text.replace('"seq": 1',
                                                                              '"seq": 7'))
    with pytest.raises(mf.CheckpointError, match="edited or damaged"):
        mf.read_manifest(path)
    assert len(reads) == 2

    toml = tmp_path / "s.toml"
    toml.write_text('format = "csv"\nlabel = "y"\n[[sparse]]\nnames = ["a"]\n')
    assert load_schema(str(toml)) is load_schema(str(toml))
    toml.write_text('format = "csv"\nlabel = "y"\n[[sparse]]\nnames = ["a", "b"]\n')
    assert load_schema(str(toml)).n_sparse == 2
    toml.write_text('format = "csv"\nlabel = "y"\n[[sparse]]\nnames = ["a", "b"]\nbad = 1\n')
    with pytest.raises(SchemaError, match="unknown key 'bad'"):
        load_schema(str(toml))
