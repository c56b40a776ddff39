"""data_prep.multihot_synth: determinism, the wide multi-hot shape, the oracle AUC, the files.

The files are read back with a plain-Python slot reader (``read_slot_text``, written here
from the format's definition) and compared with the generator's own arrays, regenerated
from the same seeds.
"""
import inspect
import json

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from data_prep import multihot_synth as M
from mpips.schema import load_schema


def read_slot_text(path, token_order="feasign:slot"):
    """Plain-Python Paddle slot reader: per line (label, dense list, {slot: [feasign...]})."""
    rows = []
    with open(path, "rb") as f:
        for line in f:
            assert line.endswith(b"\n") and not line.endswith(b" \n")
            label, dense, bags = None, [], {}
            for tok in line[:-1].decode("ascii").split(" "):
                a, sep, b = tok.partition(":")
                assert sep and a and b and ":" not in b, tok
                value, slot = (a, b) if token_order == "feasign:slot" else (b, a)
                if slot == M.LABEL_SLOT:
                    assert label is None
                    label = int(value)
                elif slot == M.DENSE_SLOT:
                    dense.append(float(value))
                else:
                    bags.setdefault(slot, []).append(int(value))
            rows.append((label, dense, bags))
    return rows


def _files(out, split, parts):
    return [out / split / f"part-{i:05d}.txt" for i in range(parts)]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The default wide shape (300 slots), small."""
    out = tmp_path_factory.mktemp("wide")
    meta = M.generate(str(out), rows=1200, test_rows=300, parts=2, seed=3)
    rows = [r for p in _files(out, "train", 2) for r in read_slot_text(p)]
    return out, meta, rows


def test_wide_shape(wide):
    out, meta, rows = wide
    assert len(rows) == 1200 == meta["train"]["rows"]
    slots = set().union(*(r[2] for r in rows))
    assert slots == {str(k) for k in range(1, 301)}               # 300 sparse slots, all seen
    lens = np.array([len(v) for r in rows for v in r[2].values()])
    per_line = np.array([sum(len(v) for v in r[2].values()) for r in rows])
    assert lens.min() == 1 and 30 <= lens.max() <= 50              # bags of 1 to ~50 ids
    assert (lens == 1).mean() > 0.6                                # most bags are short
    assert per_line.sum() == meta["train"]["ids"]
    assert 430 <= per_line.mean() <= 470                           # ~450 ids a line (target 450)
    assert meta["train"]["mean_ids_per_example"] == pytest.approx(per_line.mean(), rel=1e-12)
    assert per_line.min() == meta["train"]["min_ids_per_example"]
    assert per_line.max() == meta["train"]["max_ids_per_example"]
    present = np.array([len(r[2]) for r in rows])
    assert present.max() < 300 and present.mean() < 0.9 * 300     # slots missing on lines
    assert 1 - present.mean() / 300 == pytest.approx(meta["train"]["missing_slot_share"])
    assert all(len(r[1]) == 4 and r[0] in (0, 1) for r in rows)    # 4 dense values, a label
    hist = np.bincount(lens)[1:]
    assert hist.tolist() == meta["train"]["bag_length_hist"][:hist.size]
    # power-law ids: in the biggest slot the most frequent id is far above the median one
    big = max(slots, key=lambda s: meta["model"]["cardinalities"][int(s) - 1])
    _, counts = np.unique([x for r in rows for x in r[2].get(big, [])], return_counts=True)
    assert counts.max() >= 20 * np.median(counts)
    distinct = len({(s, x) for r in rows for s, v in r[2].items() for x in v})
    assert distinct == meta["train"]["distinct_ids"]


def test_schema_file_describes_the_data(wide):
    out, meta, rows = wide
    sch = load_schema(str(out / "schema.toml"))
    assert (sch.format, sch.token_order, sch.label) == ("slot", "feasign:slot", "click")
    assert sch.sparse_names == tuple(str(k) for k in range(1, 301))
    assert sch.n_dense == 4 and sch.dense_names == ("dense_feature",)
    assert set(sch.slot_options("pooling")) == {"sum"} and not sch.one_hot


def test_oracle_auc_matches_sklearn(wide):
    out, meta, _ = wide
    for split in ("train", "test"):
        y = np.array([r[0] for p in _files(out, split, 2) for r in read_slot_text(p)])
        p = np.concatenate([np.load(out / "truth" / f"{split}-part-{i:05d}.npy")
                            for i in range(2)])
        assert y.size == p.size == meta[split]["rows"]
        assert meta[split]["oracle_auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-12)
        assert meta[split]["ctr"] == pytest.approx(y.mean(), abs=1e-12)
        assert 0.7 < meta[split]["oracle_auc"] < 0.95
    assert json.loads((out / "meta.json").read_text())["test"] == meta["test"]


@pytest.mark.parametrize("bits,order", [(32, "feasign:slot"), (64, "slot:feasign")])
def test_text_is_the_generators_arrays(tmp_path, bits, order):
    """Every token read back equals the arrays the generator drew (same seeds, re-drawn)."""
    kw = dict(slots=30, dense=3, feasign_bits=bits, max_card=5000)
    M.generate(str(tmp_path), rows=400, parts=1, seed=5, token_order=order, **kw)
    assert load_schema(str(tmp_path / "schema.toml")).token_order == order
    model = M.MultiHot(seed=5, **kw)
    rng = np.random.default_rng([5, 1, 0])                        # part 0 of the train split
    s = model.sample(rng, 400)
    p = model.prob(s)
    y = (rng.random(400) < p).astype(int)
    fs = model.feasigns(s["slot"], s["rank"])
    if bits == 64:
        assert fs.max() > 1 << 60                                  # really 64-bit feasigns
    off = np.concatenate([[0], np.cumsum(s["lengths"].ravel())])
    rows = read_slot_text(tmp_path / "train" / "part-00000.txt", order)
    assert len(rows) == 400
    for i, (label, dense, bags) in enumerate(rows):
        assert label == y[i]
        assert dense == pytest.approx(s["dense"][i], abs=0, rel=0)
        for k in range(30):
            want = fs[off[i * 30 + k]:off[i * 30 + k + 1]].tolist()
            assert bags.get(str(k + 1), []) == want
    np.testing.assert_array_equal(np.load(tmp_path / "truth" / "train-part-00000.npy"),
                                  p.astype(np.float32))


def test_feasigns_unique_per_slot_and_id():
    model = M.MultiHot(seed=1, slots=20, max_card=3000)
    slot = np.repeat(np.arange(20), 3000)
    rank = np.tile(np.arange(3000), 20)
    for bits in (32, 64):
        model.bits = bits
        assert np.unique(model.feasigns(slot, rank)).size == slot.size


def test_deterministic_by_seed(tmp_path):
    kw = dict(rows=300, test_rows=100, parts=2, slots=40)
    a = M.generate(str(tmp_path / "a"), seed=7, **kw)
    b = M.generate(str(tmp_path / "b"), seed=7, **kw)
    M.generate(str(tmp_path / "c"), seed=8, **kw)
    for split in ("train", "test"):
        for i in range(2):
            name = f"{split}/part-{i:05d}.txt"
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
            assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    for m in (a, b):
        m.pop("seconds"), m.pop("rows_per_cpu_second")
    assert a == b
    assert (tmp_path / "a" / "schema.toml").read_text() == (tmp_path / "b" / "schema.toml").read_text()


def test_interactions_are_in_the_click_model():
    """--interactions gives the FM part that share of the logit variance, and says so."""
    plain = M.MultiHot(seed=2, slots=40)
    fm = M.MultiHot(seed=2, slots=40, interactions=0.4)
    assert not plain.summary()["interactions"] and plain.summary()["interaction_pairs"] == []
    summ = fm.summary()
    assert summ["interactions"] and len(summ["interaction_pairs"]) == M.N_PAIRS
    s = fm.sample(np.random.default_rng(9), 20000)
    parts = fm._parts(s) * (fm.part_scale * fm.part_w)
    share = parts.var(axis=0) / (parts.sum(axis=1)).var()
    assert share[1] == pytest.approx(0.4, abs=0.06)
    assert share[2] == pytest.approx(0.15, abs=0.04)
    # the FM part is a sum of products of two slots' pooled latent vectors: zero once one
    # slot of every pair is empty
    assert fm._parts(s)[:, 1].std() > 0
    dropped = _drop_slots(s, sorted({a for a, _ in fm.pairs}))
    np.testing.assert_array_equal(fm._parts(dropped)[:, 1], 0.0)


def _drop_slots(s, slots):
    """The sample with the given slots' bags emptied (their ids removed, lengths 0)."""
    lengths = s["lengths"].copy()
    lengths[:, slots] = 0
    keep = ~np.isin(s["slot"], slots)
    return {**s, "lengths": lengths, "slot": s["slot"][keep], "rank": s["rank"][keep]}


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        M.main(["--out", str(tmp_path), "--rows", "10", "--slots", "20", "--ids-per-example", "5"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ids_per_example 5 is out of reach" in err
    with pytest.raises(ValueError, match="interactions"):
        M.MultiHot(slots=10, interactions=0.9, dense_share=0.2)


def test_mpips_reader_reads_it_with_no_bad_lines(wide):
    """Once mpips's reader takes a schema (branch readers), it reads the files cleanly."""
    from mpips.data.reader import DataReader
    if "schema" not in inspect.signature(DataReader).parameters:
        pytest.skip("mpips.data.reader.DataReader takes no schema yet (issue 20 readers)")
    out, meta, rows = wide
    sch = load_schema(str(out / "schema.toml"))
    reader = DataReader(str(out / "train"), 256, schema=sch)
    labels, lens, dense = [], [], []
    for b in reader:
        labels.append(b.label)
        dense.append(b.dense)
        lens.append(np.diff(b.offsets).reshape(len(b), sch.n_sparse))
    assert reader.stats.bad_lines == 0 and reader.stats.rows == len(rows)
    np.testing.assert_array_equal(np.concatenate(labels), [r[0] for r in rows])
    np.testing.assert_allclose(np.concatenate(dense), [r[1] for r in rows], rtol=1e-6)
    want = [[len(r[2].get(str(k), [])) for k in range(1, 301)] for r in rows]
    np.testing.assert_array_equal(np.concatenate(lens), want)


# ---------------------------------------------------------------- the PyTorch reference
def _bench_module(name):
    import importlib.util
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("pooling", [[0, 0, 0], [1, 1, 1], [0, 1, 0]])
def test_torch_bag_pooling_forward_and_backward(pooling):
    """torch_ref's EmbeddingBag pooling (sum, mean, mixed; empty bags) against dense maths."""
    torch = pytest.importorskip("torch")
    ref = _bench_module("torch_ref")
    rng = np.random.default_rng(0)
    n, S, dim, rows_n = 6, 3, 4, 40
    lengths = rng.integers(0, 5, (n, S))
    lengths[0] = 0                                             # an example with no ids at all
    ids = rng.integers(0, rows_n - 1, lengths.sum())
    off = np.concatenate([[0], np.cumsum(lengths.ravel())])
    model = ref.CTRDNN(rows_n, n_sparse=S, dim=dim, n_dense=2, hidden=(8,),
                       pooling=pooling).double()
    dense = torch.from_numpy(rng.random((n, 2)))
    logit = model(torch.from_numpy(ids), dense, torch.from_numpy(off))
    logit.sum().backward()
    W = model.emb.weight.detach().clone().requires_grad_(True)   # the same maths, dense
    pooled = []
    for i in range(n):
        for k in range(S):
            b = ids[off[i * S + k]:off[i * S + k + 1]]
            v = W[torch.from_numpy(b)].sum(0) if b.size else torch.zeros(dim, dtype=W.dtype)
            pooled.append(v / b.size if pooling[k] and b.size else v)
    x = torch.cat([torch.stack(pooled).reshape(n, S * dim), dense], 1)
    want = model.mlp(x).squeeze(1)
    want.sum().backward()
    np.testing.assert_allclose(logit.detach().numpy(), want.detach().numpy(), rtol=1e-12)
    g = model.emb.weight.grad.to_dense().numpy()
    np.testing.assert_allclose(g, W.grad.numpy(), rtol=1e-10, atol=1e-15)
    assert not g[np.setdiff1d(np.arange(rows_n), ids)].any()   # unseen rows: no gradient


def test_torch_ref_trains_on_the_wide_shape(tmp_path):
    """A tiny end-to-end torch_ref run on generated slot text, through its CLI."""
    pytest.importorskip("torch")
    ref = _bench_module("torch_ref")
    meta = M.generate(str(tmp_path), rows=3000, test_rows=1000, parts=2, seed=1, slots=20,
                      max_card=200, signal=3.0)
    recs = ref.run(ref.parse_args([
        "--train", str(tmp_path / "train"), "--test", str(tmp_path / "test"),
        "--schema", str(tmp_path / "schema.toml"), "--hash-bucket", "0", "--lr", "3e-3",
        "--batch-size", "128", "--epochs", "4", "--threads", "1", "--embedding-dim", "4",
        "--fc", "32,16", "--row-adam", "--print-every", "0"]))
    last = recs[-1]
    assert last["train_examples"] == 3000 and last["test_examples"] == 1000
    assert last["table_rows"] == meta["train"]["distinct_ids"] + 1
    assert recs[0]["test_auc"] < last["test_auc"]                    # it learns (0.56 -> 0.84)
    assert 0.8 < last["test_auc"] < meta["test"]["oracle_auc"]     # oracle 0.925
