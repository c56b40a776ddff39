"""Binary shards: .npy appender, manifests, path resolution, reader round trip, errors."""
import json
import os
import shutil

import numpy as np
import pytest

from data_prep.criteo import prepare, val_mask
from data_prep.synth import generate
from mpips.data import binary
from mpips.data.criteo import CONT_DIFF, CONT_MIN
from mpips.data.files import resolve_paths, split_files
from mpips.data.reader import Batch, DataReader


def concat(batches):
    return Batch(*(np.concatenate(c) for c in zip(*((b.dense, b.sparse, b.label)
                                                        for b in batches))))


def assert_same(a, b):
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.sparse, b.sparse)
    np.testing.assert_array_equal(a.label, b.label)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    generate(str(root / "syn"), rows=3000, parts=2, seed=9)
    prepare(str(root / "syn" / "train"), str(root / "out"), parts=3, val_fraction=0.2,
            seed=1, progress=False)
    return root


@pytest.fixture
def copy(data, tmp_path):
    """A private copy of the train split, free to break."""
    dst = tmp_path / "train"
    shutil.copytree(data / "out" / "train", dst)
    return dst


def test_npy_appender_roundtrip(tmp_path):
    path = str(tmp_path / "a.npy")
    w = binary.NpyAppender(path, np.int32, (13,))
    chunks = [np.arange(13 * k, dtype=np.int32).reshape(k, 13) for k in (0, 3, 1000)]
    for c in chunks:
        w.append(c)
    with pytest.raises(ValueError, match="expected int32"):
        w.append(np.zeros((1, 12), np.int32))
    assert w.close() == 1003
    got = np.load(path, mmap_mode="r")
    assert isinstance(got, np.memmap) and got.shape == (1003, 13)
    np.testing.assert_array_equal(got, np.concatenate(chunks))
    w = binary.NpyAppender(str(tmp_path / "e.npy"), np.int8, ())
    w.close()
    assert np.load(str(tmp_path / "e.npy")).shape == (0,)


def test_resolve_and_split_parts(data):
    out = data / "out"
    parts = resolve_paths(str(out / "train"))
    assert [os.path.basename(p) for p in parts] == ["part-00000", "part-00001", "part-00002"]
    assert resolve_paths(str(out / "train" / "part-00001")) == [str(out / "train" / "part-00001")]
    assert resolve_paths(str(out / "train" / "part-0000[02]")) == [parts[0], parts[2]]
    assert resolve_paths(f"{out}/train,{out}/val")[3:] == resolve_paths(str(out / "val"))
    assert sum((split_files(parts, 2, i) for i in range(2)), []) == parts
    with pytest.raises(FileNotFoundError, match="data_prep output root.*train"):
        resolve_paths(str(out))


def test_roundtrip_equals_tsv_reader(data):
    out = data / "out"
    lo, diff = binary.load_stats(str(out))
    tsv = concat(DataReader(str(data / "syn" / "train"), 4096, cont_min=lo, cont_diff=diff,
                            prefetch=False))
    val = val_mask(1, 0, len(tsv), 0.2)
    for prefetch in (False, True):
        batches = list(DataReader(str(out / "train"), 512, prefetch=prefetch))
        assert [len(b) for b in batches[:-1]] == [512] * (len(batches) - 1)  # spans parts
        got = concat(batches)
        assert_same(got, Batch(tsv.dense[~val], tsv.sparse[~val], tsv.label[~val]))
    assert got.dense.dtype == np.float32 and got.label.dtype == np.float32
    # explicit statistics override the manifest's, as for TSV
    tsv_p = concat(DataReader(str(data / "syn" / "train"), 4096, prefetch=False,
                              cont_min=CONT_MIN, cont_diff=CONT_DIFF))
    got_p = concat(DataReader(str(out / "val"), 100, cont_min=CONT_MIN, cont_diff=CONT_DIFF))
    np.testing.assert_array_equal(got_p.dense, tsv_p.dense[val])


