"""Criteo-like generator: cardinalities, CTR, determinism, files mpips reads, oracle AUC."""
import json
import os

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from data_prep import criteo_like as cl
from mpips.data.reader import DataReader

ROWS, TEST = 30_000, 6_000


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cl"))
    meta = cl.generate(out, ROWS, TEST, parts=3, seed=3, card_scale=0.002, ctr=0.3)
    return out, meta


def _split(out, name):
    parts = sorted(os.listdir(os.path.join(out, name)))
    rd = DataReader([os.path.join(out, name, p) for p in parts], 4096, prefetch=False)
    batches = list(rd)
    assert rd.stats.bad_lines == 0
    truth = np.concatenate([np.load(os.path.join(out, "truth", f"{name}-{p[:-4]}.npy"))
                            for p in parts])
    return (np.concatenate([b.sparse for b in batches]),
            np.concatenate([b.label for b in batches]), truth)


def test_cardinalities_follow_kaggle_table():
    m = cl.CriteoLike(card_scale=0.05)
    assert m.card[2] == round(10131227 * 0.05) and m.card[11] == round(8351593 * 0.05)
    assert m.card[8] == 3 and m.card[19] == 4 and m.card[16] == 10      # small slots kept
    assert cl.KAGGLE_CARD.sum() == 33_762_577


def test_parse_ctr_oracle_auc_and_ids(gen):
    out, meta = gen
    assert json.load(open(os.path.join(out, "meta.json"))) == meta
    sparse, label, truth = _split(out, "train")
    assert label.size == ROWS and truth.size == ROWS
    assert label.mean() == pytest.approx(0.3, abs=0.02)
    assert label.mean() == pytest.approx(meta["train"]["ctr"])
    # oracle AUC/logloss (bucketed, streaming) against sklearn on the stored truth
    assert meta["train"]["oracle_auc"] == pytest.approx(roc_auc_score(label, truth), abs=2e-4)
    assert meta["train"]["oracle_logloss"] == pytest.approx(log_loss(label, truth), abs=1e-4)
    assert 0.75 < meta["train"]["oracle_auc"] < 0.95
    # distinct (slot, value) pairs through mpips's own hashing = the generator's count
    # (+1 per slot that had an empty field: mpips hashes empty as a value, we do not count it)
    n_empty_slots = sum(1 for k in range(26) if cl.CAT_MISSING[k] > 0)
    got = sum(np.unique(sparse[:, k]).size for k in range(26))
    assert got - meta["train"]["distinct_ids"] == n_empty_slots
    # per slot: never more distinct than the vocabulary plus what churn added
    card = np.array(meta["model"]["cardinalities"])
    per = np.array(meta["train"]["distinct_per_slot"])
    assert (per <= card * 2).all() and per[2] > 1000
    # the test split comes later in time: it meets ids training never saw
    assert meta["test"]["ids_not_in_train"] > 0


def test_text_looks_like_criteo(gen):
    out, _ = gen
    lines = open(os.path.join(out, "train", "part-00000.txt"), "rb").read().split(b"\n")[:-1]
    f = [x.split(b"\t") for x in lines[:3000]]
    assert all(len(r) == 40 for r in f)
    i2 = np.array([int(r[2]) for r in f])
    assert (i2 < 0).mean() == pytest.approx(cl.I2_NEG, abs=0.03) and i2.min() >= -3
    i12_empty = np.mean([r[12] == b"" for r in f])
    assert i12_empty == pytest.approx(cl.INT_MISSING[11], abs=0.04)
    c22_empty = np.mean([r[14 + 21] == b"" for r in f])
    assert c22_empty == pytest.approx(cl.CAT_MISSING[21], abs=0.04)
    i5 = np.array([int(r[5]) for r in f if r[5]])
    assert np.median(i5) > 500 and i5.max() > 20 * np.median(i5)            # heavy tail


def test_deterministic_for_seed(tmp_path):
    kw = dict(card_scale=0.001)
    a, b, c = (str(tmp_path / n) for n in "abc")
    cl.generate(a, 2000, 0, parts=2, seed=5, **kw)
    cl.generate(b, 2000, 0, parts=2, seed=5, **kw)
    cl.generate(c, 2000, 0, parts=2, seed=6, **kw)
    for p in ("part-00000.txt", "part-00001.txt"):
        ra = open(os.path.join(a, "train", p), "rb").read()
        assert ra == open(os.path.join(b, "train", p), "rb").read()
        assert ra != open(os.path.join(c, "train", p), "rb").read()


def test_power_rank_matches_its_law():
    u = np.random.default_rng(0).random(400_000)
    r = cl._power_rank(u, 1000, 1.2)
    x = np.arange(1001.0)
    cdf = (1 - (x + 1) ** -0.2) / (1 - 1001.0 ** -0.2)   # continuous law, floored
    emp = np.bincount(r, minlength=1000) / r.size
    assert r.min() == 0 and r.max() == 999
    np.testing.assert_allclose(emp[:20], np.diff(cdf)[:20], atol=3e-3)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="ctr"):
        cl.CriteoLike(ctr=1.5)
    with pytest.raises(ValueError, match="interactions"):
        cl.CriteoLike(interactions=0.8, dense_share=0.5)
