"""Elementwise MLP kernels for the CTR-DNN (numba).

The large products of the network run through BLAS (``np.matmul(..., out=)``);
these kernels do the memory-bound work between them in one pass each:

* forward:  bias add + ReLU, fused, in place;
* backward: ReLU mask + bias-gradient column sum, fused, in place;
* the output layer: sigmoid, binary cross-entropy with logits and d(loss)/d(logit);
* the first backward step: outer product of d(logit) with the last weight vector,
  masked by ReLU, with its bias-gradient column sum;
* metrics: bucketed pos/neg prediction histograms and logloss sums for
  :class:`mpips.metrics.BinaryMetrics`.

All kernels are pure functions over arrays: inputs and preallocated outputs in,
nothing allocated, nothing raised. They are generic over float32/float64 (numba
compiles one version per dtype); callers keep all arrays in one dtype.
"""
from __future__ import annotations

import math

import numpy as np

from numba import njit


@njit(cache=True, nogil=True)
def bias_relu_(z, b):
    """In place ``z = max(z + b, 0)``.

    Parameters
    ----------
    z : (B, H) float array, C-contiguous; pre-activations, overwritten with activations.
    b : (H,) float array; bias.
    """
    n, h = z.shape
    zero = z.dtype.type(0)
    for i in range(n):
        for j in range(h):
            v = z[i, j] + b[j]
            z[i, j] = v if v > zero else zero
    return None


@njit(cache=True, nogil=True)
def relu_backward_colsum_(da, a, gb):
    """In place ``da = da * (a > 0)``, and ``gb = sum over rows of the result``.

    Turns the gradient w.r.t. a ReLU layer's output into the gradient w.r.t. its
    pre-activation, and writes that layer's bias gradient.

    Parameters
    ----------
    da : (B, H) float array; d(loss)/d(activation), overwritten with d(loss)/d(z).
    a : (B, H) float array; the layer's activations (ReLU outputs) from the forward pass.
    gb : (H,) float array, output; bias gradient (overwritten, not accumulated).
    """
    n, h = da.shape
    zero = da.dtype.type(0)
    for j in range(h):
        gb[j] = zero
    for i in range(n):
        for j in range(h):
            v = da[i, j] if a[i, j] > zero else zero
            da[i, j] = v
            gb[j] += v
    return None


@njit(cache=True, nogil=True)
def outer_relu_backward_colsum_(dlogit, w, a, dz, gb):
    """``dz = outer(dlogit, w) * (a > 0)`` and ``gb = dz.sum(axis=0)``.

    The backward step through the output layer (a single logit with weight ``w``)
    into the last hidden ReLU layer.

    Parameters
    ----------
    dlogit : (B,) float array; d(loss)/d(logit).
    w : (H,) float array; output-layer weights.
    a : (B, H) float array; last hidden activations.
    dz : (B, H) float array, output; d(loss)/d(pre-activation) of the last hidden layer.
    gb : (H,) float array, output; that layer's bias gradient (overwritten).
    """
    n, h = a.shape
    zero = a.dtype.type(0)
    for j in range(h):
        gb[j] = zero
    for i in range(n):
        g = dlogit[i]
        for j in range(h):
            v = g * w[j] if a[i, j] > zero else zero
            dz[i, j] = v
            gb[j] += v
    return None


@njit(cache=True, nogil=True)
def sigmoid_bce_(logit, label, probs, dlogit, scale):
    """Sigmoid, binary cross-entropy with logits, and its gradient.

    Per example, with ``x = logit``, ``y = label``::

        p      = 1 / (1 + exp(-x))
        loss   = max(x, 0) - x * y + log1p(exp(-|x|))     (stable; never overflows)
        dlogit = (p - y) * scale

    ``scale`` is ``1 / B`` for the gradient of the mean loss.

    Parameters
    ----------
    logit : (B,) float array.
    label : (B,) float array of 0/1 (any value in [0, 1] is valid).
    probs : (B,) float array, output; sigmoid(logit).
    dlogit : (B,) float array, output; d(scale * sum loss)/d(logit).
    scale : float.

    Returns
    -------
    float
        The sum of the per-example losses (accumulated in float64).
    """
    total = 0.0
    for i in range(logit.shape[0]):
        x = np.float64(logit[i])
        y = np.float64(label[i])
        if x >= 0.0:
            e = math.exp(-x)
            p = 1.0 / (1.0 + e)
        else:
            e = math.exp(x)
            p = e / (1.0 + e)
        total += max(x, 0.0) - x * y + math.log1p(e)
        probs[i] = p
        dlogit[i] = (p - y) * scale
    return total


@njit(cache=True, nogil=True)
def sigmoid_(logit, probs):
    """``probs = 1 / (1 + exp(-logit))``, overflow-free.

    Parameters
    ----------
    logit : (B,) float array.
    probs : (B,) float array, output (may alias ``logit``).
    """
    for i in range(logit.shape[0]):
        x = np.float64(logit[i])
        if x >= 0.0:
            probs[i] = 1.0 / (1.0 + math.exp(-x))
        else:
            e = math.exp(x)
            probs[i] = e / (1.0 + e)
    return None


# ---------------------------------------------------------------- metric accumulation
# Used by mpips.metrics.BinaryMetrics (bucketed AUC, logloss, calibration).
# Layout of the float64 accumulator ``acc``; mpips.metrics relies on it.
ACC_N, ACC_NPOS, ACC_LOSS, ACC_PRED, ACC_ABS, ACC_SQ, ACC_NAN = range(7)
N_ACC = 7
LOGLOSS_EPS = 1e-7


@njit(cache=True, nogil=True)
def binary_metrics_update_(probs, labels, pos, neg, acc):
    """Add a batch to bucketed pos/neg histograms and scalar sums.

    Bucket of a prediction ``p``: ``min(int(p * nb), nb - 1)`` with ``p`` clipped to
    [0, 1] and ``nb = pos.shape[0]``. A label counts as positive when ``> 0.5``.
    NaN predictions are counted in ``acc[ACC_NAN]`` and otherwise skipped.

    Parameters
    ----------
    probs : (n,) float array; predicted probabilities.
    labels : (n,) numeric array; 0/1 labels.
    pos, neg : (nb,) float64 arrays, accumulated in place; counts per bucket.
    acc : (7,) float64 array, accumulated in place: n, n_pos, sum of logloss (p clipped
        to [1e-7, 1-1e-7]), sum of p, sum of |p - y|, sum of (p - y)^2, n_nan.

    Returns
    -------
    int
        Number of rows added (NaN predictions excluded).
    """
    nb = pos.shape[0]
    added = 0
    for i in range(probs.shape[0]):
        p = np.float64(probs[i])
        if p != p:
            acc[ACC_NAN] += 1.0
            continue
        p = min(max(p, 0.0), 1.0)
        b = min(int(p * nb), nb - 1)
        y = 1.0 if labels[i] > 0.5 else 0.0
        q = min(max(p, LOGLOSS_EPS), 1.0 - LOGLOSS_EPS)
        if y > 0.0:
            pos[b] += 1.0
            acc[ACC_LOSS] -= math.log(q)
        else:
            neg[b] += 1.0
            acc[ACC_LOSS] -= math.log1p(-q)
        acc[ACC_NPOS] += y
        acc[ACC_PRED] += p
        acc[ACC_ABS] += abs(p - y)
        acc[ACC_SQ] += (p - y) * (p - y)
        added += 1
    acc[ACC_N] += added
    return added