def test_mixed_text_and_parts_and_stats(data):
    out = data / "out"
    files = [str(data / "syn" / "train" / "part-00000.txt")] + resolve_paths(str(out / "val"))
    rd = DataReader(files, 1000, prefetch=False)
    n = len(concat(rd))
    assert n == rd.stats.rows == 1500 + json.loads((out / "val" / "manifest.json").read_text())["rows"]
    assert rd.stats.files[files[1]].rows == rd.stats.files[files[1]].lines
    assert rd.stats.bad_lines == 0


def test_load_stats_sources(data, tmp_path):
    out = data / "out"
    lo, diff = binary.load_stats(str(out))
    st = json.loads((out / "stats.json").read_text())
    np.testing.assert_array_equal(lo, st["cont_min"])
    np.testing.assert_array_equal(diff, st["cont_diff"])
    for p in (out / "stats.json", out / "train"):
        a, b = binary.load_stats(str(p))
        np.testing.assert_array_equal(a, lo)
        np.testing.assert_array_equal(b, diff)
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"cont_min": [0] * 12, "cont_diff": [1] * 13}))
    with pytest.raises(binary.PartError, match="13 values"):
        binary.load_stats(str(bad))
    bad.write_text(json.dumps({"cont_min": [0] * 13, "cont_diff": [0] * 13}))
    with pytest.raises(binary.PartError, match="non-zero"):
        binary.load_stats(str(bad))
    bad.write_text("{")
    with pytest.raises(binary.PartError, match="not valid JSON"):
        binary.load_stats(str(bad))
    with pytest.raises(FileNotFoundError, match="stats"):
        binary.load_stats(str(tmp_path / "none.json"))


def read(path, **kw):
    return concat(DataReader(str(path), 100, prefetch=False, **kw))


def test_missing_part_is_clear(copy):
    shutil.rmtree(copy / "part-00001")
    with pytest.raises(binary.PartError,
                       match="1 part.*missing.*part-00001"):
        resolve_paths(str(copy))


def test_missing_column_file(copy):
    os.remove(copy / "part-00002" / "sparse.npy")
    with pytest.raises(binary.PartError, match="sparse.npy: missing column"):
        read(copy)


def test_wrong_dtype_and_shape(copy):
    p = copy / "part-00000" / "label.npy"
    np.save(p, np.load(p).astype(np.int64))
    with pytest.raises(binary.PartError, match="label.npy: int64.*manifest says int8"):
        read(copy)
    p = copy / "part-00001" / "dense.npy"
    np.save(copy / "part-00000" / "label.npy", np.zeros(3, np.int8))
    with pytest.raises(binary.PartError, match=r"label.npy: int8 \(3,\), manifest says int8"):
        read(copy)
    np.save(p, np.zeros((5, 12), np.int32))
    with pytest.raises(binary.PartError, match="dense.npy"):
        list(binary.iter_part(str(copy / "part-00001")))


def test_manifest_problems(copy):
    man = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps(dict(man, version=99)))
    with pytest.raises(binary.PartError, match="version 99"):
        read(copy / "part-00000")
    (copy / "manifest.json").write_text(json.dumps({k: v for k, v in man.items()
                                                    if k != "stats"}))
    with pytest.raises(binary.PartError, match="lacks 'stats'"):
        read(copy / "part-00000")
    (copy / "manifest.json").write_text(json.dumps(dict(man, parts=man["parts"][:1])))
    with pytest.raises(binary.PartError, match="not listed"):
        read(copy / "part-00002")
    (copy / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(binary.PartError, match="hash_bucket=0.*--hash-bucket 0"):
        read(copy, hash_bucket=1000001)
    with pytest.raises(binary.PartError, match="no manifest.json"):
        binary.read_manifest(str(copy / "part-00000"))
    bad = np.load(copy / "part-00000" / "dense.npy")
    with open(copy / "part-00000" / "dense.npy", "wb") as fh:  # truncated file
        fh.write(open(copy / "part-00001" / "dense.npy", "rb").read()[:200])
    with pytest.raises(binary.PartError, match="dense.npy"):
        read(copy)
    assert bad.shape[1] == 13
