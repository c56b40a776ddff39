"""Several labels: the gate layer and the heads against float64 numpy references, their
gradients against central differences; the multi-task built-ins' gradients; the schema's
label list; every text format reading two labels; the one-line refusals."""
import os

import numpy as np
import pytest

from mpips.kernels.pooling import pool_backward, pool_forward
from mpips.models import zoo
from mpips.models.network import Network
from mpips.models.spec import NetworkError, builtin_text
from mpips.schema import Schema, SchemaError, load_schema
from mpips.metrics import BinaryMetrics, TaskMetrics
from tests.gradcheck import check_gradients

pytestmark = pytest.mark.unit

S, D, DIM = 3, 2, 3
HERE = os.path.dirname(os.path.abspath(__file__))
HEAD = """
[inputs]
emb = "all"
dense = "dense"
[layers.x]
type = "concat"
inputs = ["emb", "dense"]
"""
GATE = HEAD + """
[layers.e1]
type = "linear"
inputs = ["x"]
width = 4
activation = "relu"
[layers.e2]
type = "linear"
inputs = ["x"]
width = 4
[layers.e3]
type = "linear"
inputs = ["x"]
width = 4
activation = "sigmoid"
[layers.g1]
type = "gate"
inputs = ["x", "e1", "e2", "e3"]
[layers.o1]
type = "linear"
inputs = ["g1"]
width = 1
[layers.g2]
type = "gate"
inputs = ["emb", "e1", "e2", "e3"]
[layers.o2]
type = "linear"
inputs = ["g2"]
width = 1
[output]
logits = ["o1", "o2"]
loss_weights = [1.0, 0.5]
"""


def problem(m, seed=0, n=7, T=2):
    rng = np.random.default_rng(seed)
    params = m.init_params(seed) + 0.3 * rng.standard_normal(m.n_params)
    rows = 0.7 * rng.standard_normal((9, m.row_dim))
    lens = rng.integers(0, 3, n * S)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = rng.integers(0, len(rows), off[-1]).astype(np.int64)
    click = (rng.random(n) < 0.5).astype(np.float64)
    buy = click * (rng.random(n) < 0.5)
    label = np.stack([click, buy], 1)[:, :T]
    return params, rows, ids, off, rng.random((n, D)), label


def loss_of(m, params, rows, ids, off, dense, label):
    emb = np.zeros((len(label), m.emb_width))
    pool_forward(rows, ids, off, m.pooling, emb)
    grad, gemb = np.empty(m.n_params), np.empty_like(emb)
    loss, probs = m.forward_backward(params, emb, dense, label, grad, gemb)
    grows = np.zeros_like(rows)
    pool_backward(gemb, ids, off, m.pooling, grows)
    return loss, grad, grows, probs.copy(), emb


def check_network_gradients(m, seed=0):
    params, rows, ids, off, dense, label = problem(m, seed)
    _, grad, grows, _, _ = loss_of(m, params, rows, ids, off, dense, label)
    check_gradients(lambda p, r: loss_of(m, p, r, ids, off, dense, label)[0],
                    params, rows, grad, grows)
    assert np.abs(grad).max() > 0 and np.abs(grows).max() > 0


def sig(x):
    return 1 / (1 + np.exp(-x))


