"""Kernels of the multi-task pieces (numba; mpips.models.layers ``gate``, the ESMM head of
mpips.models.network).

* the MMoE gate: a softmax over experts per example, the experts mixed by it, and the
  backward of both;
* ESMM's loss: pCTR = sigmoid(a), pCTCVR = sigmoid(a) x sigmoid(b), binary cross-entropy of
  the click label on pCTR and of the click-and-purchase label on pCTCVR, and d/da, d/db.

Pure functions: arrays in, preallocated outputs, nothing raised; generic over
float32/float64 (sums in float64).
"""
import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def softmax_rows_(z):
    """In place, per row: ``z = exp(z - max z) / sum exp(z - max z)``.  z : float (B, E)."""
    n, e = z.shape
    for i in range(n):
        m = z[i, 0]
        for k in range(1, e):
            if z[i, k] > m:
                m = z[i, k]
        s = 0.0
        for k in range(e):
            v = math.exp(float(z[i, k] - m))
            z[i, k] = v
            s += v
        for k in range(e):
            z[i, k] = z[i, k] / s


@njit(cache=True, nogil=True)
def mix_(g, k, x, out, acc):
    """``out (+)= g[:, k, None] * x``: expert k's share of the mixture.

    g : float (B, E) gate weights; x, out : float (B, m)."""
    n, m = x.shape
    for i in range(n):
        w = g[i, k]
        if acc:
            for j in range(m):
                out[i, j] += w * x[i, j]
        else:
            for j in range(m):
                out[i, j] = w * x[i, j]


@njit(cache=True, nogil=True)
def rowdot_(a, b, k, out):
    """``out[:, k] = sum_j a[:, j] * b[:, j]`` (float64 sums).  a, b : (B, m); out : (B, E)."""
    n, m = a.shape
    for i in range(n):
        s = 0.0
        for j in range(m):
            s += float(a[i, j]) * float(b[i, j])
        out[i, k] = s


@njit(cache=True, nogil=True)
def softmax_backward_(g, dg, gb):
    """In place ``dg = g * (dg - sum_k g_k dg_k)`` per row (d softmax input), and the bias
    gradient ``gb = column sums`` of the result.  g, dg : (B, E); gb : (E,)."""
    n, e = g.shape
    for k in range(e):
        gb[k] = 0.0
    for i in range(n):
        s = 0.0
        for k in range(e):
            s += float(g[i, k]) * float(dg[i, k])
        for k in range(e):
            v = g[i, k] * (dg[i, k] - s)
            dg[i, k] = v
            gb[k] += v


@njit(cache=True, nogil=True)
def _log_sigmoid(x):
    """log(sigmoid(x)), stable."""
    if x >= 0.0:
        return -math.log1p(math.exp(-x))
    return x - math.log1p(math.exp(x))


@njit(cache=True, nogil=True)
def esmm_bce_(a, b, y, probs, da, db, scale, loss):
    """ESMM's head over the CTR logit ``a`` and the CVR logit ``b``.

    Per example, with ``s = sigmoid``, ``p1 = s(a)``, ``p2 = s(a) s(b)`` (pCTCVR),
    ``y[:, 0]`` the click and ``y[:, 1]`` the click-and-purchase label::

        loss_1 = -[y1 log p1 + (1 - y1) log(1 - p1)]
        loss_2 = -[y2 log p2 + (1 - y2) log(1 - p2)]
        d loss_2 / da = (p2 - y2) (1 - s(a)) / (1 - p2),  d loss_2 / db = the same with s(b)

    Parameters
    ----------
    a, b : float (B,)      the two logits.
    y : float (B, 2)       the labels (click, purchase); a purchase is also a click.
    probs : float (B, 2)   out: (pCTR, pCTCVR).
    da, db : float (B,)    out: scale[0] d loss_1/da + scale[1] d loss_2/da; scale[1] d loss_2/db.
    scale : float64 (2,)   per-task weight x the batch scale.
    loss : float64 (2,)    out: the summed loss_1 and loss_2.
    """
    loss[0] = 0.0
    loss[1] = 0.0
    for i in range(a.shape[0]):
        x1, x2 = float(a[i]), float(b[i])
        y1, y2 = float(y[i, 0]), float(y[i, 1])
        la, lb = _log_sigmoid(x1), _log_sigmoid(x2)
        lna, lnb = _log_sigmoid(-x1), _log_sigmoid(-x2)     # log(1 - s)
        sa, sb = math.exp(la), math.exp(lb)
        lp = la + lb                                        # log p2
        p2 = math.exp(lp)
        # log(1 - p2) = log(1 - e^lp), stable near 0 (expm1) and far below (log1p)
        q = -math.expm1(lp)
        if lp < -0.6931471805599453:
            l1p = math.log1p(-p2)
        elif q > 0.0:
            l1p = math.log(q)
        else:
            l1p = -745.0
        loss[0] += -(y1 * la + (1.0 - y1) * lna)
        loss[1] += -(y2 * lp + (1.0 - y2) * l1p)
        probs[i, 0] = sa
        probs[i, 1] = p2
        # (p2 - y2) / (1 - p2) * (1 - s): the (1 - s) / (1 - p2) ratio in logs
        r_a = math.exp(lna - l1p)
        r_b = math.exp(lnb - l1p)
        g2 = (p2 - y2) * scale[1]
        da[i] = (sa - y1) * scale[0] + g2 * r_a
        db[i] = g2 * r_b
