"""HDF5 checkpoints: round trips, base + deltas, re-sharding, partial saves, kill -9, corruption."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from mpips import checkpoint as ck
from mpips.checkpoint.manifest import seal
from mpips.checkpoint.compat import check_compatible
from mpips.config import Config
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.tables.ownership import dense_bounds, owners

DIM, P = 4, 37
OPT = OptimizerConfig(name="adam", lr=0.05)
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def new_tables(opt=OPT, dim=DIM, size=P, capacity=16):
    return SparseTable(dim, opt, seed=7, capacity=capacity), DenseTable(np.zeros(size), opt)


def train(sparse, dense, keys, seed, scale=1.0):
    """One optimizer step on unique ``keys`` and on the dense vector."""
    rng = np.random.default_rng(seed)
    keys = np.unique(np.asarray(keys, np.int64))
    sparse.push(keys, rng.standard_normal((len(keys), sparse.dim)).astype(np.float32), scale)
    dense.push(rng.standard_normal(len(dense)).astype(np.float32))


def rows_by_key(sparse, skip=("dirty",)):
    data = sparse.export_rows()
    order = np.argsort(data["keys"])
    return {k: v[order] for k, v in data.items() if k not in skip}


def assert_same(a, b, fields=None):
    ra, rb = rows_by_key(a), rows_by_key(b)
    for f in fields or ra:
        np.testing.assert_array_equal(ra[f], rb[f], err_msg=f)


def trained(seed=0, n=500):
    sparse, dense = new_tables()
    dense.import_state({"values": np.random.default_rng(seed).standard_normal(P)})
    keys = np.random.default_rng(seed).integers(-2**62, 2**62, n)
    for step in range(3):
        train(sparse, dense, keys[step * 100:step * 100 + 300], seed + step)
    return sparse, dense, keys


def test_full_round_trip_then_identical_training(tmp_path):
    sparse, dense, keys = trained()
    cfg = Config(embedding_dim=DIM, fc="3", lr=0.05)
    path = ck.save_local(str(tmp_path), sparse, dense, "full", config=cfg,
                         meta={"epoch": 2, "step": 17, "pass": "day_1/hour_03", "pos": [1, 2]})
    assert os.path.basename(path) == "ckpt-000001-full"
    assert len(sparse.dirty_rows()) == len(sparse)             # full keeps change tracking
    s2, d2 = new_tables()
    m = ck.load_local(str(tmp_path), s2, d2)
    assert m["meta"] == {"epoch": 2, "step": 17, "pass": "day_1/hour_03", "pos": [1, 2]}
    assert m["config"] == json.loads(cfg.to_json()) == ck.load_config(str(tmp_path))
    assert_same(sparse, s2)
    for k, v in dense.export_state().items():
        np.testing.assert_array_equal(v, d2.export_state()[k], err_msg=k)
    assert len(s2.dirty_rows()) == 0 and len(s2.evicted_keys()) == 0
    for tables in ((sparse, dense), (s2, d2)):          # continue: same results, bit for bit
        train(*tables, keys[250:450], seed=99)
    assert_same(sparse, s2)
    np.testing.assert_array_equal(dense.export_state()["m"], d2.export_state()["m"])


def split(sparse, dense, n_servers):
    """The tables of one process cut into n_servers shards (ids by owner, dense by slice)."""
    data = sparse.export_rows()
    own = owners(data["keys"], n_servers)
    bounds = dense_bounds(len(dense), n_servers)
    state = dense.export_state()
    out = []
    for s in range(n_servers):
        sp, _ = new_tables()
        sp.import_rows({k: v[own == s] for k, v in data.items()})
        lo, hi = bounds[s], bounds[s + 1]
        dn = DenseTable(np.zeros(hi - lo), OPT)
        dn.import_state({k: (v[lo:hi] if k in ("values", "m", "v") else v) for k, v in state.items()})
        out.append((sp, dn, lo))
    return out


def save_sharded(root, shards, mode, meta=None):
    d = ck.new_checkpoint_dir(root, mode)
    infos = [ck.save_shard(d, i, len(shards), sp, dn, lo, mode)
             for i, (sp, dn, lo) in enumerate(shards)]
    ck.write_manifest(d, {"shards": infos[::-1], "meta": meta})
    return d


def push_owned(sp, server, keys, seed):
    """Push random gradients to the ids of ``keys`` that ``server`` (of 2) owns."""
    keys = np.unique(np.asarray(keys, np.int64))
    keys = keys[owners(keys, 2) == server]
    sp.push(keys, np.random.default_rng(seed).standard_normal((len(keys), sp.dim)).astype(np.float32))


def test_base_and_deltas_equal_a_full_save(tmp_path):
    sparse, dense, keys = trained(seed=1)
    shards = split(sparse, dense, 2)
    root = str(tmp_path / "ck")
    save_sharded(root, shards, "base")
    new_ids = np.arange(10, 60, dtype=np.int64)
    for i, (sp, dn, _) in enumerate(shards):       # pushes to old rows and new ids
        push_owned(sp, i, np.concatenate([keys[:40], new_ids]), i)
        sp.shrink(0)                               # all seen: nothing evicted yet
    save_sharded(root, shards, "delta")
    for i, (sp, dn, _) in enumerate(shards):
        push_owned(sp, i, keys[20:120], 10 + i)
        assert sp.shrink(1) == 0                   # the others age to unseen=1
        pulled = np.unique(keys[110:130])
        pulled = pulled[owners(pulled, 2) == i]     # seen (and counted) without a push
        sp.pull(pulled, np.empty((len(pulled), DIM), np.float32), create=True)
    save_sharded(root, shards, "delta")
    for i, (sp, dn, _) in enumerate(shards):
        push_owned(sp, i, keys[20:60], 20 + i)
        assert sp.shrink(1) > 0                    # ids outside keys[20:130] are evicted
        assert sp.shrink(3) == 0                   # two shrinks between saves: all age again
        push_owned(sp, i, np.concatenate([keys[:5], new_ids[:3], [999]]), 30 + i)
        dn.push(np.ones(len(dn), np.float32))
    full = save_sharded(root, shards, "full")      # full first: it leaves tracking alone
    last = save_sharded(root, shards, "delta")
    assert [os.path.basename(p) for p in ck.chain(last)] == [
        "ckpt-000001-base", "ckpt-000002-delta", "ckpt-000003-delta", "ckpt-000005-delta"]
    evicted = ck.read_manifest(last)["shards"]
    assert sum(e["evicted"] for e in evicted) > 0
    assert sum(e["rows"] for e in evicted) < len(shards[0][0]) + len(shards[1][0])
    assert_chain_equals_full(last, full, len(shards[0][0]) + len(shards[1][0]))
    for i, (sp, dn, _) in enumerate(shards):       # re-create ids evicted by an older delta
        push_owned(sp, i, keys[5:8], 40 + i)
    full = save_sharded(root, shards, "full")
    last = save_sharded(root, shards, "delta")
    assert len(ck.chain(last)) == 5
    assert_chain_equals_full(last, full, len(shards[0][0]) + len(shards[1][0]))


def assert_chain_equals_full(last, full, n_rows):
    a, da = new_tables()
    b, db = new_tables()
    ck.load_shard_into(last, a, da, 0, 1, [0, P])
    ck.load_shard_into(full, b, db, 0, 1, [0, P])
    assert len(a) == len(b) == n_rows
    assert sorted(rows_by_key(a)) == ["beta1_pow", "beta2_pow", "keys", "m", "seen_count",
                                      "seen_flag", "unseen", "v", "values"]
    assert_same(a, b)                              # every field, ageing included
    for k, v in db.export_state().items():
        np.testing.assert_array_equal(da.export_state()[k], v, err_msg=k)


@pytest.mark.parametrize("n_new", [3, 1])
def test_reshard_two_servers_into_n(tmp_path, n_new):
    sparse, dense, _ = trained(seed=2)
    path = save_sharded(str(tmp_path), split(sparse, dense, 2), "full")
    bounds = dense_bounds(P, n_new)
    seen, parts = [], []
    for s in range(n_new):
        sp, dn = new_tables(size=bounds[s + 1] - bounds[s])
        ck.load_shard_into(path, sp, dn, s, n_new, bounds)
        got = sp.export_rows()
        assert (owners(got["keys"], n_new) == s).all()
        seen.append(got["keys"])
        parts.append(dn.export_state())
    allk = np.concatenate(seen)
    assert len(allk) == len(np.unique(allk)) == len(sparse)     # each id once, none lost
    merged, _ = new_tables()
    for s in range(n_new):
        sp, dn = new_tables(size=bounds[s + 1] - bounds[s])
        ck.load_shard_into(path, sp, dn, s, n_new, bounds)
        merged.import_rows({k: v for k, v in sp.export_rows().items()})
    assert_same(sparse, merged, ["keys", "values", "m", "v", "beta1_pow", "unseen", "seen_count"])
    want = dense.export_state()
    for k in ("values", "m", "v"):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), want[k])
    assert all(p["beta1_pow"] == want["beta1_pow"] for p in parts)


def test_partial_checkpoint_ignored_and_refused(tmp_path):
    sparse, dense, _ = trained()
    good = ck.save_local(str(tmp_path), sparse, dense, "base")
    part = ck.new_checkpoint_dir(str(tmp_path), "full")
    ck.save_shard(part, 0, 1, sparse, dense, 0, "full")          # no manifest: never committed
    warned = []
    assert ck.latest(str(tmp_path), warn=warned.append) == good
    assert len(warned) == 1 and "partial checkpoint" in warned[0] and "000002" in warned[0]
    assert [c["valid"] for c in ck.list_checkpoints(str(tmp_path))] == [True, False]
    with pytest.raises(ck.CheckpointError, match="partial checkpoint .*ckpt-000002-full"):
        ck.load_local(part, *new_tables())
    assert ck.new_checkpoint_dir(str(tmp_path), "delta").endswith("ckpt-000003-delta")
    assert ck.latest(str(tmp_path / "nothing")) is None


KILL_SCRIPT = r"""
import os, sys, threading
import numpy as np
from mpips import checkpoint as ck
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
root, marker, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
opt = OptimizerConfig("adam")
sp = SparseTable(10, opt, seed=1, capacity=n)
keys = np.arange(n, dtype=np.int64) * 7919 + 1
sp.pull(keys, np.empty((n, 10), np.float32), create=True)
export, calls = sp.export_rows, [0]
def export_then_mark(rows=None):
    calls[0] += 1
    if calls[0] == 4:            # template + 2 chunks of rows are in the file
        open(marker, "w").close()
        threading.Event().wait()  # stay mid-save until SIGKILL
    return export(rows)
