"""Networks from layers: each layer's forward against a float64 numpy reference and its
gradients (parameters and inputs, through sum and mean pooled bags) against central
differences; the built-in dnn, wide_deep and deepfm equal the classes they replaced bit for
bit; every error of a network file is one line naming the file, the layer and the field."""
import numpy as np
import pytest

from mpips.kernels.pooling import pool_backward, pool_forward
from mpips.models import zoo
from mpips.models.network import Network
from mpips.models.spec import NetworkError, builtin_text
from tests.legacy_models import MODELS as LEGACY
from tests.gradcheck import check_gradients

S, D, DIM = 4, 3, 3

HEAD = """
[inputs]
emb = "all"
dense = "dense"
"""


def make(body, dtype=np.float64, pooling=None, hidden=(5, 4), n_dense=D, inputs=HEAD):
    return Network(inputs + body, S, DIM, n_dense, hidden, dtype=dtype, pooling=pooling)


def bags(n, rng, n_rows):
    """(ids (nnz,), offsets (n*S+1,)): 0..3 ids a bag, empty bags too."""
    lens = rng.integers(0, 4, n * S)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return rng.integers(0, n_rows, off[-1]).astype(np.int64), off


def loss_of(m, params, rows, ids, off, dense, label):
    """The mean loss on rows pooled by the kernels, d/d(params) and d/d(rows)."""
    emb = np.zeros((len(label), m.emb_width))
    pool_forward(rows, ids, off, m.pooling, emb)
    grad, gemb = np.empty(m.n_params), np.empty_like(emb)
    loss, _ = m.forward_backward(params, emb, dense, label, grad, gemb)
    grows = np.zeros_like(rows)
    pool_backward(gemb, ids, off, m.pooling, grows)
    return loss, grad, grows


def problem(m, seed=0, n=6):
    rng = np.random.default_rng(seed)
    params = m.init_params(seed) + 0.2 * rng.standard_normal(m.n_params)
    rows = 0.5 * rng.standard_normal((9, m.row_dim))
    ids, off = bags(n, rng, len(rows))
    return params, rows, ids, off, rng.random((n, m.n_dense)), \
        (rng.random(n) < 0.5).astype(np.float64)


def check_network_gradients(m, seed=0):
    params, rows, ids, off, dense, label = problem(m, seed)
    _, grad, grows = loss_of(m, params, rows, ids, off, dense, label)
    check_gradients(lambda p, r: loss_of(m, p, r, ids, off, dense, label)[0],
                    params, rows, grad, grows)
    assert np.abs(grad).max() > 0 and np.abs(grows).max() > 0


LAYERS = {
    "linear_relu_sigmoid_identity": """
[layers.x]
type = "concat"
inputs = ["emb", "dense"]
[layers.h]
type = "linear"
inputs = ["x"]
width = 5
activation = "relu"
[layers.s]
type = "linear"
inputs = ["h"]
width = 4
activation = "sigmoid"
[layers.out]
type = "linear"
inputs = ["s"]
width = 1
[output]
logits = ["out"]
""",
    "add_mul_sum": """
[layers.a]
type = "linear"
inputs = ["emb"]
width = 3
[layers.b]
type = "linear"
inputs = ["dense"]
width = 3
activation = "sigmoid"
[layers.m]
type = "mul"
inputs = ["a", "b"]
[layers.p]
type = "add"
inputs = ["m", "a"]
[layers.s]
type = "sum"
inputs = ["p", "b", "a"]
[layers.out]
type = "linear"
inputs = ["s"]
width = 1
[output]
logits = ["out"]
""",
    "fm2_alone": """
[layers.fm]
type = "fm2"
inputs = ["emb"]
[layers.d]
type = "linear"
inputs = ["dense"]
width = 1
[layers.logit]
type = "add"
inputs = ["fm", "d"]
[layers.out]
type = "linear"
inputs = ["logit"]
width = 1
[output]
logits = ["out"]
""",
    "cross_full": """
[layers.x]
type = "concat"
inputs = ["emb", "dense"]
[layers.c]
type = "cross"
inputs = ["x"]
depth = 3
[layers.out]
type = "linear"
inputs = ["c"]
width = 1
[output]
logits = ["out"]
""",
    "cross_low_rank": """
[layers.x]
type = "concat"
inputs = ["emb", "dense"]
[layers.c]
type = "cross"
inputs = ["x"]
depth = 2
rank = 2
[layers.out]
type = "linear"
inputs = ["c"]
width = 1
[output]
logits = ["out"]
""",
    "cross_vector_v1": """
[layers.x]
type = "concat"
inputs = ["emb", "dense"]
[layers.c]
type = "cross"
inputs = ["x"]
depth = 2
kind = "vector"
[layers.out]
type = "linear"
inputs = ["c"]
width = 1
[output]
logits = ["out"]
""",
    "dot_dlrm": """
[layers.bottom]
type = "mlp"
inputs = ["dense"]
widths = [4, "dim"]
[layers.f]
type = "concat"
inputs = ["bottom", "emb"]
[layers.pairs]
type = "dot"
inputs = ["f"]
[layers.top]
type = "concat"
inputs = ["bottom", "pairs"]
[layers.fc]
type = "mlp"
inputs = ["top"]
widths = "fc"
[layers.out]
type = "linear"
inputs = ["fc"]
width = 1
[output]
logits = ["out"]
""",
}


