"""CTR-DNN maths: loss, gradients (finite differences), predict, init, kernels."""
import numpy as np
import pytest

from mpips.kernels import mlp
from mpips.models import network as ctr_dnn
from mpips.models import zoo


def CTRDNN(n_sparse, dim, n_dense, hidden=(400, 400, 400), **kw):
    """The built-in dnn network (the CTR-DNN) through the layer path."""
    return zoo.builtin("dnn", n_sparse, dim, n_dense, hidden, **kw)

pytestmark = pytest.mark.exact      # float results against references, bit-equal paths

TINY = dict(n_sparse=4, dim=3, n_dense=2, hidden=(5, 4))


def make_batch(model, batch, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((batch, model.emb_width)).astype(dtype)
    dense = rng.random((batch, model.n_dense)).astype(dtype)
    label = (rng.random(batch) < 0.4).astype(dtype)
    return emb, dense, label


def reference_forward(model, params, emb, dense):
    """Plain numpy float64 CTR-DNN: returns logits (B,)."""
    v = {k: a.astype(np.float64) for k, a in model.views(params).items()}
    h = np.concatenate([emb, dense], axis=1).astype(np.float64)
    for i in range(len(model.hidden)):
        h = np.maximum(h @ v[f"fc{i}.w"] + v[f"fc{i}.b"], 0.0)
    return h @ v["out.w"] + v["out.b"][0]


def reference_loss(logit, label):
    return float(np.mean(np.logaddexp(0.0, logit) - label * logit))


def run_fb(model, params, emb, dense, label):
    grad = np.empty_like(params)
    gemb = np.empty((emb.shape[0], model.emb_width), model.dtype)
    loss, probs = model.forward_backward(params, emb, dense, label, grad, gemb)
    return loss, probs.copy(), grad, gemb


def test_layout_is_contiguous_and_complete():
    m = CTRDNN(**TINY)
    off = 0
    for name, o, shape in m.layout:
        assert o == off
        off += int(np.prod(shape))
    assert off == m.n_params == (14 * 5 + 5) + (5 * 4 + 4) + (4 + 1)
    assert [n for n, _, _ in m.layout] == ["fc0.w", "fc0.b", "fc1.w", "fc1.b", "out.w", "out.b"]
    default = CTRDNN(n_sparse=26, dim=10, n_dense=13)     # Criteo's 26 slots + 13 dense
    assert default.tensors["x"].width == 26 * 10 + 13      # the MLP's input
    assert default.n_params == 273 * 400 + 400 + 2 * (400 * 400 + 400) + 401


def test_loss_and_probs_match_numpy_reference():
    m = CTRDNN(**TINY, dtype=np.float64)
    params = m.init_params(3)
    emb, dense, label = make_batch(m, 7)
    loss, probs, _, _ = run_fb(m, params, emb, dense, label)
    logit = reference_forward(m, params, emb, dense)
    assert loss == pytest.approx(reference_loss(logit, label), rel=1e-12)
    np.testing.assert_allclose(probs, 1.0 / (1.0 + np.exp(-logit)), rtol=1e-12)
    assert m.loss(params, emb, dense, label) == pytest.approx(loss, rel=1e-12)


def test_gradients_match_central_differences():
    m = CTRDNN(**TINY, dtype=np.float64)
    rng = np.random.default_rng(1)
    params = m.init_params(0)
    params += 0.1 * rng.standard_normal(m.n_params)      # non-zero biases too
    emb, dense, label = make_batch(m, 7, seed=2)
    _, _, grad, gemb = run_fb(m, params, emb, dense, label)
    eps = 1e-6
    fd = np.empty(m.n_params)
    for k in range(m.n_params):
        p1, p2 = params.copy(), params.copy()
        p1[k] += eps
        p2[k] -= eps
        fd[k] = (m.loss(p1, emb, dense, label) - m.loss(p2, emb, dense, label)) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)
    fd_emb = np.empty_like(emb)
    for idx in np.ndindex(*emb.shape):
        e1, e2 = emb.copy(), emb.copy()
        e1[idx] += eps
        e2[idx] -= eps
        fd_emb[idx] = (m.loss(params, e1, dense, label)
                       - m.loss(params, e2, dense, label)) / (2 * eps)
    np.testing.assert_allclose(gemb, fd_emb, rtol=1e-5, atol=1e-8)
    assert np.abs(grad).min() >= 0 and np.abs(grad).max() > 1e-3   # not trivially zero