def bce(y, p):
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def test_gate_network_matches_numpy_and_central_differences():
    m = Network(GATE, S, DIM, D, (5,), dtype=np.float64, pooling=[0, 1, 0])
    check_network_gradients(m, seed=1)
    params, rows, ids, off, dense, label = problem(m, 2)
    loss, _, _, probs, emb = loss_of(m, params, rows, ids, off, dense, label)
    v = m.views(params)
    x = np.concatenate([emb, dense], 1)
    e = [np.maximum(x @ v["e1.w"] + v["e1.b"], 0), x @ v["e2.w"] + v["e2.b"],
         sig(x @ v["e3.w"] + v["e3.b"])]

    def gate(inp, name):
        z = inp @ v[f"{name}.w"] + v[f"{name}.b"]
        g = np.exp(z - z.max(1, keepdims=True))
        g /= g.sum(1, keepdims=True)
        return sum(g[:, k:k + 1] * e[k] for k in range(3))
    p1 = sig(gate(x, "g1") @ v["o1.w"] + v["o1.b"])
    p2 = sig(gate(emb, "g2") @ v["o2.w"] + v["o2.b"])
    np.testing.assert_allclose(probs, np.stack([p1, p2], 1), rtol=1e-12)
    ref = (bce(label[:, 0], p1) + 0.5 * bce(label[:, 1], p2)).mean()
    assert loss == pytest.approx(ref, rel=1e-12)
    out = np.empty((len(label), 2))
    m.predict(params, emb, dense, out)
    np.testing.assert_allclose(out, probs, rtol=1e-12)


@pytest.mark.parametrize("name", zoo.MULTI_TASK)
def test_multitask_builtins_gradients(name):
    text = builtin_text(name).replace("[256, 128]", "[4, 3]").replace("[64]", "[3]")
    m = Network(text, S, DIM, D, (5, 4), dtype=np.float64, pooling=[1, 0, 0])
    assert m.n_tasks == 2
    check_network_gradients(m, seed=3)


def test_esmm_head_is_pctr_times_pcvr_with_losses_over_all_impressions():
    text = builtin_text("esmm")
    m = Network(text, S, DIM, D, (5,), dtype=np.float64)
    params, rows, ids, off, dense, label = problem(m, 4, n=9)
    loss, _, _, probs, emb = loss_of(m, params, rows, ids, off, dense, label)
    v = m.views(params)
    x = np.concatenate([emb, dense], 1)
    a = np.maximum(x @ v["ctr0.w"] + v["ctr0.b"], 0) @ v["ctr_logit.w"] + v["ctr_logit.b"]
    b = np.maximum(x @ v["cvr0.w"] + v["cvr0.b"], 0) @ v["cvr_logit.w"] + v["cvr_logit.b"]
    pctr, pctcvr = sig(a), sig(a) * sig(b)
    np.testing.assert_allclose(probs, np.stack([pctr, pctcvr], 1), rtol=1e-12)
    ref = (bce(label[:, 0], pctr) + bce(label[:, 1], pctcvr)).mean()
    assert loss == pytest.approx(ref, rel=1e-12)


def test_esmm_loss_is_finite_at_extreme_logits():
    from mpips.kernels.tasks import esmm_bce_
    a = np.array([40.0, -40.0, 40.0, 0.0])
    b = np.array([40.0, 40.0, -40.0, 0.0])
    y = np.array([[1, 0], [0, 0], [1, 0], [1, 0]], np.float64)
    probs, da, db, loss = np.empty((4, 2)), np.empty(4), np.empty(4), np.empty(2)
    esmm_bce_(a, b, y, probs, da, db, np.ones(2), loss)
    assert np.isfinite(loss).all() and np.isfinite(da).all() and np.isfinite(db).all()
    # 1 - s(40)^2 = 2 e^-40 (1 + O(e^-40)): -log = 40 - log 2; the last row: -log(0.75)
    assert loss[1] == pytest.approx(40.0 - np.log(2) + bce(0.0, 0.25), abs=1e-6)
    assert db[0] == pytest.approx(0.5, abs=1e-6)   # (p2 - 0)(1 - s(b))/(1 - p2) -> 1/2


def test_single_task_network_refuses_two_labels_and_names_the_multitask_ones():
    s = Schema(format="csv", label=("click", "purchase"),
               sparse=Schema.criteo().sparse[:0] or (), dense=Schema.criteo().dense)
    with pytest.raises(NetworkError) as e:
        zoo.make_net("dnn", s, 4, (8,))
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in zoo.MULTI_TASK)
    one = Schema(format="csv", label="click", dense=Schema.criteo().dense)
    with pytest.raises(NetworkError, match="2 logits"):
        zoo.make_net("mmoe", one, 4, (8,))


