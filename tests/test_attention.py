"""Attention pooling (DIN's local activation unit) against a float64 plain-Python reference,
its gradients (the unit's weights, the bag's rows, the query's row) against central
differences: empty, one-id and max_len-cut bags, a shared table, softmax or not, with and
without a wide term; and the schema's one-line errors and the parsers' keep = "last"."""
import numpy as np
import pytest

from mpips.data.formats import TextFormat
from mpips.models import zoo
from mpips.schema import Schema, SchemaError
from tests.gradcheck import check_gradients

pytestmark = pytest.mark.unit

S, DIM, D = 3, 3, 2        # slots: 0 the history (attention), 1 the target (query), 2 other


def net(softmax=False, name="dnn", units=(4, 3), dtype=np.float64):
    return zoo.builtin(name, S, DIM, D, (5,), dtype=dtype, pooling=[2, 0, 1],
                       attention=[(0, 1, units, softmax)])


def ref_unit(P, q, ks, softmax, name="attn_C1"):
    """The pooled bag of rows ``ks`` (k, d) for query ``q`` (d,), in plain float64."""
    if len(ks) == 0:
        return np.zeros(len(q))
    scores = []
    for k in ks:
        h = np.concatenate([q, k, q - k, q * k])
        i = 0
        while f"{name}{i}.w" in P:
            h = np.maximum(h @ P[f"{name}{i}.w"] + P[f"{name}{i}.b"], 0)
            i += 1
        scores.append(h @ P[f"{name}.out.w"] + P[f"{name}.out.b"][0])
    w = np.array(scores)
    if softmax:
        w = np.exp(w - w.max())
        w /= w.sum()
    return (w[:, None] * ks).sum(axis=0)


def batch(rng, n_rows, lens):
    """CSR bags: the history of each example has lens[i] ids; target and other one id each
    (the target drawn from the same rows: a shared table)."""
    ids, off = [], [0]
    for L in lens:
        for size in (L, 1, 2):
            ids += list(rng.integers(0, n_rows, size))
            off.append(len(ids))
    return np.array(ids, np.int64), np.array(off, np.int64)


def run(m, params, rows, ids, off, dense, label):
    emb = np.empty((len(label), m.emb_width))
    m.pool(rows, ids, off, emb)
    grad, gemb = np.empty(m.n_params), np.empty_like(emb)
    loss, _ = m.forward_backward(params, emb, dense, label, grad, gemb)
    grows = np.empty_like(rows)
    m.unpool(gemb, ids, off, grows)
    return loss, grad, grows, emb


def problem(m, lens=(0, 1, 4, 2, 3), seed=0):
    rng = np.random.default_rng(seed)
    params = m.init_params(seed) + 0.3 * rng.standard_normal(m.n_params)
    rows = 0.7 * rng.standard_normal((6, m.row_dim))
    ids, off = batch(rng, len(rows), lens)
    n = len(lens)
    return params, rows, ids, off, rng.random((n, D)), (rng.random(n) < 0.5).astype(float)


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("name", ["dnn", "wide_deep"])
def test_forward_matches_a_plain_reference(softmax, name):
    m = net(softmax, name)
    params, rows, ids, off, dense, label = problem(m)
    _, _, _, emb = run(m, params, rows, ids, off, dense, label)
    P = m.views(params)
    c0 = int(m.has_w)
    for i in range(len(label)):
        bag = ids[off[i * S]:off[i * S + 1]]
        q = rows[ids[off[i * S + 1]], c0:]
        want = ref_unit(P, q, rows[bag, c0:], softmax)
        np.testing.assert_allclose(emb[i, c0:m.row_dim], want, rtol=1e-12, atol=1e-14)
        if c0:                                       # the wide weight of the bag: its sum
            np.testing.assert_allclose(emb[i, 0], rows[bag, 0].sum(), atol=1e-14)
    assert np.all(emb[0, c0:m.row_dim] == 0)            # the empty bag pools to zeros
    assert m.n_params == zoo.builtin(name, S, DIM, D, (5,)).n_params + \
        (4 * DIM * 4 + 4) + (4 * 3 + 3) + 3 + 1


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("name", ["dnn", "wide_deep"])
def test_gradients_match_central_differences(softmax, name):
    m = net(softmax, name)
    params, rows, ids, off, dense, label = problem(m, seed=1)
    _, grad, grows, _ = run(m, params, rows, ids, off, dense, label)
    check_gradients(lambda p, r: run(m, p, r, ids, off, dense, label)[0],
                    params, rows, grad, grows)
    attn = [off for name_, off, _ in m.layout if name_.startswith("attn_")]
    assert np.abs(grad[min(attn):]).max() > 1e-4      # the unit's weights learn


