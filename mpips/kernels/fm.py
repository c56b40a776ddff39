"""First-order (wide) and FM kernels for Wide&Deep and DeepFM (numba).

The models that learn a first-order weight ``w`` per id keep it in the same table row as
the embedding, ``[w | v_1..v_d]`` (row width ``W = d + 1``).  After pooling, slot ``f`` of
example ``i`` owns the ``W`` columns ``emb[i, f*W : (f+1)*W]``: column 0 is ``pool(w)_f``,
columns 1.. the pooled embedding ``p_f`` (d values).  These kernels split that input for
the MLP and compute, per example,

    first[i] = sum_f pool(w)_f                                          (wide / first order)
    fm[i]    = 0.5 * sum_k [ (sum_f p_fk)^2 - sum_f p_fk^2 ]            (FM, pairs f < g)

and the gradients into the ``W``-wide input.  Sums run in float64 and are cast once, in a
fixed order, so results do not depend on threads or batch splits.  Pure functions:
arrays in, preallocated outputs, nothing raised.
"""
from numba import njit


@njit(cache=True, nogil=True)
def wide_fm_forward_(emb, n_slots, use_fm, x_out, wide_out):
    """Split the pooled rows and compute the per-example first-order (+ FM) sum.

    Parameters
    ----------
    emb : float (B, S*W)       pooled ``[w | p]`` rows, slot-major
    n_slots : int              S
    use_fm : bool              add the FM term
    x_out : float (B, >= S*d)  out: columns [0, S*d) get ``p`` (the MLP input), slot-major
    wide_out : float (B,)      out: first[i] (+ fm[i])

    Returns
    -------
    None
    """
    n = emb.shape[0]
    W = emb.shape[1] // n_slots
    d = W - 1
    for i in range(n):
        first = 0.0
        for f in range(n_slots):
            first += emb[i, f * W]
            for k in range(d):
                x_out[i, f * d + k] = emb[i, f * W + 1 + k]
        fm = 0.0
        if use_fm:
            for k in range(d):
                s = 0.0
                q = 0.0
                for f in range(n_slots):
                    v = float(emb[i, f * W + 1 + k])
                    s += v
                    q += v * v
                fm += s * s - q
        wide_out[i] = first + 0.5 * fm
    return None


@njit(cache=True, nogil=True)
def wide_fm_backward_(emb, n_slots, use_fm, dlogit, grad_p, grad_out):
    """Gradient into the pooled ``[w | p]`` rows: d(first)/d(w) = 1, d(fm)/d(p_fk) =
    ``sum_g p_gk - p_fk``, plus the MLP's gradient ``grad_p`` for the ``p`` columns.

    Parameters
    ----------
    emb : float (B, S*W)        the forward's input
    n_slots : int               S
    use_fm : bool               the FM term is in the logit
    dlogit : float (B,)         d(loss)/d(logit)
    grad_p : float (B, S*d)     d(loss)/d(p) through the MLP
    grad_out : float (B, S*W)   out: d(loss)/d(emb), overwritten

    Returns
    -------
    None
    """
    n = emb.shape[0]
    W = emb.shape[1] // n_slots
    d = W - 1
    for i in range(n):
        g = dlogit[i]
        for f in range(n_slots):
            grad_out[i, f * W] = g
            for k in range(d):
                grad_out[i, f * W + 1 + k] = grad_p[i, f * d + k]
        if use_fm:
            for k in range(d):
                s = 0.0
                for f in range(n_slots):
                    s += emb[i, f * W + 1 + k]
                for f in range(n_slots):
                    grad_out[i, f * W + 1 + k] += g * (s - emb[i, f * W + 1 + k])
    return None