def test_float32_matches_float64_and_stays_float32():
    m64 = CTRDNN(**TINY, dtype=np.float64)
    m32 = CTRDNN(**TINY)
    p64 = m64.init_params(5)
    p32 = m32.init_params(5)
    np.testing.assert_array_equal(p32, p64.astype(np.float32))
    emb, dense, label = make_batch(m64, 9, seed=4)
    l64, pr64, g64, ge64 = run_fb(m64, p64, emb, dense, label)
    l32, pr32, g32, ge32 = run_fb(m32, p32, emb.astype(np.float32),
                                   dense.astype(np.float32), label.astype(np.float32))
    assert pr32.dtype == g32.dtype == ge32.dtype == np.float32
    fc = m32.tensors["fc"].producer
    for arr in [*m32._out.values(), *m32._grad.values(), m32.probs, *fc.acts, *fc.grads]:
        assert arr.dtype == np.float32
    assert l32 == pytest.approx(l64, rel=1e-5)
    np.testing.assert_allclose(g32, g64, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(ge32, ge64, rtol=1e-3, atol=1e-5)


def test_workspace_reuse_with_smaller_batch():
    m = CTRDNN(**TINY)
    fresh = CTRDNN(**TINY)
    params = m.init_params(0)
    emb, dense, label = make_batch(m, 16, seed=6, dtype=np.float32)
    run_fb(m, params, emb, dense, label)                   # workspace for 16 rows
    ws = m._out["fc"]
    got = run_fb(m, params, emb[:5], dense[:5], label[:5])
    want = run_fb(fresh, params, emb[:5], dense[:5], label[:5])
    assert m._out["fc"] is ws                              # no re-allocation
    assert got[0] == want[0]
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(a, b)


def test_predict_equals_forward_probs(monkeypatch):
    m = CTRDNN(**TINY)
    params = m.init_params(2)
    emb, dense, label = make_batch(m, 23, seed=7, dtype=np.float32)
    _, probs, _, _ = run_fb(CTRDNN(**TINY), params, emb, dense, label)
    out = np.empty(23, np.float32)
    monkeypatch.setattr(ctr_dnn, "PREDICT_CHUNK", 6)      # exercise chunking
    m.predict(params, emb, dense, out)
    assert m._ws_cap == 6
    np.testing.assert_allclose(out, probs, rtol=1e-6)
    out64 = np.empty(23)
    m.predict(params, emb, dense, out64)
    np.testing.assert_allclose(out64, probs, rtol=1e-6)


def test_init_is_deterministic_and_scaled():
    for init in ctr_dnn.INITS:
        m = CTRDNN(26, 10, 13, hidden=(40, 30), init=init)
        a, b, c = m.init_params(11), m.init_params(11), m.init_params(12)
        assert a.dtype == np.float32 and a.shape == (m.n_params,)
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)
        v = m.views(a)
        for name, _, shape in m.layout:
            if name.endswith(".b"):
                assert not v[name].any()
            else:
                fan_in = shape[0]
                fan_out = shape[1] if len(shape) == 2 else 1
                bound = {"uniform": 1 / np.sqrt(fan_in),
                         "xavier": np.sqrt(6 / (fan_in + fan_out)),
                         "normal": 6 / np.sqrt(fan_in)}[init]
                assert np.abs(v[name]).max() <= bound * (1 + 1e-6)
                assert v[name].std() > 0.1 * bound


def test_extreme_logits_are_finite():
    logit = np.array([-100.0, -30.0, 0.0, 30.0, 100.0], np.float32)
    label = np.array([1, 0, 1, 1, 0], np.float32)
    probs, dlogit = np.empty(5, np.float32), np.empty(5, np.float32)
    total = mlp.sigmoid_bce_(logit, label, probs, dlogit, 0.5)
    ref = np.logaddexp(0.0, logit.astype(np.float64)) - label * logit
    assert total == pytest.approx(ref.sum(), rel=1e-12)
    p64 = 1 / (1 + np.exp(-logit.astype(np.float64)))
    np.testing.assert_allclose(probs, p64, rtol=1e-6, atol=1e-40)      # float32 denormals
    np.testing.assert_allclose(dlogit, (p64 - label) * 0.5, rtol=1e-6, atol=1e-40)
    out = np.empty(5, np.float32)
    mlp.sigmoid_(logit, out)
    np.testing.assert_array_equal(out, probs)


def test_kernels_against_numpy():
    rng = np.random.default_rng(8)
    z = rng.standard_normal((6, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    want = np.maximum(z + b, 0)
    mlp.bias_relu_(z, b)
    np.testing.assert_array_equal(z, want)
    a = want                                               # has exact zeros
    da = rng.standard_normal((6, 5)).astype(np.float32)
    gb = np.full(5, 9.0, np.float32)
    want = da * (a > 0)
    mlp.relu_backward_colsum_(da, a, gb)
    np.testing.assert_array_equal(da, want)
    np.testing.assert_allclose(gb, want.sum(axis=0), rtol=1e-6)
    dlogit = rng.standard_normal(6).astype(np.float32)
    w = rng.standard_normal(5).astype(np.float32)
    dz = np.empty((6, 5), np.float32)
    mlp.outer_relu_backward_colsum_(dlogit, w, a, dz, gb)
    want = np.outer(dlogit, w) * (a > 0)
    np.testing.assert_allclose(dz, want, rtol=1e-6)
    np.testing.assert_allclose(gb, want.sum(axis=0), rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise():
    m = CTRDNN(**TINY)
    params = m.init_params(0)
    emb, dense, label = make_batch(m, 4, dtype=np.float32)
    grad, gemb = np.empty_like(params), np.empty((4, m.emb_width), np.float32)
    with pytest.raises(ValueError, match="grad_out"):
        m.forward_backward(params, emb, dense, label, grad.astype(np.float64), gemb)
    with pytest.raises(ValueError, match="emb must have shape"):
        m.forward_backward(params, emb[:, :-1], dense, label, grad, gemb)
    with pytest.raises(ValueError, match="dense must have shape"):
        m.forward_backward(params, emb, dense[:3], label, grad, gemb)
    with pytest.raises(ValueError, match="grad_emb_out"):
        m.forward_backward(params, emb, dense, label, grad, gemb[:3])
    with pytest.raises(ValueError, match="params"):
        m.predict(params[:-1], emb, dense, np.empty(4))
    with pytest.raises(ValueError, match="widths"):
        CTRDNN(26, 10, 13, hidden=())
    with pytest.raises(ValueError, match="unknown init"):
        CTRDNN(26, 10, 13, init="he")