def test_float32_follows_float64():
    m32, m64 = net(dtype=np.float32), net()
    params, rows, ids, off, dense, label = problem(m64, seed=2)
    l64, g64, r64, _ = run(m64, params, rows, ids, off, dense, label)
    f = np.float32
    emb = np.empty((len(label), m32.emb_width), f)
    m32.pool(rows.astype(f), ids, off, emb)
    grad, gemb = np.empty(m32.n_params, f), np.empty_like(emb)
    l32, _ = m32.forward_backward(params.astype(f), emb, dense.astype(f), label, grad, gemb)
    grows = np.empty(rows.shape, f)
    m32.unpool(gemb, ids, off, grows)
    assert abs(l32 - l64) < 1e-5
    np.testing.assert_allclose(grad, g64, atol=2e-5)
    np.testing.assert_allclose(grows, r64, atol=2e-5)


def test_predict_in_chunks_equals_one_pass(monkeypatch):
    import mpips.models.network as nw
    m = net(True)
    params, rows, ids, off, dense, _ = problem(m, lens=(3, 0, 5, 1, 2, 7, 4), seed=3)
    emb = np.empty((7, m.emb_width))
    m.pool(rows, ids, off, emb)
    whole = np.empty(7)
    m.predict(params, emb.copy(), dense, whole)
    monkeypatch.setattr(nw, "PREDICT_CHUNK", 3)
    m2 = net(True)
    m2.pool(rows, ids, off, emb)
    part = np.empty(7)
    m2.predict(params, emb, dense, part)
    np.testing.assert_allclose(part, whole, rtol=1e-12)   # BLAS blocks by size


def test_attention_without_bags_is_an_error():
    m = net()
    params = m.init_params(0)
    with pytest.raises(ValueError, match="pool\\(\\) it first"):
        m.predict(params, np.zeros((2, m.emb_width)), np.zeros((2, D)), np.empty(2))


DIN = dict(format="csv", header=False, delimiter=";", label="label",
           fields=["hist_items", "hist_cats", "target_item", "target_cat", "label"])


def din_schema(**hist):
    opts = dict(names=["hist_items"], separator=" ", table="item", pooling="attention",
                query="target_item")
    opts.update(hist)
    return Schema.from_dict({**DIN, "sparse": [
        opts, {"names": ["hist_cats"], "separator": " ", "table": "cat"},
        {"names": ["target_item"], "table": "item"}, {"names": ["target_cat"], "table": "cat"}]})


def test_max_len_keeps_the_newest_ids_and_tables_share_ids():
    line = b"1 2 3 4 5;7 8 9 10 11;3;9;1\n;;5;9;0\n"
    last = TextFormat(din_schema(max_len=3, keep="last")).parse(line)
    first = TextFormat(din_schema(max_len=3)).parse(line)
    whole = TextFormat(din_schema()).parse(line)
    all_items = whole.sparse[:5]                        # ids of items 1..5
    np.testing.assert_array_equal(last.sparse[:3], all_items[2:])       # 3 4 5: the newest
    np.testing.assert_array_equal(first.sparse[:3], all_items[:3])      # 1 2 3 (today's)
    assert last.truncated == first.truncated == 1
    assert whole.sparse[whole.offsets[2]] == all_items[2]   # target item 3 = history's 3
    cats = whole.sparse[whole.offsets[1]:whole.offsets[2]]
    assert whole.sparse[whole.offsets[3]] == cats[2]        # target cat 9 = history's 9
    assert list(whole.offsets[4:9]) == [12, 12, 12, 13, 14]     # the empty history: empty
    np.testing.assert_array_equal(whole.label, [1, 0])


@pytest.mark.parametrize("hist,want", [
    (dict(query="nope"), "query = 'nope' names no sparse slot"),
    (dict(query="hist_items"), "must be pooled by sum or mean"),
    (dict(pooling="sum"), "set pooling = \"attention\" or drop query"),
    (dict(attention_units=[]), "attention_units must be a non-empty list"),
    (dict(keep="newest"), "keep 'newest' is not one of first, last"),
])
def test_bad_sequence_options_are_one_line_errors(hist, want):
    with pytest.raises(SchemaError, match=want) as e:
        din_schema(**hist)
    assert "\n" not in str(e.value)


def test_schema_round_trips_and_attention_list():
    s = din_schema(attention_units=[8, 4], attention_softmax=True)
    assert Schema.from_dict(s.to_dict()) == s and not s.diff(Schema.from_dict(s.to_dict()))
    assert s.attention() == [(0, 2, (8, 4), True)]
    assert s.hash_seeds()[0] == s.hash_seeds()[2] != s.hash_seeds()[1] == s.hash_seeds()[3]
    assert Schema.criteo().hash_seeds() == Schema.criteo().hash_seeds()
