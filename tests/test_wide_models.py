"""Wide&Deep and DeepFM maths: each term's forward against a float64 numpy reference, the
gradients (parameters, and table rows through one-hot and multi-hot pooling) against
central differences."""
import numpy as np
import pytest

from mpips.kernels.layers import first_order_fm_forward_, fm2_backward_, fm2_forward_
from mpips.kernels.pooling import pool_backward, pool_forward
from mpips.models import zoo
from tests.gradcheck import check_gradients

S, D, DIM, HID = 4, 2, 3, (5, 4)
NAMES = ("wide_deep", "deepfm")


def net(name, dtype=np.float64, pooling=None):
    return zoo.builtin(name, n_sparse=S, dim=DIM, n_dense=D, hidden=HID, dtype=dtype,
                       pooling=pooling)


def bags(n, multi, rng, n_rows):
    """(ids (nnz,), offsets (n*S+1,)): one id per bag, or 0..3 ids (empty bags too)."""
    lens = rng.integers(0, 4, n * S) if multi else np.ones(n * S, np.int64)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return rng.integers(0, n_rows, off[-1]).astype(np.int64), off


def reference_logit(m, params, rows, ids, off, dense):
    """Plain float64 numpy: pooled bags, the wide sum, FM as a sum over slot pairs f < g,
    and the CTR-DNN's MLP (its own views)."""
    n, W = dense.shape[0], m.row_dim
    pooled = np.zeros((n, S, W))
    for i in range(n):
        for f in range(S):
            bag = rows[ids[off[i * S + f]:off[i * S + f + 1]]]
            if len(bag):
                pooled[i, f] = bag.sum(0) / (len(bag) if m.pooling[f] == 1 else 1)
    v = {k: a.astype(np.float64) for k, a in m.views(params).items()}
    w, p = pooled[:, :, 0], pooled[:, :, 1:]
    logit = v["wide.b"][0] + w.sum(1) + dense @ v["wide.u"]
    if m.name == "deepfm":
        logit += sum((p[:, f] * p[:, g]).sum(1) for f in range(S) for g in range(f + 1, S))
    h = np.concatenate([p.reshape(n, -1), dense], axis=1)
    for i in range(len(m.hidden)):
        h = np.maximum(h @ v[f"fc{i}.w"] + v[f"fc{i}.b"], 0.0)
    return logit + h @ v["out.w"] + v["out.b"][0]


def loss_of(m, params, rows, ids, off, dense, label):
    """The model's mean loss on rows pooled by the kernels, and d(loss)/d(rows)."""
    n = len(label)
    inv = ids.copy()                                  # rows indexed directly by id
    emb = np.zeros((n, m.emb_width))
    pool_forward(rows, inv, off, m.pooling, emb)
    grad, gemb = np.empty(m.n_params), np.empty_like(emb)
    loss, _ = m.forward_backward(params, emb, dense, label, grad, gemb)
    grows = np.zeros_like(rows)
    pool_backward(gemb, inv, off, m.pooling, grows)
    return loss, grad, grows


def problem(name, multi, seed=0, pooling=None):
    rng = np.random.default_rng(seed)
    m = net(name, pooling=pooling)
    params = m.init_params(seed) + 0.1 * rng.standard_normal(m.n_params)
    rows = 0.5 * rng.standard_normal((9, m.row_dim))
    ids, off = bags(6, multi, rng, len(rows))
    dense = rng.random((6, D))
    label = (rng.random(6) < 0.5).astype(np.float64)
    return m, params, rows, ids, off, dense, label


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_float64_reference(name, multi):
    pooling = [0, 1, 0, 1] if multi else None
    m, params, rows, ids, off, dense, label = problem(name, multi, 1, pooling)
    logit = reference_logit(m, params, rows, ids, off, dense)
    ref = float(np.mean(np.logaddexp(0.0, logit) - label * logit))
    loss, _, _ = loss_of(m, params, rows, ids, off, dense, label)
    assert loss == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_central_differences(name, multi):
    pooling = [1, 0, 1, 0] if multi else None
    m, params, rows, ids, off, dense, label = problem(name, multi, 2, pooling)
    _, grad, grows = loss_of(m, params, rows, ids, off, dense, label)
    check_gradients(lambda p, r: loss_of(m, p, r, ids, off, dense, label)[0],
                    params, rows, grad, grows)
    assert np.abs(grows[:, 0]).max() > 0 and np.abs(grad[-D - 1:]).max() > 0  # w, w_0, u