@pytest.mark.parametrize("pooling", [None, [0, 1, 1, 0]], ids=["sum", "mean"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_gradients_match_central_differences(name, pooling):
    check_network_gradients(make(LAYERS[name], pooling=pooling), seed=len(name))


@pytest.mark.parametrize("name", zoo.MODELS)
def test_builtin_gradients_match_central_differences(name):
    m = Network(builtin_text(name), S, DIM, D, (5, 4), dtype=np.float64, pooling=[1, 0, 0, 1])
    check_network_gradients(m, seed=3)


def _ref_mlp(x, v, pre, n):
    for i in range(n):
        x = np.maximum(x @ v[f"{pre}{i}.w"] + v[f"{pre}{i}.b"], 0)
    return x


def test_forward_matches_float64_references():
    """Closed forms in plain numpy: DCN-v2's full and low-rank crosses, DCN v1's vector
    cross, DLRM's dot interaction over a bottom MLP, against the network's logits."""
    rng = np.random.default_rng(5)
    emb, dense = rng.standard_normal((7, S * DIM)), rng.random((7, D))
    x0 = np.concatenate([emb, dense], 1)

    def logit(m, params):
        out = np.empty(7)
        m.predict(params, emb, dense, out)
        return np.log(out / (1 - out))
    for name, step in (("cross_full", lambda v, p, x: x0 * (x @ v[p + ".w"] + v[p + ".b"]) + x),
                       ("cross_low_rank", lambda v, p, x: x0 * (x @ v[p + ".v"] @ v[p + ".u"]
                                                                + v[p + ".b"]) + x),
                       ("cross_vector_v1", lambda v, p, x: x0 * (x @ v[p + ".w"])[:, None]
                        + v[p + ".b"] + x)):
        m = make(LAYERS[name])
        params = m.init_params(1) + 0.1 * rng.standard_normal(m.n_params)
        v = m.views(params)
        x = x0
        for li in range(3 if name == "cross_full" else 2):
            x = step(v, f"c{li}", x)
        np.testing.assert_allclose(logit(m, params), x @ v["out.w"] + v["out.b"][0],
                                   rtol=1e-9)
    m = make(LAYERS["dot_dlrm"])
    params = m.init_params(2) + 0.1 * rng.standard_normal(m.n_params)
    v = m.views(params)
    z = _ref_mlp(dense, v, "bottom", 2)
    e = np.concatenate([z[:, None, :], emb.reshape(7, S, DIM)], 1)       # (B, F, d)
    pairs = np.stack([(e[:, a] * e[:, b]).sum(1) for a in range(S + 1)
                      for b in range(a + 1, S + 1)], 1)
    top = _ref_mlp(np.concatenate([z, pairs], 1), v, "fc", 2)
    np.testing.assert_allclose(logit(m, params), top @ v["out.w"] + v["out.b"][0], rtol=1e-9)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(LEGACY))
def test_builtins_equal_the_classes_they_replaced_bit_for_bit(name, dtype):
    """The same init, loss, probabilities, gradients and predictions, byte for byte, over
    a few SGD steps and batch sizes (the Criteo shape: 26 slots of 10, 13 dense)."""
    old = LEGACY[name](26, 10, 13, (40, 30, 20), dtype=dtype)
    new = zoo.builtin(name, 26, 10, 13, (40, 30, 20), dtype=dtype)
    assert new.layout == old.layout and new.row_dim == old.row_dim
    p0, p1 = old.init_params(7), new.init_params(7)
    assert p0.tobytes() == p1.tobytes()
    rng = np.random.default_rng(0)
    for n in (64, 17, 65):
        emb = (rng.standard_normal((n, old.emb_width)) * 0.3).astype(dtype)
        dense = rng.random((n, 13)).astype(dtype)
        label = (rng.random(n) < 0.3).astype(np.float32)
        g0, g1 = np.empty_like(p0), np.empty_like(p1)
        e0, e1 = np.empty_like(emb), np.empty_like(emb)
        l0, pr0 = old.forward_backward(p0, emb, dense, label, g0, e0)
        pr0 = pr0.copy()
        l1, pr1 = new.forward_backward(p1, emb, dense, label, g1, e1)
        assert l0 == l1 and pr0.tobytes() == pr1.tobytes()
        assert g0.tobytes() == g1.tobytes() and e0.tobytes() == e1.tobytes()
        o0, o1 = np.empty(n, dtype), np.empty(n, dtype)
        old.predict(p0, emb, dense, o0)
        new.predict(p1, emb, dense, o1)
        assert o0.tobytes() == o1.tobytes()
        p0 -= 0.05 * g0
        p1 -= 0.05 * g1


def test_deepfm_folds_fm_into_the_first_order_pass():
    m = zoo.builtin("deepfm", S, DIM, D, (5,))
    assert m.fused == ("wide", "fm") and "fm" not in [L.name for L in m.layers]


BAD = [
    ('[layers.a]\ntype = "convolve"\ninputs = ["emb"]\n[output]\nlogits = ["a"]\n',
     "layer 'a': type: unknown layer type 'convolve'"),
    ('[layers.a]\ntype = "linear"\ninputs = ["nope"]\nwidth = 1\n[output]\nlogits = ["a"]\n',
     "layer 'a': inputs: unknown input 'nope'"),
    ('[layers.a]\ntype = "add"\ninputs = ["emb", "dense"]\n[layers.o]\ntype = "linear"\n'
     'inputs = ["a"]\nwidth = 1\n[output]\nlogits = ["o"]\n',
     "layer 'a': inputs: a add layer needs inputs of one width; got emb 12, dense 3"),
    ('[layers.a]\ntype = "linear"\ninputs = ["b"]\nwidth = 1\n[layers.b]\ntype = "linear"\n'
     'inputs = ["a", "emb"]\nwidth = 1\n[output]\nlogits = ["a"]\n',
     "layer 'a': inputs: a cycle through a, b"),
    ('[layers.a]\ntype = "linear"\ninputs = ["emb"]\nwidth = 1\n[layers.b]\ntype = "linear"\n'
     'inputs = ["dense"]\nwidth = 1\n[output]\nlogits = ["a"]\n',
     "input 'dense': inputs: unused"),
    ('[layers.a]\ntype = "linear"\ninputs = ["emb"]\nwidth = 1\n',
     "[output]: logits: missing"),
    ('[layers.a]\ntype = "linear"\ninputs = ["emb", "dense"]\nwidth = 1\n[output]\n'
     'logits = ["a"]\n', "layer 'a': inputs: a linear layer takes 1 input(s); got 2"),
    ('[layers.a]\ntype = "linear"\ninputs = ["emb"]\nwidht = 1\n[output]\nlogits = ["a"]\n',
     "layer 'a': widht: unknown option for a linear layer"),
    ('[layers.a]\ntype = "linear"\ninputs = ["emb"]\nwidth = 2\n[output]\nlogits = ["a"]\n',
     "layer 'a': width: the logit must have width 1; it has 2"),
    ('[layers.a]\ntype = "mlp"\ninputs = ["emb"]\nwidths = [4, 0]\n[output]\nlogits = ["a"]\n',
     "layer 'a': widths: must be a positive integer; got 0"),
    ('[layers.a]\ntype = "dot"\ninputs = ["dense"]\n[output]\nlogits = ["a"]\n',
     "layer 'a': inputs: a dot layer needs at least 2 fields"),
    ('[layers.a\ntype = "dot"\n', "not valid TOML"),
]


@pytest.mark.parametrize("body,want", BAD, ids=[w.split(":")[0] for _, w in BAD])
def test_bad_network_files_are_one_line_errors(body, want, tmp_path):
    path = tmp_path / "net.toml"
    path.write_text(HEAD.replace('dense = "dense"', 'dense = "dense"') + body)
    with pytest.raises(NetworkError) as e:
        zoo.make_net(str(path), _schema(), DIM, (5,))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"network {path}: ") and want in msg, msg