sp.export_rows = export_then_mark
ck.save_local(root, sp, DenseTable(np.zeros(5), opt), "full")
"""


def test_kill_9_during_save_keeps_previous(tmp_path):
    sparse, dense = new_tables(size=5, dim=10)
    train(sparse, dense, np.arange(100), 0)
    root = str(tmp_path / "ck")
    prev = ck.save_local(root, sparse, dense, "base", meta={"step": 1})
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, root, str(marker), "2000000"],
                            env=dict(os.environ, PYTHONPATH=ROOT_DIR), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the saving process never started writing"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    partial = os.path.join(root, "ckpt-000002-full")
    assert os.listdir(partial) == ["shard-00000-of-00001.h5.tmp"]
    assert os.path.getsize(os.path.join(partial, "shard-00000-of-00001.h5.tmp")) > 10 << 20
    warned = []
    assert ck.latest(root, warn=warned.append) == prev and "ckpt-000002-full" in warned[0]
    s2, d2 = new_tables(size=5, dim=10)
    assert ck.load_local(root, s2, d2)["meta"] == {"step": 1}
    assert_same(sparse, s2)


# ---------------------------------------------------------------- bad checkpoints
@pytest.fixture
def saved(tmp_path):
    sparse, dense, _ = trained(seed=3)
    path = ck.save_local(str(tmp_path), sparse, dense, "base", config=Config(embedding_dim=DIM, fc="3"))
    return path, os.path.join(path, ck.shard_name(0, 1))


def _edit_manifest(path, fn, reseal=True):
    """Edit a manifest as a consistent but wrong writer would, its checksum recomputed (so
    the checks behind the seal are reached); ``reseal=False``: an edit by hand."""
    mpath = os.path.join(path, ck.MANIFEST)
    with open(mpath) as fh:
        m = json.load(fh)
    fn(m)
    with open(mpath, "w") as fh:
        json.dump(seal(m) if reseal else m, fh)


def _replace_dataset(path, shard, name, arr, **kw):
    """Rewrite one dataset and make the manifest agree (a consistent but wrong writer)."""
    with h5py.File(shard, "r+") as f:
        del f[name]
        f.create_dataset(name, data=arr, **kw)

    def fix(m):
        m["shards"][0]["bytes"] = os.path.getsize(shard)
        m["shards"][0]["datasets"][name] = {"shape": list(arr.shape), "dtype": arr.dtype.name,
                                            "crc32": 0}
    _edit_manifest(path, fix)


def _load(path, **kw):
    sp, dn = new_tables(**kw)
    ck.load_local(path, sp, dn)


def test_truncated_file(saved):
    path, shard = saved
    size = os.path.getsize(shard)
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(ck.CheckpointError, match=r"shard-00000-of-00001.h5: file is \d+ bytes, "
                       r"MANIFEST.json says \d+ \(truncated"):
        _load(path)
    _edit_manifest(path, lambda m: m["shards"][0].update(bytes=size // 2))
    with pytest.raises(ck.CheckpointError, match=r"\.h5: claims 500 rows, 0 evicted ids and "
                       r"37 dense values \(\d+ bytes\) but the file holds \d+ bytes"):
        _load(path)
    with open(shard, "r+b") as fh:          # cut only the tail, and a manifest that agrees
        fh.truncate(size // 2 + size // 4)
    _edit_manifest(path, lambda m: m["shards"][0].update(bytes=size // 2 + size // 4))
    with pytest.raises(ck.CheckpointError, match=r"\.h5: corrupted or unreadable HDF5 file "
                       r"\(OSError: .*truncated"):
        _load(path)


def test_flipped_byte_fails_checksum(saved):
    path, shard = saved
    with h5py.File(shard, "r") as f:
        off = f["sparse/m"].id.get_offset() + 13
    with open(shard, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ck.CheckpointError, match=r"\.h5: checksum mismatch in dataset sparse/m"):
        _load(path)


def test_wrong_dtype_and_shape(saved, tmp_path):
    path, shard = saved
    backup, third = str(tmp_path / "copy"), str(tmp_path / "third")
    shutil.copytree(path, backup)
    shutil.copytree(path, third)
    with h5py.File(shard, "r") as f:
        values = f["sparse/values"][()]
    _replace_dataset(path, shard, "sparse/values", values.astype(np.float64))
    with pytest.raises(ck.CheckpointError, match=r"sparse/values is float64 \[\d+, 4\]; expected float32"):
        _load(path)
    shard2 = os.path.join(backup, ck.shard_name(0, 1))
    _replace_dataset(backup, shard2, "sparse/values", values[:, :3].copy())
    with pytest.raises(ck.CheckpointError, match=r"sparse/values is float32 \[\d+, 3\]; expected float32 \[\d+, 4\]"):
        _load(backup)
    shard3 = os.path.join(third, ck.shard_name(0, 1))
    with h5py.File(shard3, "r+") as f:     # the file disagrees with its manifest
        del f["sparse/keys"]
        f.create_dataset("sparse/keys", data=np.zeros(3, np.int64))
    _edit_manifest(third, lambda m: m["shards"][0].update(bytes=os.path.getsize(shard3)))
    with pytest.raises(ck.CheckpointError, match=r"dataset sparse/keys is int64 \[3\]; "
                       r"MANIFEST.json says int64 \[500\]"):
        _load(third)


def test_absurd_sizes(saved):
    path, shard = saved
    huge = 10 ** 15
    with h5py.File(shard, "r+") as f:      # a header claiming 10^15 rows (never allocated)
        del f["sparse/keys"]
        f.create_dataset("sparse/keys", shape=(huge,), dtype=np.int64, chunks=(1024,))
    _edit_manifest(path, lambda m: m["shards"][0].update(bytes=os.path.getsize(shard)))
    with pytest.raises(ck.CheckpointError, match=r"\.h5: dataset sparse/keys is int64 "
                       r"\[1000000000000000\]; MANIFEST.json says int64 \[500\]"):
        _load(path)

    def claim(m):
        sh = m["shards"][0]
        sh["bytes"] = os.path.getsize(shard)
        sh["rows"] = huge
        for d in sh["datasets"].values():
            if d["shape"] and d["shape"][0] == m["rows"]:
                d["shape"][0] = huge
    _edit_manifest(path, claim)
    with pytest.raises(ck.CheckpointError, match=r"\.h5: claims 1000000000000000 rows, .* but the file holds \d+ bytes"):
        _load(path)


def test_missing_shard_file(saved):
    path, shard = saved
    os.remove(shard)
    with pytest.raises(ck.CheckpointError, match="shard-00000-of-00001.h5: shard file listed in MANIFEST.json is missing"):
        _load(path)


def test_delta_without_base(tmp_path):
    sparse, dense, keys = trained()
    root = str(tmp_path)
    with pytest.raises(ck.CheckpointError, match="save mode 'base' first"):
        ck.new_checkpoint_dir(root, "delta")
    base = ck.save_local(root, sparse, dense, "base")
    train(sparse, dense, keys[:10], 5)
    ck.save_local(root, sparse, dense, "delta")
    delta = ck.save_local(root, sparse, dense, "delta")
    os.remove(os.path.join(base, ck.MANIFEST))
    with pytest.raises(ck.CheckpointError, match="ckpt-000002-delta needs its base ckpt-000001-base: partial"):
        _load(delta)
    shutil.rmtree(base)
    with pytest.raises(ck.CheckpointError, match="needs its base ckpt-000001-base: .*no such"):
        _load(delta)
    assert ck.latest(root, lambda msg: None) is None      # nothing in root loads any more


def test_latest_falls_back_past_a_broken_chain(tmp_path):
    """Auto-resume takes the newest checkpoint that loads: not a delta whose base was
    deleted, nor one with a truncated shard file."""
    sparse, dense, keys = trained()
    root = str(tmp_path)
    full = ck.save_local(root, sparse, dense, "full")
    base = ck.save_local(root, sparse, dense, "base")
    train(sparse, dense, keys[:10], 5)
    delta = ck.save_local(root, sparse, dense, "delta")
    assert ck.latest(root) == delta
    shard = os.path.join(delta, ck.shard_name(0, 1))
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) - 1)
    warned = []
    assert ck.latest(root, warned.append) == base and "(truncated or overwritten)" in warned[0]
    shutil.rmtree(base)
    warned = []
    assert ck.latest(root, warned.append) == full and len(warned) == 1
    assert "needs its base ckpt-000002-base" in warned[0]
    assert ck.resolve(root, warned.append) == full
    _load(root)


def test_mismatched_config(saved):
    path, _ = saved
    m = ck.read_manifest(path)
    check_compatible(m, Config(embedding_dim=DIM, fc="3"))
    for cfg, flag in ((Config(embedding_dim=8, fc="3"), "--embedding-dim 4; this run has --embedding-dim 8"),
                      (Config(embedding_dim=DIM, fc="3,2"), "--fc 3; this run has --fc 3,2"),
                      (Config(embedding_dim=DIM, fc="3", optimizer="sgd"), "--optimizer adam; this run")):
        with pytest.raises(ck.CheckpointError, match=flag):
            check_compatible(m, cfg)
    with pytest.raises(ck.CheckpointError, match="saved with embedding_dim 4; the table has dim 8"):
        _load(path, dim=8)
    with pytest.raises(ck.CheckpointError, match="optimizer adam; the tables use adagrad"):
        _load(path, opt=OptimizerConfig(name="adagrad"))
    with pytest.raises(ck.CheckpointError, match=f"holds {P} dense parameters; the model has 40"):
        ck.load_shard_into(path, *new_tables(size=40), 0, 1, [0, 40])


def test_bad_manifest_json(saved):
    path, _ = saved
    with open(os.path.join(path, ck.MANIFEST), "w") as fh:
        fh.write('{"format": "mpips-checkpoint", "vers')
    with pytest.raises(ck.CheckpointError, match="unreadable MANIFEST.json"):
        _load(path)
