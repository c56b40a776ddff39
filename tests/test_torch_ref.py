"""bench/torch_ref.py computes what mpips computes: same network maths, same lazy Adam."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mpips.kernels.optim import N_HYPER, adam_rows
from mpips.models import zoo

torch = pytest.importorskip("torch")
_spec = importlib.util.spec_from_file_location(
    "torch_ref", Path(__file__).resolve().parents[1] / "bench" / "torch_ref.py")
torch_ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_ref)

HIDDEN = (32, 16)


def MpipsDNN(n_sparse, dim, n_dense, hidden, dtype=np.float32):
    """mpips's ``dnn`` network (the layer path)."""
    return zoo.builtin("dnn", n_sparse, dim, n_dense, hidden, dtype=dtype)


def _copy_mlp(ref, v):
    """Copy mpips's MLP parameters (views ``v``) into ``ref.mlp``; returns its Linear layers."""
    linears = [m for m in ref.mlp if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for i, lin in enumerate(linears[:-1]):
            lin.weight.copy_(torch.from_numpy(v[f"fc{i}.w"].T))
            lin.bias.copy_(torch.from_numpy(v[f"fc{i}.b"]))
        linears[-1].weight.copy_(torch.from_numpy(v["out.w"][None, :]))
        linears[-1].bias.copy_(torch.from_numpy(v["out.b"]))
    return linears


def test_network_loss_and_gradients_equal_mpips():
    rng = np.random.default_rng(0)
    B = 64
    ours = MpipsDNN(26, 10, 13, hidden=HIDDEN, dtype=np.float64)
    params = ours.init_params(0)
    emb = rng.normal(0, 0.05, (B, 26 * 10))
    dense = rng.random((B, 13))
    label = (rng.random(B) < 0.3).astype(np.float64)
    grad, grad_emb = np.empty_like(params), np.empty_like(emb)
    loss, probs = ours.forward_backward(params, emb, dense, label, grad, grad_emb)
    probs = probs.copy()

    ref = torch_ref.CTRDNN(B * 26, hidden=HIDDEN).double()   # row i*26+k = emb of (i, k)
    v = ours.views(params)
    linears = _copy_mlp(ref, v)
    with torch.no_grad():
        ref.emb.weight.copy_(torch.from_numpy(emb.reshape(B * 26, 10)))
    rows = torch.arange(B * 26).reshape(B, 26)
    logit = ref(rows, torch.from_numpy(dense))                # the model's own forward
    tl = torch.nn.BCEWithLogitsLoss()(logit, torch.from_numpy(label))
    tl.backward()
    assert tl.item() == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(torch.sigmoid(logit).detach().numpy(), probs, rtol=1e-10)
    np.testing.assert_allclose(ref.emb.weight.grad.to_dense().numpy().reshape(B, -1), grad_emb,
                               rtol=1e-9, atol=1e-15)
    g = ours.views(grad)
    np.testing.assert_allclose(linears[0].weight.grad.numpy(), g["fc0.w"].T, rtol=1e-9,
                               atol=1e-15)
    np.testing.assert_allclose(linears[-1].weight.grad.numpy()[0], g["out.w"], rtol=1e-9,
                               atol=1e-15)


def test_init_scales_match_mpips():
    ref = torch_ref.CTRDNN(50_000, hidden=(400, 400, 400), init_range=0.05)
    w = ref.emb.weight.detach().numpy()
    assert np.abs(w).max() <= 0.05 and w.std() == pytest.approx(0.05 / np.sqrt(3), rel=0.02)
    ours = MpipsDNN(26, 10, 13, hidden=(400, 400, 400)).views(MpipsDNN(26, 10, 13, hidden=(400, 400, 400))
                                                  .init_params(0))
    lin = [m for m in ref.mlp if isinstance(m, torch.nn.Linear)]
    for i, name in enumerate(["fc0.w", "fc1.w", "fc2.w"]):
        assert lin[i].weight.detach().numpy().std() == pytest.approx(ours[name].std(), rel=0.02)
        assert not lin[i].bias.detach().numpy().any()


def test_row_adam_equals_mpips_lazy_adam():
    rng = np.random.default_rng(1)
    R, dim, lr = 20, 4, 1e-2
    w0 = rng.normal(0, 0.1, (R, dim)).astype(np.float32)
    ours = w0.copy()
    m, v = np.zeros_like(ours), np.zeros_like(ours)
    b1p, b2p = np.full(R, 0.9, np.float32), np.full(R, 0.999, np.float32)
    hyper = np.zeros(N_HYPER)
    hyper[:] = (lr, 0.9, 0.999, 1e-8, 1.0)
    weight = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch_ref.RowAdam(weight, lr)
    for _ in range(6):
        rows = np.unique(rng.integers(0, R, 7))              # each step touches a few rows
        g = rng.normal(0, 1, (rows.size, dim)).astype(np.float32)
        adam_rows(ours, m, v, b1p, b2p, rows, g, hyper)
        weight.grad = torch.sparse_coo_tensor(torch.from_numpy(rows)[None, :],
                                              torch.from_numpy(g), (R, dim),
                                              check_invariants=True)
        opt.step()
    np.testing.assert_allclose(weight.detach().numpy(), ours, rtol=0, atol=2e-6)
    assert not np.allclose(ours, w0)


def test_vocabulary_map_sends_unknown_ids_to_the_zero_row():
    m = torch_ref.IdMap(0, np.array([-5, 3, 10**15], np.int64))
    got = m(np.array([[3, -5], [7, 10**15]], np.int64)).numpy()
    assert got.tolist() == [[1, 0], [3, 2]] and m.n_rows == 4


@pytest.mark.parametrize("name", ["wide_deep", "deepfm"])
def test_wide_models_loss_and_gradients_equal_mpips(name):
    rng = np.random.default_rng(1)
    B, S, dim = 16, 26, 4
    ours = zoo.builtin(name, 26, dim, 13, HIDDEN, dtype=np.float64)
    params = ours.init_params(0) + 0.05 * rng.standard_normal(ours.n_params)
    emb = rng.normal(0, 0.3, (B, S * (dim + 1)))
    dense = rng.random((B, 13))
    label = (rng.random(B) < 0.3).astype(np.float64)
    grad, grad_emb = np.empty_like(params), np.empty_like(emb)
    loss, _ = ours.forward_backward(params, emb, dense, label, grad, grad_emb)
    ref = torch_ref.MODELS[name](B * S, dim=dim, hidden=HIDDEN).double()
    v = ours.views(params)
    linears = _copy_mlp(ref, v)
    with torch.no_grad():
        ref.w0.copy_(torch.from_numpy(v["wide.b"]))
        ref.u.copy_(torch.from_numpy(v["wide.u"]))
        ref.emb.weight.copy_(torch.from_numpy(emb.reshape(B * S, dim + 1)))
    logit = ref(torch.arange(B * S).reshape(B, S), torch.from_numpy(dense))
    tl = torch.nn.BCEWithLogitsLoss()(logit, torch.from_numpy(label))
    tl.backward()
    assert tl.item() == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(ref.emb.weight.grad.to_dense().numpy().reshape(B, -1), grad_emb,
                               rtol=1e-9, atol=1e-15)
    g = ours.views(grad)
    np.testing.assert_allclose(ref.u.grad.numpy(), g["wide.u"], rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(ref.w0.grad.numpy(), g["wide.b"], rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(linears[0].weight.grad.numpy(), g["fc0.w"].T, rtol=1e-9,
                               atol=1e-15)


def _equal_to_the_reference(name, seed, make_label, loss_of, probs_of):
    """mpips's float64 loss, probabilities and gradients (dense parameters and pooled slot
    rows) against the reference's forward and autograd, from the same weights; returns the
    reference model."""
    rng = np.random.default_rng(seed)
    B, S, dim = 16, 26, 4
    ours = zoo.builtin(name, S, dim, 13, HIDDEN, dtype=np.float64)
    params = ours.init_params(0) + 0.05 * rng.standard_normal(ours.n_params)
    emb = rng.normal(0, 0.3, (B, S * dim))
    dense = rng.random((B, 13))
    label = make_label(rng, B)
    grad, grad_emb = np.empty_like(params), np.empty_like(emb)
    loss, probs = ours.forward_backward(params, emb, dense, label, grad, grad_emb)
    probs = probs.copy()
    ref = torch_ref.MODELS[name](B * S, dim=dim, hidden=HIDDEN).double()
    assert [(n, tuple(s)) for n, s, _ in ref.layout] == \
        [(n, tuple(s)) for n, _, s in ours.layout]             # same names, shapes, order
    v = ours.views(params)
    with torch.no_grad():
        for pname, _, _ in ref.layout:
            ref.param(pname).copy_(torch.from_numpy(v[pname]))
        ref.emb.weight.copy_(torch.from_numpy(emb.reshape(B * S, dim)))
    logits = ref(torch.arange(B * S).reshape(B, S), torch.from_numpy(dense))
    tl = loss_of(ref, logits, torch.from_numpy(label))
    tl.backward()
    assert tl.item() == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(probs_of(ref, logits).detach().numpy(), probs, rtol=1e-10)
    np.testing.assert_allclose(ref.emb.weight.grad.to_dense().numpy().reshape(B, -1), grad_emb,
                               rtol=1e-9, atol=1e-15)
    g = ours.views(grad)
    for pname, _, _ in ref.layout:
        np.testing.assert_allclose(ref.param(pname).grad.numpy(), g[pname], rtol=1e-9,
                                   atol=1e-15, err_msg=f"{name}: d loss / d {pname}")
    return ref


@pytest.mark.parametrize("name", ["dcn_v2", "dlrm"])
def test_layer_networks_loss_and_gradients_equal_mpips(name):
    """DCN-v2 and DLRM: the reference's forward (its own maths, not mpips's kernels) gives
    mpips's loss and probabilities, and autograd gives mpips's gradient of every dense
    parameter and of every pooled slot row, in float64."""
    ref = _equal_to_the_reference(
        name, 2, lambda rng, B: (rng.random(B) < 0.3).astype(np.float64),
        lambda ref, logit, y: torch.nn.BCEWithLogitsLoss()(logit, y),
        lambda ref, logit: torch.sigmoid(logit))
    assert {n.split("_")[0].rstrip("0123456789") for n in ref.p} >= \
        ({"cross", "fc", "out"} if name == "dcn_v2" else {"bottom", "fc", "out"})


@pytest.mark.parametrize("name", ["dcn_v2", "dlrm"])
def test_layer_networks_start_from_mpips_init(name):
    """The reference's dense weights at --seed s are mpips's init_params(s), bit for bit."""
    ours = zoo.builtin(name, 26, 10, 13, (400, 400, 400))
    ref = torch_ref.MODELS[name](1000, hidden=(400, 400, 400), seed=3)
    flat = np.concatenate([ref.param(n).detach().numpy().reshape(-1) for n, _, _ in ref.layout])
    np.testing.assert_array_equal(flat, ours.init_params(3))
    assert not np.array_equal(flat, ours.init_params(4))


@pytest.mark.parametrize("name", ["shared_bottom", "mmoe", "esmm"])
def test_multitask_networks_loss_and_gradients_equal_mpips(name):
    """Several tasks (issue 47): the reference's own maths (softmax gates by torch, ESMM's
    pCTCVR in logs) gives mpips's loss and (n, 2) probabilities, and autograd mpips's
    gradient of every dense parameter and pooled slot row, in float64."""
    def two_labels(rng, B):
        click = (rng.random(B) < 0.5).astype(np.float64)
        return np.stack([click, click * (rng.random(B) < 0.5)], 1)
    _equal_to_the_reference(name, 4, two_labels, lambda ref, logits, y: ref.task_loss(logits, y),
                            lambda ref, logits: ref.probs(logits))


@pytest.mark.parametrize("softmax", [False, True])
def test_din_loss_and_gradients_equal_mpips(softmax):
    """DIN (dnn with attention over a history, a shared table): the reference's own maths
    give mpips's loss, probabilities, dense gradients and row gradients in float64, over
    bags with an empty and a one-id history; both start from the same init."""
    from mpips.schema import Schema
    rng = np.random.default_rng(5)
    schema = Schema.from_dict({"format": "csv", "label": "click", "sparse": [
        {"names": ["hist"], "separator": "|", "table": "item", "pooling": "attention",
         "query": "target", "attention_units": [6, 5], "attention_softmax": softmax},
        {"names": ["target"], "table": "item"}, {"names": ["other"], "pooling": "mean"}]})
    B, S, dim, U = 7, 3, 4, 12
    lens = np.stack([[0, 1, 5, 3, 2, 7, 4], np.ones(B, int), rng.integers(0, 3, B)], 1)
    off = np.r_[0, np.cumsum(lens.reshape(-1))].astype(np.int64)
    ids = rng.integers(0, U, off[-1]).astype(np.int64)
    rows = rng.normal(0, 0.4, (U, dim))
    dense, label = np.zeros((B, 0)), (rng.random(B) < 0.5).astype(np.float64)
    ours = zoo.make_net("dnn", schema, dim, HIDDEN, dtype=np.float64)
    params = ours.init_params(0) + 0.2 * rng.standard_normal(ours.n_params)
    emb = np.empty((B, ours.emb_width))
    ours.pool(rows, ids, off, emb)
    grad, gemb, grows = np.empty_like(params), np.empty_like(emb), np.empty_like(rows)
    loss, probs = ours.forward_backward(params, emb, dense, label, grad, gemb)
    probs = probs.copy()
    ours.unpool(gemb, ids, off, grows)

    kw = torch_ref.din_kwargs(schema, dim, HIDDEN)
    ref = torch_ref.DIN(U, S, dim, 0, HIDDEN, pooling=schema.pooling_codes(), seed=0, **kw)
    flat = np.concatenate([ref.param(n).detach().numpy().reshape(-1) for n, _, _ in ref.layout])
    np.testing.assert_array_equal(flat, ours.init_params(0).astype(np.float32))
    ref = ref.double()
    v = ours.views(params)
    with torch.no_grad():
        for pname, _, _ in ref.layout:
            ref.param(pname).copy_(torch.from_numpy(v[pname]))
        ref.emb.weight.copy_(torch.from_numpy(rows))
    logit = ref(torch.from_numpy(ids), torch.from_numpy(dense), torch.from_numpy(off))
    tl = torch.nn.BCEWithLogitsLoss()(logit, torch.from_numpy(label))
    tl.backward()
    assert tl.item() == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(torch.sigmoid(logit).detach().numpy(), probs, rtol=1e-10)
    np.testing.assert_allclose(ref.emb.weight.grad.to_dense().numpy(), grows, rtol=1e-9,
                               atol=1e-14)
    g = ours.views(grad)
    for pname, _, _ in ref.layout:
        np.testing.assert_allclose(ref.param(pname).grad.numpy(), g[pname], rtol=1e-9,
                                   atol=1e-14, err_msg=f"d loss / d {pname}")