def test_fm_kernel_is_the_pairwise_sum_and_its_gradient():
    """The kernel alone: fm = sum_{f<g} <p_f, p_g> and d fm / d p_f = sum_{g != f} p_g."""
    rng = np.random.default_rng(3)
    w, p = rng.standard_normal((5, S)), rng.standard_normal((5, S * DIM))
    e = p.reshape(5, S, DIM)
    pairs = sum((e[:, f] * e[:, g]).sum(1) for f in range(S) for g in range(f + 1, S))
    wide, fm = np.zeros(5), np.zeros(5)
    first_order_fm_forward_(w, p, S, True, wide)
    np.testing.assert_allclose(wide, w.sum(1) + pairs, rtol=1e-12)
    fm2_forward_(p, S, fm)
    np.testing.assert_allclose(fm, pairs, rtol=1e-12)
    dl, gp = rng.standard_normal(5), rng.standard_normal((5, S * DIM))
    out = gp.copy()
    fm2_backward_(p, S, dl, out, True)                     # added to what is there
    want = gp.reshape(5, S, DIM) + dl[:, None, None] * (e.sum(1, keepdims=True) - e)
    np.testing.assert_allclose(out.reshape(5, S, DIM), want, rtol=1e-12)
    fm2_backward_(p, S, dl, out, False)                    # or written over it
    np.testing.assert_allclose(out.reshape(5, S, DIM), want - gp.reshape(5, S, DIM),
                               rtol=1e-12, atol=1e-12)


def test_row_widths_layout_and_names():
    d, w, f = (zoo.builtin(n, S, DIM, D, HID) for n in ("dnn", "wide_deep", "deepfm"))
    assert (d.row_dim, w.row_dim, f.row_dim) == (DIM, DIM + 1, DIM + 1)
    assert w.n_params == f.n_params == d.n_params + 1 + D
    assert [n for n, _, _ in w.layout][-2:] == ["wide.b", "wide.u"]
    assert w.emb_width == S * (DIM + 1) and d.emb_width == S * DIM
    p = w.init_params(0)
    np.testing.assert_array_equal(p[:d.n_params], d.init_params(0))    # same MLP init
    assert not p[d.n_params:].any()                                     # w_0, u start at 0
    with pytest.raises(ValueError, match="unknown model 'fm'"):
        zoo.network_text("fm")
    from mpips.config import MODELS
    assert MODELS == tuple(zoo.ALL)                 # the flag's choices are the zoo's names


@pytest.mark.parametrize("name", NAMES)
def test_float32_predict_matches_float64_and_train_probs(name):
    m64, params, rows, ids, off, dense, label = problem(name, True, 4, [0, 0, 1, 1])
    m32 = net(name, np.float32, [0, 0, 1, 1])
    emb = np.zeros((6, m64.emb_width))
    pool_forward(rows, ids, off, m64.pooling, emb)
    p64, p32 = np.empty(6), np.empty(6, np.float32)
    m64.predict(params, emb, dense, p64)
    m32.predict(params.astype(np.float32), emb.astype(np.float32), dense.astype(np.float32),
                p32)
    np.testing.assert_allclose(p32, p64, rtol=1e-5, atol=1e-6)
    logit = reference_logit(m64, params, rows, ids, off, dense)
    np.testing.assert_allclose(p64, 1 / (1 + np.exp(-logit)), rtol=1e-12)
