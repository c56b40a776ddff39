"""Optimizer row kernels and OptimizerConfig against plain numpy references."""
import numpy as np
import pytest

from mpips.kernels.optim import adagrad_rows, adam_rows, add_rows, sgd_rows
from mpips.tables.optim import OptimizerConfig, apply_rows, new_state, state_arrays

R, DIM = 12, 5


def setup(seed=0):
    rng = np.random.default_rng(seed)
    return rng, rng.normal(size=(R, DIM)).astype(np.float32)


def pushes(rng, n_push=6):
    """Several pushes with overlapping row sets and their gradients."""
    for _ in range(n_push):
        rows = np.sort(rng.choice(R, size=rng.integers(1, R), replace=False)).astype(np.int64)
        yield rows, rng.normal(size=(rows.shape[0], DIM)).astype(np.float32)


def test_sgd_rows():
    rng, w = setup()
    ref = w.astype(np.float64)
    for rows, g in pushes(rng):
        sgd_rows(w, rows, g, 0.1, 0.5)
        ref[rows] -= 0.1 * 0.5 * g
    np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-6)


def test_adagrad_rows():
    rng, w = setup(1)
    acc = np.full((R, DIM), 0.1, np.float32)
    ref_w, ref_a = w.astype(np.float64), acc.astype(np.float64)
    for rows, g in pushes(rng):
        adagrad_rows(w, acc, rows, g, 0.05, 1e-6, 2.0)
        gs = 2.0 * g.astype(np.float64)
        ref_a[rows] += gs * gs
        ref_w[rows] -= 0.05 * gs / (np.sqrt(ref_a[rows]) + 1e-6)
    np.testing.assert_allclose(acc, ref_a, rtol=1e-5)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)


