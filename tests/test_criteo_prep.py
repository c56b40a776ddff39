"""data_prep.criteo: split rule, exact percentile statistics, end-to-end preparation."""
import json
import os

import numpy as np
import pytest

from data_prep import criteo as P
from data_prep.synth import generate
from mpips.data import binary
from mpips.data.files import resolve_paths
from mpips.data.reader import DataReader

PCT_DATA_SEED = 11


def read_all(spec, **kw):
    """All rows of a path spec as one Batch (no prefetch)."""
    batches = list(DataReader(spec, 1 << 30, prefetch=False, warn=lambda m: None, **kw))
    assert len(batches) <= 1
    return batches[0] if batches else None


def raw_values(files, has_label=True):
    """(n, 13) float64 raw integer values (NaN = empty) of the valid lines of files."""
    return np.concatenate([P.parse_raw(open(f, "rb").read(), has_label, 0).dense
                           for f in files])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Synthetic input (3 files, bad lines in one, test set without labels) prepared."""
    root = tmp_path_factory.mktemp("prep")
    generate(str(root / "syn"), rows=4000, parts=3, seed=3, test_rows=500)
    train = root / "syn" / "train"
    part1 = train / "part-00001.txt"
    lines = part1.read_bytes().split(b"\n")
    lines[5] = b"1\tx\t" + b"\t" * 37  # non-integer I1
    lines[9] = b"0\t1\t2"  # too few fields
    lines.insert(20, b"\x00\xff\xfe garbage")
    part1.write_bytes(b"\n".join(lines))
    test = root / "test"
    test.mkdir()
    with open(test / "t.txt", "wb") as fh:  # Criteo test.txt style: drop the label column
        for path in resolve_paths(str(root / "syn" / "test")):
            for line in open(path, "rb"):
                fh.write(line.split(b"\t", 1)[1])
    messages = []
    rep = P.prepare(str(train), str(root / "out"), parts=4, val_fraction=0.1, seed=7,
                    test=str(test), progress=False, warn=messages.append)
    return root, rep, messages


def test_val_mask_reproducible_chunk_independent():
    whole = P.val_mask(7, 0, 100_000, 0.1)
    parts = np.concatenate([P.val_mask(7, a, b - a, 0.1)
                            for a, b in ((0, 333), (333, 50_000), (50_000, 100_000))])
    np.testing.assert_array_equal(whole, parts)
    assert abs(whole.mean() - 0.1) < 0.005
    assert (whole != P.val_mask(8, 0, 100_000, 0.1)).mean() > 0.1
    assert not P.val_mask(7, 0, 1000, 0.0).any()
    np.testing.assert_array_equal(P.val_mask(7, 0, 1000, 0.1), P.val_mask(7, 0, 1000, 0.1))


def _heavy_ints(rng, n):
    v = np.floor(np.exp(rng.normal(3, 3, (n, 13)))).astype(np.int64) - 2
    v[:, 1] = -v[:, 1]  # a mostly negative feature
    v[:, 4] = rng.integers(-(2 ** 31) + 1, 2 ** 31 - 1, n)  # full int32 range
    v[:, 6] = 5  # constant
    raw = v.clip(-(2 ** 31) + 1, 2 ** 31 - 1).astype(np.int32)
    raw[rng.random((n, 13)) < 0.2] = binary.DENSE_MISSING
    raw[:, 7] = binary.DENSE_MISSING  # no values at all
    return raw


@pytest.mark.parametrize("lo,hi,bins", [(P.EXACT_LO, P.EXACT_HI, P.REFINE_BINS),
                                        (-3, 7, 5), (0, 1, 2)])
def test_stats_equal_numpy_percentile(monkeypatch, lo, hi, bins):
    monkeypatch.setattr(P, "EXACT_LO", lo)
    monkeypatch.setattr(P, "EXACT_HI", hi)
    monkeypatch.setattr(P, "REFINE_BINS", bins)
    rng = np.random.default_rng(PCT_DATA_SEED)
    raw = _heavy_ints(rng, 3001)
    st = P.IntStats()
    for a in range(0, raw.shape[0], 1000):
        st.add(raw[a:a + 1000])

    def scan(j):
        for a in range(0, raw.shape[0], 700):
            c = raw[a:a + 700, j].astype(np.int64)
            yield c[c != binary.DENSE_MISSING]

    res = st.result(scan)
    for j in range(13):
        v = raw[:, j][raw[:, j] != binary.DENSE_MISSING]
        assert res["count"][j] == v.size
        if j == 7:
            assert (res["cont_min"][j], res["cont_diff"][j]) == (0.0, 1.0)
            continue
        assert res["cont_min"][j] == v.min()
        assert res["p95"][j] == np.percentile(v, 95)  # exact, not approximately
        assert res["max"][j] == v.max()
        want = np.percentile(v, 95) - v.min()
        assert res["cont_diff"][j] == (want if want > 0 else 1.0)
    for q in (0.0, 0.5, 0.999, 1.0):
        assert st.quantile(0, q, scan) == np.percentile(raw[:, 0][raw[:, 0] != binary.DENSE_MISSING],
                                                        q * 100)


def test_split_disjoint_union_and_stats(prepared):
    root, rep, _ = prepared
    out, train = root / "out", root / "syn" / "train"
    lo, diff = binary.load_stats(str(out))
    full = read_all(str(train), cont_min=lo, cont_diff=diff)
    val = P.val_mask(7, 0, len(full), 0.1)
    for name, sel in (("train", ~val), ("val", val)):
        got = read_all(str(out / name))  # manifest stats = stats.json
        np.testing.assert_array_equal(got.dense, full.dense[sel])
        np.testing.assert_array_equal(got.sparse, full.sparse[sel])
        np.testing.assert_array_equal(got.label, full.label[sel])
    assert rep["rows"]["train"] + rep["rows"]["val"] == len(full) == 4000 - 2
    raw = raw_values(resolve_paths(str(train)))[~val]  # (n_train, 13)
    st = json.loads((out / "stats.json").read_text())
    for j in range(13):
        v = raw[:, j][~np.isnan(raw[:, j])]
        assert st["cont_min"][j] == v.min() and st["p95"][j] == np.percentile(v, 95)
    np.testing.assert_array_equal(lo, st["cont_min"])


def test_parts_balanced_and_bad_lines_reported(prepared):
    root, rep, messages = prepared
    man = binary.read_manifest(str(root / "out" / "train"))
    rows = [p["rows"] for p in man["parts"]]
    assert len(rows) == 4 and max(rows) - min(rows) < 0.05 * max(rows)
    f1 = [v for k, v in rep["files"].items() if k.endswith("part-00001.txt")][0]
    assert f1["bad"] == 3 and rep["bad_lines"] == 3
    assert any("I1 is not a number" in e for e in f1["examples"])
    assert any("part-00001.txt:" in m and "found 3" in m for m in messages)
    assert all(v["bad"] == 0 for k, v in rep["files"].items() if not k.endswith("00001.txt"))
    root_man = json.loads((root / "out" / "manifest.json").read_text())
    assert root_man["kind"] == "root" and root_man["splits"] == ["train", "val", "test"]


def test_test_set_without_label(prepared):
    root, rep, _ = prepared
    assert rep["test_has_label"] is False and rep["rows"]["test"] == 500
    man = binary.read_manifest(str(root / "out" / "test"))
    assert "label" not in man["columns"] and not man["has_label"]
    assert not os.path.exists(root / "out" / "test" / "part-00000" / "label.npy")
    lo, diff = binary.load_stats(str(root / "out"))
    want = read_all(str(root / "test"), has_label=False, cont_min=lo, cont_diff=diff)
    got = read_all(str(root / "out" / "test"))
    np.testing.assert_array_equal(got.dense, want.dense)
    np.testing.assert_array_equal(got.sparse, want.sparse)
    assert not got.label.any()


def test_reproducible_and_parts_independent(prepared, tmp_path):
    root, _, _ = prepared
    train = str(root / "syn" / "train")
    P.prepare(train, str(tmp_path / "a"), parts=2, seed=7, progress=False, warn=lambda m: None)
    assert (tmp_path / "a" / "stats.json").read_text() == \
        (root / "out" / "stats.json").read_text()
    for name in ("train", "val"):
        a, b = read_all(str(tmp_path / "a" / name)), read_all(str(root / "out" / name))
        np.testing.assert_array_equal(a.sparse, b.sparse)
        np.testing.assert_array_equal(a.dense, b.dense)
    P.prepare(train, str(tmp_path / "b"), parts=2, seed=8, progress=False, warn=lambda m: None)
    assert read_all(str(tmp_path / "b" / "val")).sparse.shape != \
        read_all(str(tmp_path / "a" / "val")).sparse.shape or \
        (read_all(str(tmp_path / "b" / "val")).sparse != read_all(str(tmp_path / "a" / "val")).sparse).any()


def test_hash_bucket_and_more_parts_than_rows(tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(b"1\t5\t\t" + b"\t" * 11 + b"\t".join([b"ab"] * 26) + b"\n")
    P.prepare(str(src), str(tmp_path / "o"), parts=3, val_fraction=0.0, hash_bucket=1000,
              progress=False)
    parts = resolve_paths(str(tmp_path / "o" / "train"))
    assert len(parts) == 3
    got = read_all(str(tmp_path / "o" / "train"), hash_bucket=1000)
    assert len(got) == 1 and (got.sparse < 1000).all() and (got.sparse >= 0).all()
    assert read_all(str(tmp_path / "o" / "val"), hash_bucket=1000) is None  # 0 rows
    st = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert st["cont_min"][0] == 5 and st["cont_diff"][0] == 1.0  # single value: diff 1


def test_errors(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_bytes(b"1\t99999999999\t" + b"\t" * 12 + b"\t".join([b"ab"] * 26) + b"\n")
    with pytest.raises(ValueError, match="I1 has value 99999999999.*int32"):
        P.prepare(str(src), str(tmp_path / "o"), progress=False)
    assert not os.path.exists(tmp_path / "o")  # a failed run leaves nothing behind
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert P.main(["--input", str(src), "--out", str(tmp_path / "full")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert P.main(["--input", str(src), "--out", str(tmp_path / "p"), "--val-fraction", "1"]) == 2
    assert P.main(["--input", str(tmp_path / "nope"), "--out", str(tmp_path / "q")]) == 2
    slot = tmp_path / "slot.txt"
    slot.write_text("click:0 dense_feature:0.1\n")
    with pytest.raises(ValueError, match="slot format"):
        P.prepare(str(slot), str(tmp_path / "r"), progress=False)


def test_cli(prepared, tmp_path, capsys):
    root, _, _ = prepared
    rc = P.main(["--input", str(root / "syn" / "train" / "part-00000.txt"), "--out",
                 str(tmp_path / "o"), "--parts", "2", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "train" in out and "val" in out and "stats.json" in out
    assert len(resolve_paths(str(tmp_path / "o" / "val"))) == 2


def test_refinement_scans_written_shards(prepared, tmp_path, monkeypatch):
    """With a tiny exact range every statistic comes from re-scanning the train binary."""
    root, _, _ = prepared
    monkeypatch.setattr(P, "EXACT_LO", -1)
    monkeypatch.setattr(P, "EXACT_HI", 2)
    monkeypatch.setattr(P, "REFINE_BINS", 3)
    P.prepare(str(root / "syn" / "train"), str(tmp_path / "r"), parts=4, seed=7,
              progress=False, warn=lambda m: None)
    a = json.loads((tmp_path / "r" / "stats.json").read_text())
    b = json.loads((root / "out" / "stats.json").read_text())
    assert a == b
