"""Bucketed AUC / logloss: sklearn agreement, exact merging, edge cases."""
import math

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from mpips.kernels import mlp
from mpips.metrics import BinaryMetrics

pytestmark = pytest.mark.exact      # float results against references, bit-equal paths


def random_scores(n, seed, signal=1.0):
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.3).astype(np.float32)
    logits = signal * (labels - 0.3) + rng.standard_normal(n)
    return (1 / (1 + np.exp(-logits))).astype(np.float32), labels


def tie_bound(m):
    """Largest |bucketed AUC - exact AUC|: a positive and a negative in the same bucket
    count 1/2 instead of 0 or 1, so the error is at most half their share of all pairs."""
    st, b = m.state(), m.n_buckets
    pos, neg = st[:b], st[b:2 * b]
    return float(np.dot(pos, neg)) / (2 * pos.sum() * neg.sum())


@pytest.mark.parametrize("n_buckets", [1 << 16, 1 << 10])
def test_auc_matches_sklearn_on_continuous_scores_to_the_tie_bound(n_buckets):
    probs, labels = random_scores(20000, 0)
    m = BinaryMetrics(n_buckets)
    m.update(probs, labels)
    bound = tie_bound(m)
    assert abs(m.auc() - roc_auc_score(labels, probs)) <= bound + 1e-12
    # the bound is of order 1/n_buckets (these scores spread over ~half of [0, 1])
    assert 0 < bound < 4 / n_buckets
    assert m.count == 20000 and m.n_pos == int(labels.sum())


def test_auc_is_sklearns_when_no_two_distinct_scores_share_a_bucket():
    rng = np.random.default_rng(4)
    b = 1 << 16
    probs = ((rng.permutation(b)[:5000] + 0.5) / b).astype(np.float64)   # one score a bucket
    labels = (rng.random(5000) < 0.5 + 0.3 * (probs - 0.5)).astype(np.float32)
    m = BinaryMetrics(b)
    m.update(probs.astype(np.float32), labels)
    assert tie_bound(m) == 0.0
    assert m.auc() == pytest.approx(roc_auc_score(labels, probs.astype(np.float32)), abs=1e-12)


def test_auc_matches_sklearn_with_many_ties():
    rng = np.random.default_rng(1)
    labels = (rng.random(5000) < 0.4).astype(np.int64)
    probs = np.round(np.clip(0.3 * labels + rng.random(5000) * 0.7, 0, 1), 1)  # 11 values
    m = BinaryMetrics()
    m.update(probs, labels)
    assert m.auc() == pytest.approx(roc_auc_score(labels, probs), abs=1e-12)
    coarse = BinaryMetrics(n_buckets=4)               # coarser buckets: more ties, still valid
    coarse.update(probs, labels)
    assert 0.5 < coarse.auc() <= m.auc() + 1e-12


def test_perfect_and_reversed_ranking():
    probs = np.array([0.1, 0.2, 0.8, 0.9])
    m = BinaryMetrics()
    m.update(probs, np.array([0, 0, 1, 1]))
    assert m.auc() == 1.0
    m.reset()
    m.update(probs, np.array([1, 1, 0, 0]))
    assert m.auc() == 0.0
    m.reset()
    m.update(np.full(6, 0.5), np.array([0, 1, 0, 1, 1, 0]))
    assert m.auc() == 0.5


def test_merge_equals_union_exactly():
    p1, y1 = random_scores(3001, 2)
    p2, y2 = random_scores(4999, 3, signal=2.0)
    a, b, union = BinaryMetrics(), BinaryMetrics(), BinaryMetrics()
    a.update(p1, y1)
    b.update(p2, y2)
    union.update(np.concatenate([p1, p2]), np.concatenate([y1, y2]))
    summed = BinaryMetrics.from_state(a.state() + b.state())    # what Allreduce(SUM) gives
    merged = BinaryMetrics.from_state(a.state()).merge(b)
    for m in (summed, merged):
        assert m.auc() == union.auc()
        np.testing.assert_array_equal(m.state()[:-7], union.state()[:-7])   # histograms
        assert m.count == union.count and m.n_pos == union.n_pos
        assert m.logloss() == pytest.approx(union.logloss(), rel=1e-12)
        assert m.mean_pred() == pytest.approx(union.mean_pred(), rel=1e-12)
    assert a.count == 3001                                      # from_state copied


def test_logloss_and_calibration_match_references():
    probs, labels = random_scores(5000, 4)
    m = BinaryMetrics()
    for lo in range(0, 5000, 512):                            # several updates
        m.update(probs[lo:lo + 512], labels[lo:lo + 512])
    p = probs.astype(np.float64)
    assert m.logloss() == pytest.approx(log_loss(labels, p), rel=1e-9)
    assert m.mean_pred() == pytest.approx(p.mean(), rel=1e-12)
    # the reference in float64: labels.mean() is a float32 (0.30300000309944); NumPy 2's
    # promotion (NEP 50) takes approx's difference in float32, which hid that, NumPy 1.x's not
    assert m.observed_ctr() == pytest.approx(labels.mean(dtype=np.float64), rel=1e-12)
    assert m.copc() == pytest.approx(labels.sum() / p.sum(), rel=1e-12)
    assert m.mae() == pytest.approx(np.abs(p - labels).mean(), rel=1e-12)
    assert m.rmse() == pytest.approx(np.sqrt(((p - labels) ** 2).mean()), rel=1e-12)
    s = m.summary()
    assert s["count"] == 5000 and s["auc"] == m.auc()


def test_logloss_clips_extreme_predictions():
    m = BinaryMetrics()
    m.update(np.array([0.0, 1.0]), np.array([1, 0]))
    assert m.logloss() == pytest.approx(-math.log(1e-7), rel=1e-6)


def test_one_class_empty_and_nan():
    m = BinaryMetrics()
    assert math.isnan(m.auc()) and math.isnan(m.logloss()) and m.count == 0
    m.update(np.array([0.2, 0.7], np.float32), np.zeros(2))
    assert math.isnan(m.auc())                                # one class only: undefined
    assert m.logloss() == pytest.approx(-np.log([0.8, 0.3]).mean(), rel=1e-6)
    m.update(np.array([np.nan, 0.9]), np.array([1, 1]))
    assert m.n_nan == 1 and m.count == 3
    assert m.auc() == 1.0


def test_kernel_matches_bincount_reference():
    probs, labels = random_scores(1000, 5)
    probs[:3] = [0.0, 1.0, 0.5]
    nb = 64
    pos, neg, acc = np.zeros(nb), np.zeros(nb), np.zeros(mlp.N_ACC)
    assert mlp.binary_metrics_update_(probs, labels, pos, neg, acc) == 1000
    bucket = np.minimum((probs.astype(np.float64) * nb).astype(np.int64), nb - 1)
    np.testing.assert_array_equal(pos, np.bincount(bucket[labels > 0.5], minlength=nb))
    np.testing.assert_array_equal(neg, np.bincount(bucket[labels <= 0.5], minlength=nb))
    assert acc[mlp.ACC_N] == 1000 and acc[mlp.ACC_NPOS] == labels.sum()


def test_bad_arguments_raise():
    m = BinaryMetrics(16)
    with pytest.raises(ValueError, match="same length"):
        m.update(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="float"):
        m.update(np.zeros(3, np.int64), np.zeros(3))
    with pytest.raises(ValueError, match="cannot merge"):
        m.merge(BinaryMetrics(8))
    with pytest.raises(ValueError, match="entries"):
        BinaryMetrics.from_state(np.zeros(10))