def adam_reference(w, pushes_list, lr, b1, b2, eps, scale):
    """Lazy Adam, textbook form with per-row step counts t."""
    w = w.astype(np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    t = np.zeros(w.shape[0])
    for rows, g in pushes_list:
        g = scale * g.astype(np.float64)
        t[rows] += 1
        m[rows] = b1 * m[rows] + (1 - b1) * g
        v[rows] = b2 * v[rows] + (1 - b2) * g * g
        mhat = m[rows] / (1 - b1 ** t[rows])[:, None]
        vhat = v[rows] / (1 - b2 ** t[rows])[:, None]
        w[rows] -= lr * mhat / (np.sqrt(vhat) + eps)
    return w, m, v, t


def test_lazy_adam_per_row_steps():
    rng, w = setup(2)
    plist = list(pushes(rng, 8))
    lr, b1, b2, eps, scale = 0.01, 0.9, 0.99, 1e-8, 0.5
    ref_w, ref_m, ref_v, t = adam_reference(w, plist, lr, b1, b2, eps, scale)
    assert len(set(t.tolist())) > 2                  # rows really have different counts
    m, v = np.zeros_like(w), np.zeros_like(w)
    b1p, b2p = np.full(R, b1, np.float32), np.full(R, b2, np.float32)
    hyper = np.array([lr, b1, b2, eps, scale])
    for rows, g in plist:
        adam_rows(w, m, v, b1p, b2p, rows, g, hyper)
    np.testing.assert_allclose(m, ref_m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(b1p, b1 ** (t + 1), rtol=1e-5)
    np.testing.assert_allclose(b2p, b2 ** (t + 1), rtol=1e-5)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-5)
    untouched = t == 0
    if untouched.any():
        assert np.array_equal(b1p[untouched], np.full(untouched.sum(), b1, np.float32))


def adam_float32_steps(w, g_steps, hyper):
    """Adam on one wide row as the kernel's module doc writes it, in numpy float32 (bias
    correction in float64): what the vectorised kernel must give bit for bit."""
    f32 = np.float32
    lr, b1, b2, eps, scale = (float(x) for x in hyper)
    beta1, beta2, sc, one = f32(b1), f32(b2), f32(scale), f32(1.0)
    m, v = np.zeros_like(w), np.zeros_like(w)
    b1p, b2p = f32(b1), f32(b2)
    for g in g_steps:
        c2 = np.sqrt(1.0 - np.float64(b2p))
        lr_t = f32(lr * c2 / (1.0 - np.float64(b1p)))
        eps_t = f32(eps * c2)
        gs = g * sc
        m = beta1 * m + (one - beta1) * gs
        v = beta2 * v + (one - beta2) * gs * gs
        w = w - lr_t * m / (np.sqrt(v) + eps_t)
        b1p, b2p = f32(np.float64(b1p) * b1), f32(np.float64(b2p) * b2)
    return w, m, v


@pytest.mark.parametrize('n', [1, 37, 4099])
def test_adam_on_a_wide_row_is_bit_exact_to_float32_numpy(n):
    """The dense table is one row of every weight: the element loop is vectorised
    (error_model="numpy"), and must do exactly the scalar float32 operations (no
    reassociation, no fused multiply-add), vector tails included."""
    rng = np.random.default_rng(7)
    w = rng.normal(size=(1, n)).astype(np.float32)
    g_steps = [rng.normal(scale=10.0 ** rng.integers(-6, 2), size=(1, n)).astype(np.float32)
               for _ in range(5)]
    g_steps[1][0, ::3] = 0.0                                 # v's and m's zero corners
    hyper = np.array([1e-3, 0.9, 0.999, 1e-8, 1.0 / 512])
    ref_w, ref_m, ref_v = adam_float32_steps(w.copy(), g_steps, hyper)
    m, v = np.zeros_like(w), np.zeros_like(w)
    b1p, b2p = np.full(1, 0.9, np.float32), np.full(1, 0.999, np.float32)
    for g in g_steps:
        adam_rows(w, m, v, b1p, b2p, np.zeros(1, np.int64), g, hyper)
    assert np.array_equal(m, ref_m) and np.array_equal(v, ref_v)
    assert np.array_equal(w, ref_w)


def test_add_rows():
    rng, w = setup(3)
    ref = w.copy()
    rows = np.array([3, 0, 7], np.int64)
    d = rng.normal(size=(3, DIM)).astype(np.float32)
    add_rows(w, rows, d)
    ref[rows] += d
    assert np.array_equal(w, ref)


@pytest.mark.parametrize('name', ['sgd', 'adagrad', 'adam'])
def test_apply_rows_dispatch_matches_kernels(name):
    opt = OptimizerConfig(name, lr=0.02, initial_accumulator=0.1)
    rng, w = setup(4)
    w2 = w.copy()
    state = new_state(opt, R, DIM)
    state2 = {k: a.copy() for k, a in state.items()}
    rows = np.array([1, 4, 9], np.int64)
    g = rng.normal(size=(3, DIM)).astype(np.float32)
    apply_rows(opt, opt.hyper(), w, state, rows, g, 0.25)
    if name == 'sgd':
        sgd_rows(w2, rows, g, 0.02, 0.25)
    elif name == 'adagrad':
        adagrad_rows(w2, state2['accum'], rows, g, 0.02, opt.epsilon, 0.25)
    else:
        adam_rows(w2, state2['m'], state2['v'], state2['beta1_pow'], state2['beta2_pow'],
                  rows, g, opt.hyper(0.25))
    assert np.array_equal(w, w2)
    for k in state:
        assert np.array_equal(state[k], state2[k])


def test_config_validation_and_state():
    with pytest.raises(ValueError, match='sgd, adagrad, adam'):
        OptimizerConfig('rmsprop')
    for bad in (dict(lr=0), dict(beta1=1.0), dict(beta2=-0.1), dict(epsilon=0),
                dict(initial_accumulator=-1)):
        with pytest.raises(ValueError):
            OptimizerConfig('adam', **bad)
    assert state_arrays('sgd') == []
    assert state_arrays('adagrad') == [('accum', True)]
    assert [n for n, _ in state_arrays('adam')] == ['m', 'v', 'beta1_pow', 'beta2_pow']
    st = new_state(OptimizerConfig('adam', beta1=0.8, beta2=0.95), 3, 2)
    assert st['m'].shape == (3, 2) and st['beta1_pow'].shape == (3,)
    assert np.allclose(st['beta1_pow'], 0.8) and np.allclose(st['beta2_pow'], 0.95)
    assert np.all(new_state(OptimizerConfig('adagrad', initial_accumulator=0.1), 2, 2)
                  ['accum'] == np.float32(0.1))
