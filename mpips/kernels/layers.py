"""Elementwise kernels of the layer vocabulary (numba; mpips.models.layers).

The large products of every layer run through BLAS (``np.matmul(..., out=)``); these
kernels do the memory-bound work between them, one pass each.  ``acc`` arguments say
whether a kernel adds its result into the output (another consumer wrote there first) or
overwrites it.  Sums that the float64 references pin down (the first-order and FM terms)
run in float64 and are cast once, in a fixed order.  Pure
functions: arrays in, preallocated outputs, nothing raised; generic over float32/float64.
"""
import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def first_order_fm_forward_(w, p, n_fields, use_fm, out):
    """Per example ``sum_f w[i, f]`` (+ ``0.5 * sum_k [(sum_f p_fk)^2 - sum_f p_fk^2]``).

    Parameters
    ----------
    w : float (B, S)          pooled first-order weights, one per slot
    p : float (B, F*d)        pooled field vectors (read only when ``use_fm``)
    n_fields : int            F
    use_fm : bool             add the FM term (the fm2 layer folded into the sum)
    out : float (B,)          out: the float64 sum, cast once
    """
    n, s = w.shape
    d = p.shape[1] // n_fields if n_fields > 0 else 0
    for i in range(n):
        first = 0.0
        for f in range(s):
            first += w[i, f]
        fm = 0.0
        if use_fm:
            for k in range(d):
                t = 0.0
                q = 0.0
                for f in range(n_fields):
                    v = float(p[i, f * d + k])
                    t += v
                    q += v * v
                fm += t * t - q
        out[i] = first + 0.5 * fm
    return None


@njit(cache=True, nogil=True)
def fm2_forward_(p, n_fields, out):
    """``out[i] = 0.5 * sum_k [(sum_f p_fk)^2 - sum_f p_fk^2]`` (float64 sums), (B,)."""
    n = p.shape[0]
    d = p.shape[1] // n_fields
    for i in range(n):
        fm = 0.0
        for k in range(d):
            t = 0.0
            q = 0.0
            for f in range(n_fields):
                v = float(p[i, f * d + k])
                t += v
                q += v * v
            fm += t * t - q
        out[i] = 0.5 * fm
    return None


@njit(cache=True, nogil=True)
def fm2_backward_(p, n_fields, g, gp, acc):
    """d(fm)/d(p_fk) = ``sum_h p_hk - p_fk``, times ``g[i]``, into ``gp`` (B, F*d).

    With ``acc`` the term is added to what ``gp`` holds, in float64, and cast once."""
    n = p.shape[0]
    d = p.shape[1] // n_fields
    for i in range(n):
        gi = g[i]
        for k in range(d):
            t = 0.0
            for f in range(n_fields):
                t += p[i, f * d + k]
            for f in range(n_fields):
                j = f * d + k
                if acc:
                    gp[i, j] += gi * (t - p[i, j])
                else:
                    gp[i, j] = gi * (t - p[i, j])
    return None


@njit(cache=True, nogil=True)
def broadcast_(g, out, acc):
    """``out[i, j] (+)= g[i]`` for every column j: the gradient of a sum over columns."""
    n, m = out.shape
    for i in range(n):
        for j in range(m):
            if acc:
                out[i, j] += g[i]
            else:
                out[i, j] = g[i]
    return None


@njit(cache=True, nogil=True)
def outer_(g, w, out, acc):
    """``out[i, j] (+)= g[i] * w[j]``: the input gradient of a width-1 linear layer."""
    n, m = out.shape
    for i in range(n):
        gi = g[i]
        for j in range(m):
            if acc:
                out[i, j] += gi * w[j]
            else:
                out[i, j] = gi * w[j]
    return None


@njit(cache=True, nogil=True)
def colsum_(g, gb):
    """``gb[j] = sum_i g[i, j]`` in row order (the bias gradient of an identity layer)."""
    n, m = g.shape
    zero = g.dtype.type(0)
    for j in range(m):
        gb[j] = zero
    for i in range(n):
        for j in range(m):
            gb[j] += g[i, j]
    return None


@njit(cache=True, nogil=True)
def bias_sigmoid_(z, b):
    """In place ``z = 1 / (1 + exp(-(z + b)))`` (overflow-free)."""
    n, h = z.shape
    one = z.dtype.type(1)
    for i in range(n):
        for j in range(h):
            v = z[i, j] + b[j]
            if v >= 0:
                z[i, j] = one / (one + np.exp(-v))
            else:
                e = np.exp(v)
                z[i, j] = e / (one + e)
    return None