def test_slot_lists_inputs_and_missing_slots():
    two = """
[inputs]
user = ["C1", "C2"]
item = ["C3", "C4"]
dense = "dense"
[layers.u]
type = "linear"
inputs = ["user"]
width = 3
[layers.i]
type = "linear"
inputs = ["item"]
width = 3
[layers.m]
type = "mul"
inputs = ["u", "i"]
[layers.x]
type = "concat"
inputs = ["m", "dense"]
[layers.out]
type = "linear"
inputs = ["x"]
width = 1
[output]
logits = ["out"]
"""
    m = Network(two, S, DIM, D, (5,), dtype=np.float64, slot_names=["C1", "C2", "C3", "C4"])
    check_network_gradients(m, seed=4)
    with pytest.raises(NetworkError, match="slot C4 is in no input"):
        Network(two.replace('"C3", "C4"', '"C3"'), S, DIM, D, (5,),
                slot_names=["C1", "C2", "C3", "C4"])
    with pytest.raises(NetworkError, match="no slot 'C9'"):
        Network(two.replace('"C4"', '"C9"'), S, DIM, D, (5,),
                slot_names=["C1", "C2", "C3", "C4"])


def test_digest_ignores_comments_and_name_but_not_widths():
    text = builtin_text("dnn")
    assert zoo.digest(text) == zoo.digest("# a copy\n" + text.replace('name = "dnn"',
                                                                      'name = "mine"'))
    assert zoo.digest(text) != zoo.digest(text.replace('widths = "fc"', "widths = [8]"))
    assert len({zoo.digest(builtin_text(n)) for n in zoo.MODELS}) == len(zoo.MODELS)


def _schema():
    from mpips.schema import Schema
    return Schema.from_dict({"format": "csv", "label": "y",
                             "dense": [{"names": ["d1", "d2", "d3"]}],
                             "sparse": [{"names": ["C1", "C2", "C3", "C4"]}]})
