"""Attention pooling kernels: DIN's local activation unit over a bag of ids (docs/sequences.md).

For one attention slot, the ``m`` ids of the batch's bags of that slot are laid out in bag
order: ``bounds`` (n+1,) gives bag i's ids as ``[bounds[i], bounds[i+1])``.  ``Q`` (m, d)
holds each id's query (the pooled query slot of its example), ``Kr`` (m, d) the id's row.
The scoring MLP (BLAS, ``mpips.models.attention``) maps the features ``[q, k, q-k, q*k]``
(m, 4d) to one score per id (its first layer split into a part per example, of q, and a
part per id, of ``[k, q*k]``); the bag is the weighted sum of its rows, the weights being the
scores themselves or their softmax over the bag.  An empty bag pools to zeros.
"""
import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def attn_features(Q, Kr, F):
    """F (m, 2d) = [k, q * k] per row of Q and Kr (m, d): the features of the ids (the
    query's own part, q and q - k, goes through the first layer once an example)."""
    m, d = Q.shape
    for k in range(m):
        for j in range(d):
            F[k, j] = Kr[k, j]
            F[k, d + j] = Q[k, j] * Kr[k, j]


@njit(cache=True, nogil=True)
def add_example_bias_relu(h, A, ex, b):
    """In place h[k] = max(h[k] + A[ex[k]] + b, 0): the first layer of the unit, whose
    query part A (n, h) is computed once per example."""
    m, w = h.shape
    zero = h.dtype.type(0)
    for k in range(m):
        e = ex[k]
        for j in range(w):
            v = h[k, j] + A[e, j] + b[j]
            h[k, j] = v if v > zero else zero


@njit(cache=True, nogil=True)
def bag_sums(x, bounds, out):
    """out[i] = sum of the rows of x (m, w) in bag i ([bounds[i], bounds[i+1]))."""
    n, w = out.shape
    for i in range(n):
        for j in range(w):
            out[i, j] = 0.0
        for k in range(bounds[i], bounds[i + 1]):
            for j in range(w):
                out[i, j] += x[k, j]


@njit(cache=True, nogil=True)
def attn_pool(scores, Kr, bounds, softmax, w, out):
    """Weights ``w`` (m,) of the ids (the scores, or their softmax over each bag) and the
    pooled bags ``out`` (n, d) = sum over the bag of w_k Kr[k] (an empty bag: zeros).

    Parameters
    ----------
    scores : float (m,)      the MLP's score of each id
    Kr : float (m, d)        the ids' rows
    bounds : int64 (n+1,)    bag i is [bounds[i], bounds[i+1])
    softmax : bool
    w : float (m,)           out: the weights
    out : float (n, d)       out: overwritten
    """
    n, d = out.shape
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        if softmax and hi > lo:
            top = scores[lo]
            for k in range(lo + 1, hi):
                top = max(top, scores[k])
            tot = 0.0
            for k in range(lo, hi):
                w[k] = np.exp(scores[k] - top)
                tot += w[k]
            for k in range(lo, hi):
                w[k] /= tot
        else:
            for k in range(lo, hi):
                w[k] = scores[k]
        for j in range(d):
            out[i, j] = 0.0
        for k in range(lo, hi):
            for j in range(d):
                out[i, j] += w[k] * Kr[k, j]


@njit(cache=True, nogil=True)
def attn_pool_backward(G, Kr, w, bounds, softmax, dscore, dK):
    """Gradients through ``attn_pool``: d(loss)/d(score) ``dscore`` (m,) and the direct part
    of d(loss)/d(row) ``dK`` (m, d) = w_k G[i], from G (n, d) = d(loss)/d(pooled bag)."""
    n, d = G.shape
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        mean = 0.0
        for k in range(lo, hi):
            dw = 0.0
            for j in range(d):
                dw += G[i, j] * Kr[k, j]
                dK[k, j] = w[k] * G[i, j]
            dscore[k] = dw
            mean += w[k] * dw
        if softmax:
            for k in range(lo, hi):
                dscore[k] = w[k] * (dscore[k] - mean)


@njit(cache=True, nogil=True)
def attn_features_backward(dF, Q, Kr, bounds, dq, dK):
    """From dF (m, 2d) = d(loss)/d([k, q*k]): add each id's part to ``dK`` (m, d) and to
    its bag's query gradient ``dq`` (n, d) (in id order)."""
    n, d = dq.shape
    for i in range(n):
        for k in range(bounds[i], bounds[i + 1]):
            for j in range(d):
                g = dF[k, d + j]
                dq[i, j] += g * Kr[k, j]
                dK[k, j] += dF[k, j] + g * Q[k, j]


@njit(cache=True, nogil=True)
def add_rows_at(dK, rows_of, col0, grads):
    """grads[rows_of[k], col0:col0+d] += dK[k] for k in order (deterministic)."""
    m, d = dK.shape
    for k in range(m):
        r = rows_of[k]
        for j in range(d):
            grads[r, col0 + j] += dK[k, j]
