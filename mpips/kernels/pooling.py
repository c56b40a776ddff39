"""Bag pooling kernels: the model input of multi-hot slots, and its gradient per unique id.

A batch of ``n`` examples over ``S`` slots carries its ids in CSR form, example-major:
bag ``(i, s)`` is ``ids[offsets[i*S + s] : offsets[i*S + s + 1]]``.  The trainer pulls the
unique ids' rows once (``rows`` (u, dim)) and maps every id to its row (``inverse``, from
``mpips.kernels.embedding.unique_inverse`` over all slots' ids).  Pooling per slot:
code 0 sums the bag's rows, code 1 takes their mean; an empty bag pools to zeros and gets
no gradient.  One-hot batches (one id per slot) keep ``gather_rows``/``scatter_add_rows``.
"""
from numba import njit

SUM, MEAN = 0, 1  # pooling codes (Schema.pooling_codes)


@njit(cache=True, nogil=True)
def pool_forward(rows, inverse, offsets, pooling, out):
    """``out[i, s*dim:(s+1)*dim]`` = sum (or mean) of ``rows[inverse[k]]`` over bag (i, s).

    Parameters
    ----------
    rows : float (u, dim)          the pulled unique rows
    inverse : int (nnz,)           row of each id of the batch
    offsets : int64 (n*S + 1,)     bag bounds, example-major
    pooling : int (S,)             per slot: 0 sum, 1 mean
    out : float (n, S*dim)         out: overwritten (empty bags -> zeros)

    Returns
    -------
    None
    """
    S = pooling.shape[0]
    dim = rows.shape[1]
    n = out.shape[0]
    for i in range(n):
        for s in range(S):
            b = i * S + s
            lo, hi = offsets[b], offsets[b + 1]
            base = s * dim
            for j in range(dim):
                out[i, base + j] = 0.0
            for k in range(lo, hi):
                r = inverse[k]
                for j in range(dim):
                    out[i, base + j] += rows[r, j]
            if pooling[s] == MEAN and hi - lo > 1:
                inv = 1.0 / (hi - lo)
                for j in range(dim):
                    out[i, base + j] *= inv


@njit(cache=True, nogil=True)
def pool_backward(grad_pooled, inverse, offsets, pooling, out):
    """``out[u]`` = sum over every id k of every bag with ``inverse[k] == u`` of the bag's
    pooled gradient (mean: divided by the bag's length).  Zeroes ``out`` first; sums run in
    id order, so results are deterministic.

    Parameters
    ----------
    grad_pooled : float (n, S*dim)  d loss / d pooled input
    inverse : int (nnz,)
    offsets : int64 (n*S + 1,)
    pooling : int (S,)              per slot: 0 sum, 1 mean
    out : float (u, dim)            out: overwritten

    Returns
    -------
    None
    """
    S = pooling.shape[0]
    dim = out.shape[1]
    out[:] = 0.0
    for i in range(grad_pooled.shape[0]):
        for s in range(S):
            b = i * S + s
            lo, hi = offsets[b], offsets[b + 1]
            base = s * dim
            if pooling[s] == MEAN and hi - lo > 1:
                inv = 1.0 / (hi - lo)
                for k in range(lo, hi):
                    r = inverse[k]
                    for j in range(dim):
                        out[r, j] += grad_pooled[i, base + j] * inv
            else:
                for k in range(lo, hi):
                    r = inverse[k]
                    for j in range(dim):
                        out[r, j] += grad_pooled[i, base + j]
