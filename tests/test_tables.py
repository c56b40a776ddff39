"""SparseTable and DenseTable semantics (no MPI; throughput and bytes per row: bench/bench_load.py)."""

import numpy as np
import pytest

from mpips.kernels.hashmap import init_rows
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable

DIM = 4
SEED = 11


def make(name='adam', capacity=16, **kw):
    return SparseTable(DIM, OptimizerConfig(name, lr=0.01, **kw), seed=SEED,
                       init_range=0.05, capacity=capacity)


def init_of(keys, dim=DIM):
    out = np.empty((len(keys), dim), np.float32)
    init_rows(np.asarray(keys, np.int64), SEED, 0.05, out)
    return out


def pull(t, keys, create=False):
    keys = np.asarray(keys, np.int64)
    out = np.empty((keys.shape[0], t.dim), np.float32)
    t.pull(keys, out, create=create)
    return out


def by_key(d):
    order = np.argsort(d['keys'])
    return {k: v[order] for k, v in d.items()}


def test_pull_without_create_reads_zeros_and_creates_nothing():
    t = make()
    assert not pull(t, [1, 2, 3]).any() and len(t) == 0
    pull(t, [2], create=True)
    got = pull(t, [1, 2, 3])
    assert len(t) == 1
    assert np.array_equal(got, np.vstack([np.zeros(DIM), init_of([2])[0], np.zeros(DIM)]))
    assert t.export_rows()['seen_count'].tolist() == [1]


def test_pull_create_counts_and_inits():
    t = make()
    keys = [5, -3, 5, 7]
    got = pull(t, keys, create=True)
    assert np.array_equal(got, init_of(keys)) and len(t) == 3
    pull(t, [5], create=True)
    d = by_key(t.export_rows())
    assert d['keys'].tolist() == [-3, 5, 7] and d['seen_count'].tolist() == [1, 3, 1]
    assert d['dirty'].tolist() == [1, 1, 1] and d['seen_flag'].tolist() == [1, 1, 1]


def test_push_creates_and_updates_sgd():
    t = make('sgd')
    pull(t, [1], create=True)
    t.clear_dirty()
    keys = np.array([1, 2], np.int64)
    g = np.ones((2, DIM), np.float32)
    t.push(keys, g, scale=0.5)
    np.testing.assert_allclose(pull(t, keys), init_of(keys) - 0.01 * 0.5, rtol=1e-6)
    assert sorted(t.dirty_keys().tolist()) == [1, 2]
    assert by_key(t.export_rows())['seen_count'].tolist() == [1, 0]
    t.clear_dirty()
    assert t.dirty_keys().size == 0
    t.push(np.array([3, 1], np.int64), g, create=False)   # 3 has no row: dropped
    assert len(t) == 2 and t.dirty_keys().tolist() == [1]
    t.add(np.array([4], np.int64), np.full((1, DIM), 2.0, np.float32))
    np.testing.assert_allclose(pull(t, [4]), init_of([4]) + 2.0)


def test_lazy_adam_in_table_matches_reference():
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    t = make('adam')
    rng = np.random.default_rng(0)
    universe = np.array([-2**63, -1, 0, 9, 2**63 - 1], np.int64)
    w = {k: init_of([k])[0].astype(np.float64) for k in universe.tolist()}
    m = {k: np.zeros(DIM) for k in w}
    v = {k: np.zeros(DIM) for k in w}
    steps = dict.fromkeys(w, 0)
    for _ in range(6):
        keys = rng.choice(universe, size=rng.integers(1, 5), replace=False)
        g = rng.normal(size=(keys.shape[0], DIM)).astype(np.float32)
        t.push(keys, g, scale=0.5)
        for k, gk in zip(keys.tolist(), 0.5 * g.astype(np.float64)):
            steps[k] += 1
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk * gk
            mh, vh = m[k] / (1 - b1 ** steps[k]), v[k] / (1 - b2 ** steps[k])
            w[k] = w[k] - lr * mh / (np.sqrt(vh) + eps)
    live = [k for k in w if steps[k]]
    np.testing.assert_allclose(pull(t, live), np.array([w[k] for k in live]),
                               rtol=1e-4, atol=1e-6)
    d = t.export_rows(t.rows_of(live))
    np.testing.assert_allclose(d['beta1_pow'], [b1 ** (steps[k] + 1) for k in live], rtol=1e-5)