@pytest.mark.parametrize("output, field", [
    ('logits = ["o1", "o1"]', "named twice"),
    ('logits = ["o1"]\nhead = "esmm"', "two logits"),
    ('logits = ["o1", "o2"]\nhead = "x"', "head"),
    ('logits = ["o1", "o2"]\nloss_weights = [1]', "loss_weights"),
    ('logits = ["o1", "o2"]\nweights = [1, 1]', "unknown key"),
])
def test_output_errors_are_one_line(output, field):
    text = GATE[:GATE.index("[output]")] + "[output]\n" + output + "\n"
    with pytest.raises(NetworkError) as e:
        Network(text, S, DIM, D, (5,))
    assert field in str(e.value) and "\n" not in str(e.value)


def test_single_task_digest_unchanged_by_tasks():
    """A one-logit file's description has no head or weights: old checkpoints' digests hold."""
    before = {"dnn": "57af4e9dd28ff68d", "wide_deep": "759c63e9a83c3431",   # main, issue 46
              "deepfm": "8784d58434969419", "dcn_v2": "01e1661e512ccef2",
              "dlrm": "9a792ae87edd271c"}
    assert {n: zoo.digest(builtin_text(n)) for n in zoo.MODELS} == before
    from mpips.models.spec import parse
    assert set(parse(builtin_text("dnn"))) == {"name", "inputs", "layers", "logits"}


def test_plot_draws_each_task():
    matplotlib = pytest.importorskip("matplotlib")  # noqa: F841
    from mpips import plot
    recs = [{"epoch": e, "train_examples": 10, "test_auc": 0.7 + e / 100,
             "tasks": {"click": {"test_auc": 0.7 + e / 100},
                       "purchase": {"test_auc": 0.6 + e / 100}}} for e in range(3)]
    fig = plot.plot_epochs([("run", recs)])
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    assert lines["run purchase"] == pytest.approx([0.6, 0.61, 0.62])
    assert lines["run click"] == pytest.approx([0.7, 0.71, 0.72])


def test_task_metrics_per_label_and_esmm_cvr_on_clicked_rows():
    rng = np.random.default_rng(0)
    n = 400
    click = (rng.random(n) < 0.4).astype(np.float32)
    buy = click * (rng.random(n) < 0.5)
    p = np.stack([rng.random(n), rng.random(n)], 1).astype(np.float32)
    p[:, 1] *= p[:, 0]                                           # pCTCVR <= pCTR
    m = TaskMetrics(("click", "purchase"), esmm=True)
    m.update(p[:200], np.stack([click, buy], 1)[:200])
    m2 = m.with_state(m.state())
    m2.update(p[200:], np.stack([click, buy], 1)[200:])
    ref = {}
    for t, y in enumerate((click, buy)):
        b = BinaryMetrics()
        b.update(np.ascontiguousarray(p[:, t]), y)
        ref[t] = b
    f = m2.task_fields()
    assert f["click"]["test_auc"] == ref[0].auc() and m2.auc() == ref[0].auc()
    assert f["purchase"]["test_logloss"] == ref[1].logloss()
    c = click == 1
    cvr = BinaryMetrics()
    cvr.update(np.minimum(p[c, 1] / p[c, 0], 1), buy[c])
    assert f["purchase"]["test_cvr_auc_clicked"] == cvr.auc()


def _formats_schema(fmt):
    from mpips.schema import DenseGroup, SparseGroup
    kw = dict(fields=("click", "d", "a", "purchase", "b")) if fmt == "multislot" else \
        dict(delimiter=",", header=True) if fmt == "csv" else {}
    return Schema(format=fmt, label=("click", "purchase"), dense=(DenseGroup(
        ("d",), norm="none"),), sparse=(SparseGroup(("a", "b")),), **kw)


