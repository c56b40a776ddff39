"""Numba optimizer kernels that update a subset of rows of 2-D parameter arrays.

Sparse tables pass the rows named in a push (as paged columns, see
:mod:`mpips.kernels.pages`); a dense table is one flat row of width n and passes
``rows = [0]``. Gradients are multiplied by ``scale`` first (e.g. 1 / n_workers).
Parameters and state are float32. SGD and Adagrad do each element's arithmetic in float64
(``lr``, ``eps`` and ``scale`` come in as float64) and round once when storing; Adam does
its element arithmetic in float32 (half the time of float64 on the wide dense row) and
only the per-row bias correction (``b1p``, ``b2p``, ``lr_t``) in float64. Rows listed twice
are updated twice (callers pass unique rows).

The kernels compile with numba's ``error_model="numpy"``: a float division is then a plain
division (no zero test that raises), so LLVM vectorises the element loop; on the dense row
(hundreds of thousands of weights, one row) that is the whole optimizer step.  Nothing
changes in the results: no divisor here can be zero (``eps > 0``), and vector lanes do the
same IEEE operations as the scalar loop (no reassociation, no fused multiply-add: numba
compiles without fast-math), which tests/test_optim.py checks bit for bit.

Each kernel prefetches the record of the row ``AHEAD`` rows on (:func:`mpips.kernels.pages.prefetch`):
a push names rows of a big table in random order, and without the hint each row's cache
misses come one after the other (lazy Adam on 50k random rows of 1.17M: 200 -> 60 ns a row).

``lr_scale`` (float32 (n,), optional) multiplies the learning rate of each pushed row
(``lr * lr_scale[i]`` in float64; the staleness rules of :mod:`mpips.tables.staleness`);
without it (None) the kernels compute exactly what they computed before it existed.

Formulas (g = grad * scale), matching PaddlePaddle's operators:

* SGD:      ``w -= lr * g``
* Adagrad:  ``a += g**2 ; w -= lr * g / (sqrt(a) + eps)``  (Paddle ``adagrad`` op)
* Adam (lazy, Paddle ``adam`` op with ``lazy_mode=True``): per-row beta powers
  ``b1p, b2p`` hold ``beta1**t, beta2**t`` for the row's t-th update (they start at
  ``beta1, beta2``, not 1)::

      m = beta1 * m + (1 - beta1) * g
      v = beta2 * v + (1 - beta2) * g * g
      lr_t = lr * sqrt(1 - b2p) / (1 - b1p)
      w -= lr_t * m / (sqrt(v) + eps * sqrt(1 - b2p))
      b1p *= beta1 ; b2p *= beta2

  which equals textbook Adam ``w -= lr * m_hat / (sqrt(v_hat) + eps)``. Only rows in
  the push move; each row's bias correction follows its own update count.
"""
import numpy as np
from numba import njit

from mpips.kernels.pages import AHEAD, at, prefetch, put, row

# Layout of the ``hyper`` array taken by :func:`adam_rows`.
H_LR, H_BETA1, H_BETA2, H_EPS, H_SCALE = 0, 1, 2, 3, 4
N_HYPER = 5


@njit(cache=True, nogil=True, error_model="numpy")
def sgd_rows(values, rows, grads, lr, scale, lr_scale=None):
    """Plain SGD on selected rows.

    Parameters
    ----------
    values : float32 (R, dim)    in/out
    rows : int64 (n,)            row index of each gradient row
    grads : float32 (n, dim)
    lr, scale : float
    lr_scale : float32 (n,) or None   per-row learning-rate factor

    Returns
    -------
    None
    """
    step = lr * scale
    n = rows.shape[0]
    for i in range(n):
        if i + AHEAD < n:           # the record of a row further on (module doc)
            prefetch(values, rows[i + AHEAD])
        w = row(values, rows[i])
        st = step
        if lr_scale is not None:
            st = lr * np.float64(lr_scale[i]) * scale
        for j in range(w.shape[0]):
            w[j] = w[j] - st * grads[i, j]