def test_shrink_ages_resets_and_removes():
    t = make('adagrad', capacity=16)
    old = np.arange(0, 3000, dtype=np.int64)
    pull(t, old, create=True)
    t.push(old[:10], np.ones((10, DIM), np.float32))
    assert t.shrink(1) == 0                           # all seen: unseen 0
    young = np.arange(3000, 3100, dtype=np.int64)
    pull(t, young, create=True)
    assert t.shrink(1) == 0                           # old: unseen 1 (<= 1), young 0
    before = t.export_rows(t.rows_of(young))
    pull(t, old[:5], create=True)                     # old[:5] seen again: reset
    nbytes, cap = t.nbytes, t.capacity
    assert t.shrink(1) == 2995                        # old[5:] now unseen 2 > 1
    assert len(t) == 105 and t.nbytes < nbytes / 5 and t.capacity < cap
    assert np.array_equal(t.evicted_keys(), old[5:])
    d = by_key(t.export_rows())
    assert d['keys'].tolist() == old[:5].tolist() + young.tolist()
    assert d['unseen'].tolist() == [0] * 5 + [1] * 100
    after = t.export_rows(t.rows_of(young))
    for k in before:                                  # remaining rows intact
        if k not in ('unseen', 'seen_flag'):
            assert np.array_equal(before[k], after[k]), k
    assert np.array_equal(pull(t, old[5:10]), np.zeros((5, DIM)))
    pull(t, [1, 2, 3, 77], create=True)               # inserts work after the rebuild
    assert len(t) == 106 and t.rows_of([77])[0] == 105
    t.clear_evicted()
    assert t.evicted_keys().size == 0
    assert t.shrink(0) == 102 and sorted(t.export_rows()['keys'].tolist()) == [1, 2, 3, 77]
    with pytest.raises(ValueError):
        t.shrink(-1)


@pytest.mark.parametrize('name', ['sgd', 'adagrad', 'adam'])
def test_export_import_round_trip(name):
    src = make(name)
    rng = np.random.default_rng(1)
    keys = rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64)
    pull(src, keys, create=True)
    for _ in range(3):
        k = np.unique(rng.choice(keys, 200))
        src.push(k, rng.normal(size=(k.shape[0], DIM)).astype(np.float32))
    src.shrink(5)
    full = src.export_rows()
    assert list(full) == src.row_fields()
    dst = make(name)
    pull(dst, keys[:50], create=True)                 # some rows exist already: overwrite
    dst.push(np.unique(keys[:50]), np.ones((np.unique(keys[:50]).shape[0], DIM), np.float32))
    dst.import_rows(full)
    a, b = by_key(full), by_key(dst.export_rows())
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    with pytest.raises(ValueError, match='accepts only'):
        dst.import_rows({'keys': full['keys'], 'values': full['values'], 'bogus': full['keys']})
    with pytest.raises(ValueError, match='unique'):
        dst.import_rows({'keys': np.array([1, 1]), 'values': np.zeros((2, DIM))})
    part = {'keys': np.array([123456789], np.int64), 'values': np.ones((1, DIM))}
    dst.import_rows(part)                             # missing state: fresh, dirty = 1
    row = dst.export_rows(dst.rows_of(part['keys']))
    assert np.array_equal(row['values'], np.ones((1, DIM), np.float32)) and row['dirty'][0] == 1


def test_validation_errors():
    t = make()
    with pytest.raises(ValueError, match='writable C-contiguous float32'):
        t.pull(np.array([1]), np.empty((1, DIM), np.float64))
    with pytest.raises(TypeError, match='integer'):
        t.pull(np.array([1.0]), np.empty((1, DIM), np.float32))
    with pytest.raises(ValueError, match='shape'):
        t.push(np.array([1]), np.ones((2, DIM), np.float32))
    with pytest.raises(ValueError):
        SparseTable(0, OptimizerConfig(), seed=0)
    with pytest.raises(TypeError):
        SparseTable(4, 'adam', seed=0)