@njit(cache=True, nogil=True)
def sigmoid_backward_colsum_(da, a, gb):
    """In place ``da = da * a * (1 - a)`` and ``gb = sum over rows of the result``."""
    n, h = da.shape
    one = da.dtype.type(1)
    for j in range(h):
        gb[j] = da.dtype.type(0)
    for i in range(n):
        for j in range(h):
            v = da[i, j] * a[i, j] * (one - a[i, j])
            da[i, j] = v
            gb[j] += v
    return None


@njit(cache=True, nogil=True)
def add_into_(src, out, acc):
    """``out (+)= src`` (same shapes): a gradient handed on to one more input."""
    n, m = out.shape
    for i in range(n):
        for j in range(m):
            if acc:
                out[i, j] += src[i, j]
            else:
                out[i, j] = src[i, j]
    return None


@njit(cache=True, nogil=True)
def mul_into_(a, b, out, acc):
    """``out (+)= a * b`` elementwise (the Hadamard product, and its gradients)."""
    n, m = out.shape
    for i in range(n):
        for j in range(m):
            if acc:
                out[i, j] += a[i, j] * b[i, j]
            else:
                out[i, j] = a[i, j] * b[i, j]
    return None


@njit(cache=True, nogil=True)
def cross_combine_(x0, z, b, xl, out):
    """DCN-v2's step: in place ``z += b``, then ``out = x0 * z + xl`` (all (B, n))."""
    n, m = out.shape
    for i in range(n):
        for j in range(m):
            v = z[i, j] + b[j]
            z[i, j] = v
            out[i, j] = x0[i, j] * v + xl[i, j]
    return None


@njit(cache=True, nogil=True)
def cross_backward_(g, x0, z, dz, gb, gx0, acc):
    """``dz = g * x0`` and ``gb = colsum(dz)``; ``gx0 (+)= g * z`` (the x0 side)."""
    n, m = g.shape
    zero = g.dtype.type(0)
    for j in range(m):
        gb[j] = zero
    for i in range(n):
        for j in range(m):
            v = g[i, j] * x0[i, j]
            dz[i, j] = v
            gb[j] += v
            if acc:
                gx0[i, j] += g[i, j] * z[i, j]
            else:
                gx0[i, j] = g[i, j] * z[i, j]
    return None


@njit(cache=True, nogil=True)
def cross_v1_combine_(x0, s, b, xl, out):
    """DCN (v1)'s step: ``out = x0 * s[:, None] + b + xl`` with ``s = xl . w`` (B,)."""
    n, m = out.shape
    for i in range(n):
        for j in range(m):
            out[i, j] = x0[i, j] * s[i] + b[j] + xl[i, j]
    return None


@njit(cache=True, nogil=True)
def cross_v1_backward_(g, x0, s, ds, gb, gx0, acc):
    """``ds[i] = sum_j g * x0``, ``gb = colsum(g)``, ``gx0 (+)= g * s[:, None]``."""
    n, m = g.shape
    zero = g.dtype.type(0)
    for j in range(m):
        gb[j] = zero
    for i in range(n):
        t = 0.0
        for j in range(m):
            t += g[i, j] * x0[i, j]
            gb[j] += g[i, j]
            if acc:
                gx0[i, j] += g[i, j] * s[i]
            else:
                gx0[i, j] = g[i, j] * s[i]
        ds[i] = t
    return None


@njit(cache=True, nogil=True)
def split_rows_(emb, n_slots, w_out, p_out):
    """Pooled ``[w | p]`` rows (B, S*(d+1)) -> first-order weights (B, S) and the field
    vectors (B, S*d), slot-major."""
    n = emb.shape[0]
    W = emb.shape[1] // n_slots
    d = W - 1
    for i in range(n):
        for f in range(n_slots):
            w_out[i, f] = emb[i, f * W]
            for k in range(d):
                p_out[i, f * d + k] = emb[i, f * W + 1 + k]
    return None


@njit(cache=True, nogil=True)
def merge_rows_(gw, gp, n_slots, out):
    """The inverse of :func:`split_rows_` for gradients: (B, S) and (B, S*d) -> (B, S*W)."""
    n = out.shape[0]
    W = out.shape[1] // n_slots
    d = W - 1
    for i in range(n):
        for f in range(n_slots):
            out[i, f * W] = gw[i, f]
            for k in range(d):
                out[i, f * W + 1 + k] = gp[i, f * d + k]
    return None

