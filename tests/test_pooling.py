"""Bag pooling kernels (sum, mean, empty bags) against numpy, and a float64 finite-difference
gradient check of the CTR-DNN loss through pooling down to the unique embedding rows."""
import numpy as np
import pytest

from mpips.kernels.embedding import unique_inverse
from mpips.kernels.pooling import pool_backward, pool_forward
from mpips.models.zoo import builtin


def random_bags(rng, n, S, max_len=5, vocab=12, p_empty=0.25):
    """(ids (nnz,), offsets (n*S+1,)): bag lengths 0..max_len, a quarter empty."""
    lens = rng.integers(1, max_len + 1, n * S)
    lens[rng.random(n * S) < p_empty] = 0
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = rng.integers(0, vocab, offsets[-1]).astype(np.int64) * 7919 - 3
    return ids, offsets


def ref_forward(rows, inverse, offsets, pooling, n):
    S, dim = len(pooling), rows.shape[1]
    out = np.zeros((n, S * dim))
    for i in range(n):
        for s in range(S):
            lo, hi = offsets[i * S + s], offsets[i * S + s + 1]
            if hi > lo:
                v = rows[inverse[lo:hi]].astype(np.float64).sum(0)
                out[i, s * dim:(s + 1) * dim] = v / (hi - lo) if pooling[s] else v
    return out


def ref_backward(grad, inverse, offsets, pooling, u):
    n, S = grad.shape[0], len(pooling)
    dim = grad.shape[1] // S
    out = np.zeros((u, dim))
    for i in range(n):
        for s in range(S):
            lo, hi = offsets[i * S + s], offsets[i * S + s + 1]
            g = grad[i, s * dim:(s + 1) * dim].astype(np.float64)
            for k in range(lo, hi):
                out[inverse[k]] += g / (hi - lo) if pooling[s] else g
    return out


@pytest.mark.parametrize("codes", [[0, 0, 0], [1, 1, 1], [0, 1, 0]])
def test_pool_forward_backward_match_numpy(codes):
    rng = np.random.default_rng(len(codes) + sum(codes))
    n, S, dim = 9, len(codes), 4
    pooling = np.array(codes, np.int8)
    ids, offsets = random_bags(rng, n, S)
    keys, inverse = unique_inverse(ids)
    rows = rng.standard_normal((len(keys), dim)).astype(np.float32)
    out = np.full((n, S * dim), np.nan, np.float32)
    pool_forward(rows, inverse, offsets, pooling, out)
    want = ref_forward(rows, inverse, offsets, pooling, n)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)   # float32 sums of <= 5 rows
    empty = np.diff(offsets).reshape(n, S) == 0
    assert empty.any() and (out.reshape(n, S, dim)[empty] == 0).all()
    grad = rng.standard_normal((n, S * dim)).astype(np.float32)
    g = np.full((len(keys), dim), np.nan, np.float32)
    pool_backward(grad, inverse, offsets, pooling, g)
    np.testing.assert_allclose(g, ref_backward(grad, inverse, offsets, pooling, len(keys)),
                               rtol=1e-5, atol=1e-5)


def test_one_id_bags_equal_one_hot_gather():
    """Bags of exactly one id: sum and mean both give the plain gathered rows (bit for bit)."""
    rng = np.random.default_rng(3)
    n, S, dim = 6, 3, 5
    ids = rng.integers(0, 8, n * S).astype(np.int64)
    keys, inverse = unique_inverse(ids)
    rows = rng.standard_normal((len(keys), dim)).astype(np.float32)
    offsets = np.arange(n * S + 1, dtype=np.int64)
    for codes in ([0] * S, [1] * S):
        out = np.empty((n, S * dim), np.float32)
        pool_forward(rows, inverse, offsets, np.array(codes, np.int8), out)
        assert np.array_equal(out, rows[inverse].reshape(n, S * dim))


def test_gradient_through_pooling_matches_finite_differences():
    """d(mean loss)/d(unique rows) from forward_backward + pool_backward vs central differences
    in float64: a wrong mean scale, a missed duplicate or a gradient on an empty bag fails."""
    rng = np.random.default_rng(5)
    n, S, dim = 6, 3, 2
    pooling = np.array([0, 1, 1], np.int8)
    ids, offsets = random_bags(rng, n, S, max_len=4, vocab=6)
    keys, inverse = unique_inverse(ids)
    m = builtin("dnn", n_sparse=S, dim=dim, n_dense=2, hidden=(5, 3), dtype=np.float64)
    params = m.init_params(1) + 0.1 * rng.standard_normal(m.n_params)
    dense = rng.random((n, 2))
    label = (rng.random(n) < 0.5).astype(np.float64)
    rows = rng.standard_normal((len(keys), dim))

    def loss(r):
        emb = np.empty((n, S * dim))
        pool_forward(r, inverse, offsets, pooling, emb)
        return m.loss(params, emb, dense, label)

    emb = np.empty((n, S * dim))
    pool_forward(rows, inverse, offsets, pooling, emb)
    gemb = np.empty((n, S * dim))
    m.forward_backward(params, emb, dense, label, np.empty(m.n_params), gemb)
    got = np.empty_like(rows)
    pool_backward(gemb, inverse, offsets, pooling, got)
    num = np.zeros_like(rows)
    eps = 1e-6
    for idx in np.ndindex(rows.shape):
        up, dn = rows.copy(), rows.copy()
        up[idx] += eps
        dn[idx] -= eps
        num[idx] = (loss(up) - loss(dn)) / (2 * eps)
    np.testing.assert_allclose(got, num, rtol=1e-6, atol=1e-8)
    assert np.abs(got).max() > 1e-3           # the check is not vacuous