@pytest.mark.parametrize('name', ['sgd', 'adagrad', 'adam'])
def test_dense_table_matches_sparse_row(name):
    opt = OptimizerConfig(name, lr=0.05)
    init = np.linspace(-1, 1, 7)
    d = DenseTable(init, opt)
    s = SparseTable(7, opt, seed=0, init_range=0.0)
    s.import_rows({'keys': np.array([0]), 'values': init[None, :]})
    rng = np.random.default_rng(2)
    for _ in range(3):
        g = rng.normal(size=7).astype(np.float32)
        d.push(g, scale=0.5)
        s.push(np.array([0]), g[None, :], scale=0.5)
    out = np.empty(7, np.float32)
    d.pull(out)
    assert np.array_equal(out, pull(s, [0])[0])
    d.add(np.ones(7))
    d.pull(out)
    np.testing.assert_allclose(out, pull(s, [0])[0] + 1)
    state = d.export_state()
    d2 = DenseTable(np.zeros(7), opt)
    d2.import_state(state)
    assert all(np.array_equal(state[k], v) for k, v in d2.export_state().items())
    assert d.nbytes == 7 * 4 * (1 + {'sgd': 0, 'adagrad': 1, 'adam': 2}[name]) + \
        (8 if name == 'adam' else 0)
    with pytest.raises(ValueError):
        d.push(np.ones(6))


@pytest.mark.parametrize('name', ['sgd', 'adagrad', 'adam'])
@pytest.mark.parametrize('W', [2, 3])
def test_dense_shards_updated_apart_equal_one_whole_update(name, W):
    """The workers' split of the dense optimizer (mpips.worker.dense_sync): each of W
    replicas updates only its shard, the shards are put together; after several steps
    the weights and the owners' state are bit for bit those of whole-vector pushes."""
    from mpips.worker.dense_sync import shard_bounds
    n = 1003                                            # not a multiple of W, nor of 16
    b = shard_bounds(n, W)
    assert b[0] == 0 and b[-1] == n and all(b[k] <= b[k + 1] for k in range(W))
    assert max(np.diff(b)) - min(np.diff(b)) <= 1
    opt = OptimizerConfig(name, lr=0.05)
    init = np.random.default_rng(1).normal(size=n)
    whole = DenseTable(init, opt)
    parts = [DenseTable(init, opt) for _ in range(W)]
    rng = np.random.default_rng(2)
    for _ in range(4):
        g = rng.normal(size=n).astype(np.float32)
        whole.push(g, scale=0.25)
        for k, t in enumerate(parts):
            t.push_range(g[b[k]:b[k + 1]], 0.25, b[k], b[k + 1])
        merged = np.concatenate([t.values[b[k]:b[k + 1]] for k, t in enumerate(parts)])
        for t in parts:                                  # the weights allgather
            t.assign(merged)
    assert np.array_equal(parts[0].values, whole.values)
    ref = whole.export_state()
    for k, t in enumerate(parts):
        for key, arr in t.export_state().items():
            sl = slice(b[k], b[k + 1]) if arr.size == n else slice(None)
            assert np.array_equal(arr[sl], ref[key][sl]), (k, key)
    with pytest.raises(ValueError, match='outside'):
        whole.push_range(np.ones(2, np.float32), 1.0, n - 1, n + 1)
    with pytest.raises(ValueError, match='shape'):
        whole.push_range(np.ones(3, np.float32), 1.0, 0, 2)


def test_row_count_beyond_the_int32_slots_fails_clearly(monkeypatch):
    from mpips.tables import sparse as sparse_table
    monkeypatch.setattr(sparse_table, "MAX_ROWS", 100)    # the real limit is 2**31 - 1 rows
    t = SparseTable(2, OptimizerConfig(name="sgd"), seed=1)
    out = np.empty((100, 2), np.float32)
    t.pull(np.arange(100, dtype=np.int64), out, create=True)
    with pytest.raises(OverflowError, match="at most 100 rows per server"):
        t.pull(np.arange(100, 101, dtype=np.int64), out[:1], create=True)
    assert len(t) == 100