@njit(cache=True, nogil=True, error_model="numpy")
def adagrad_rows(values, accum, rows, grads, lr, eps, scale, lr_scale=None):
    """Adagrad on selected rows: ``a += g^2 ; w -= lr * g / (sqrt(a) + eps)``.

    Parameters
    ----------
    values : float32 (R, dim)    in/out
    accum : float32 (R, dim)     in/out, squared-gradient accumulator
    rows : int64 (n,)
    grads : float32 (n, dim)
    lr, eps, scale : float
    lr_scale : float32 (n,) or None   per-row learning-rate factor

    Returns
    -------
    None
    """
    n = rows.shape[0]
    for i in range(n):
        if i + AHEAD < n:           # the record of a row further on (module doc)
            prefetch(values, rows[i + AHEAD])
        r = rows[i]
        w, acc = row(values, r), row(accum, r)
        lr_i = lr
        if lr_scale is not None:
            lr_i = lr * np.float64(lr_scale[i])
        for j in range(w.shape[0]):
            g = grads[i, j] * scale
            a = acc[j] + g * g
            acc[j] = a
            w[j] = w[j] - lr_i * g / (np.sqrt(a) + eps)


@njit(cache=True, nogil=True, error_model="numpy")
def adam_rows(values, m, v, b1pow, b2pow, rows, grads, hyper, lr_scale=None):
    """Lazy Adam on selected rows with per-row bias correction (see module doc).

    Parameters
    ----------
    values : float32 (R, dim)    in/out
    m, v : float32 (R, dim)      in/out, first and second moments
    b1pow, b2pow : float32 (R,)  in/out, beta1**t and beta2**t of each row's next step
    rows : int64 (n,)
    grads : float32 (n, dim)
    hyper : float64 (5,)         lr, beta1, beta2, eps, scale (H_* indices)
    lr_scale : float32 (n,) or None   per-row learning-rate factor (the step, not m or v)

    Returns
    -------
    None
    """
    beta1 = np.float32(hyper[H_BETA1])    # element maths in float32: half the time of
    beta2 = np.float32(hyper[H_BETA2])    # float64 on the 200k-wide dense row
    scale = np.float32(hyper[H_SCALE])
    one = np.float32(1.0)
    n = rows.shape[0]
    for i in range(n):
        if i + AHEAD < n:           # the record of a row further on (module doc)
            prefetch(values, rows[i + AHEAD])
        r = rows[i]
        b1p = np.float64(at(b1pow, r))
        b2p = np.float64(at(b2pow, r))
        c2 = np.sqrt(1.0 - b2p)
        lr_i = hyper[H_LR]
        if lr_scale is not None:
            lr_i = hyper[H_LR] * np.float64(lr_scale[i])
        lr_t = np.float32(lr_i * c2 / (1.0 - b1p))
        eps_t = np.float32(hyper[H_EPS] * c2)
        w, mr, vr, g = row(values, r), row(m, r), row(v, r), grads[i]
        for j in range(w.shape[0]):
            gj = g[j] * scale
            mj = beta1 * mr[j] + (one - beta1) * gj
            vj = beta2 * vr[j] + (one - beta2) * gj * gj
            mr[j] = mj
            vr[j] = vj
            w[j] = w[j] - lr_t * mj / (np.sqrt(vj) + eps_t)
        put(b1pow, r, np.float32(b1p * hyper[H_BETA1]))
        put(b2pow, r, np.float32(b2p * hyper[H_BETA2]))


@njit(cache=True, nogil=True)
def add_rows(values, rows, deltas):
    """``values[rows[i]] += deltas[i]`` (GEO-SGD delta merge).

    Parameters
    ----------
    values : float32 (R, dim)    in/out
    rows : int64 (n,)
    deltas : float32 (n, dim)

    Returns
    -------
    None
    """
    n = rows.shape[0]
    for i in range(n):
        if i + AHEAD < n:           # the record of a row further on (module doc)
            prefetch(values, rows[i + AHEAD])
        w = row(values, rows[i])
        for j in range(w.shape[0]):
            w[j] += deltas[i, j]


@njit(cache=True, nogil=True)
def ema_update(avg, values, decay):
    """``avg = decay * avg + (1 - decay) * values`` in place, in float32, one pass
    (--dense-average: the moving average of the dense weights after a dense step).

    avg, values : float32 (n,); decay : float32 in [0, 1).  No fast-math: each element is
    the same two products and one sum whatever the slice, so a shard's update equals the
    whole vector's on those elements."""
    rest = np.float32(1.0) - decay
    for i in range(avg.shape[0]):
        avg[i] = decay * avg[i] + rest * values[i]