@pytest.mark.parametrize("fmt, text", [
    ("csv", b"purchase,d,a,click,b\n0,0.5,x,1,y\n1,1.5,z,1,w\n0,2,x,0,\n"),
    ("slot", b"click:1 purchase:0 d:0.5 a:1 b:2\npurchase:1 click:1 d:1.5 a:3 b:4\n"
             b"click:0 purchase:0 d:2 a:1\n"),
    ("multislot", b"1 1 1 0.5 1 1 1 0 1 2\n1 1 1 1.5 1 3 1 1 1 4\n1 0 1 2 1 1 1 0 0\n"),
])
def test_every_format_reads_two_labels(tmp_path, fmt, text):
    from mpips.data.reader import DataReader
    s = _formats_schema(fmt)
    (tmp_path / "x").write_bytes(text)
    [b] = list(DataReader([str(tmp_path / "x")], 3, schema=s))
    np.testing.assert_array_equal(b.label, [[1, 0], [1, 1], [0, 0]])
    np.testing.assert_array_equal(b.dense[:, 0], [0.5, 1.5, 2.0])
    assert b.offsets[-1] == 5 and b.label.dtype == np.float32


def test_paddlerec_sample_and_binary_parts_round_trip(tmp_path):
    """The two-label CSV sample (click,purchase,f1,...) against Python's csv module, and
    binary parts of it read back with the same (n, 2) labels."""
    import csv
    from mpips.data import bagparts
    from mpips.data.reader import DataReader
    s = load_schema(os.path.join(HERE, "data", "two_labels.toml"))
    path = os.path.join(HERE, "data", "two_labels_sample.csv")
    rows = list(csv.DictReader(open(path)))
    want = np.array([[float(r["click"]), float(r["purchase"])] for r in rows], np.float32)
    text = np.concatenate([b.label for b in DataReader([path], 16, schema=s)])
    np.testing.assert_array_equal(text, want)
    assert (want[:, 1] <= want[:, 0]).all() and want[:, 1].sum() > 0   # a purchase is a click
    pieces = [(b.dense, b.sparse, b.label, b.offsets) for b in DataReader([path], 16, schema=s)]
    bagparts.write_split(str(tmp_path / "parts"), pieces, s, rows_per_part=25, has_label=True,
                         hash_bucket=0)
    back = np.concatenate([b.label for b in DataReader([str(tmp_path / "parts")], 16,
                                                       schema=s)])
    np.testing.assert_array_equal(back, want)


def test_schema_label_lists():
    s = Schema.from_dict(_formats_schema("csv").to_dict())
    assert s.labels == ("click", "purchase") and s.n_tasks == 2
    assert "labels click, purchase" in s.describe()
    assert Schema.criteo().labels == ("label",) and Schema.criteo().to_dict()["label"] == "label"
    with pytest.raises(SchemaError, match="several labels need"):
        Schema.from_dict({"format": "criteo", "label": ["a", "b"],
                          "dense": [{"names": ["I1"]}]})
    with pytest.raises(SchemaError, match="more than once"):
        Schema.from_dict({"format": "csv", "label": ["a", "a"], "dense": [{"names": ["I1"]}]})
    with pytest.raises(SchemaError, match="label must be"):
        Schema.from_dict({"format": "csv", "label": [], "dense": [{"names": ["I1"]}]})


def test_tensorboard_writes_each_task():
    from mpips.job.tracking import TensorBoard

    class Writer:
        def __init__(self):
            self.points = {}

        def add_scalar(self, key, v, x):
            self.points[key] = (v, x)

        def flush(self):
            pass
    tb = TensorBoard.__new__(TensorBoard)
    tb.writer, tb.steps = Writer(), 0
    tb.record({"epoch": 1, "test_auc": 0.7, "tasks": {"click": {"test_auc": 0.7},
                                                      "purchase": {"test_auc": 0.6,
                                                                   "train_loss": None}}}, 5)
    assert tb.writer.points["epoch/purchase/test_auc"] == (0.6, 1)
    assert "epoch/purchase/train_loss" not in tb.writer.points
