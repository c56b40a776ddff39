"""Paged sparse table: growth over many pages, shrink and re-insert, against a Python dict."""
import numpy as np
import pytest

from mpips.kernels.hashmap import init_rows
from mpips.kernels.pages import PagedColumns
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable

DIM, SEED, LR = 3, 5, 0.5


def init_of(key):
    out = np.empty((1, DIM), np.float32)
    init_rows(np.array([key], np.int64), SEED, 0.1, out)
    return out[0]


def check_against(t, ref, probe):
    """Table content == ref (key -> values) for every key in probe, and no extra rows."""
    out = np.empty((len(probe), DIM), np.float32)
    t.pull(probe, out, create=False)
    want = np.array([ref.get(k, np.zeros(DIM, np.float32)) for k in probe.tolist()])
    np.testing.assert_array_equal(out, want)
    assert len(t) == len(ref)
    exported = t.export_rows()
    assert sorted(exported['keys'].tolist()) == sorted(ref)
    got = dict(zip(exported['keys'].tolist(), exported['values']))
    for k, v in ref.items():
        np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize('opt', ['sgd', 'adam'])
def test_growth_shrink_reinsert_over_many_pages_matches_dict(opt):
    rng = np.random.default_rng(3)
    t = SparseTable(DIM, OptimizerConfig(opt, lr=LR), seed=SEED, init_range=0.1,
                    capacity=4, page_rows=16)
    ref, unseen, seen = {}, {}, set()      # key -> values; shrinks unseen; seen since shrink
    pool = rng.integers(-2**63, 2**63 - 1, 1500, dtype=np.int64)
    pages_seen = []
    for step in range(60):
        keys = np.unique(rng.choice(pool[:300 + 20 * step], size=rng.integers(1, 120)))
        out = np.empty((len(keys), DIM), np.float32)
        t.pull(keys, out, create=True)
        for k in keys.tolist():
            if k not in ref:
                ref[k], unseen[k] = init_of(k), 0
        seen.update(keys.tolist())
        np.testing.assert_array_equal(out, np.array([ref[k] for k in keys.tolist()]))
        if opt == 'sgd':                    # closed form: w -= lr * g
            g = rng.normal(size=(len(keys), DIM)).astype(np.float32)
            t.push(keys, g)
            for k, gk in zip(keys.tolist(), g):
                ref[k] = (ref[k] - np.float32(LR) * gk).astype(np.float32)
        if step % 9 == 8:                   # evict rows unseen for more than 1 shrink
            for k in ref:
                unseen[k] = 0 if k in seen else unseen[k] + 1
            seen.clear()
            gone = sorted(k for k in ref if unseen[k] > 1)
            pages_seen.append(t.n_pages)
            assert t.shrink(1) == len(gone)
            assert t.evicted_keys().tolist() == gone
            t.clear_evicted()
            for k in gone:
                del ref[k], unseen[k]
        assert t.capacity >= len(t) and len(t) <= 0.6 * t.n_slots
        check_against(t, ref, rng.choice(pool, 200))
    assert max(pages_seen) > 20 and t.n_pages <= -(-len(t) // 16)   # grew big, gave back


def test_shrink_frees_pages_and_reinserted_ids_start_fresh():
    t = SparseTable(DIM, OptimizerConfig('sgd', lr=LR), seed=SEED, init_range=0.1,
                    page_rows=16)
    keys = np.arange(1000, dtype=np.int64)
    out = np.empty((1000, DIM), np.float32)
    t.pull(keys, out, create=True)
    t.push(keys, np.ones((1000, DIM), np.float32))
    assert t.n_pages == 64                            # initial capacity 1024
    nbytes = t.nbytes
    t.shrink(0)                                       # all seen: nothing goes
    t.pull(keys[:40], out[:40], create=True)
    assert t.shrink(0) == 960 and len(t) == 40 and t.n_pages == 3
    assert t.nbytes < nbytes / 4                      # (incl. an 8 KB scratch buffer)
    t.pull(keys[990:], out[:10], create=True)         # evicted ids come back at init
    np.testing.assert_array_equal(out[:10], np.array([init_of(k) for k in range(990, 1000)]))
    np.testing.assert_array_equal(t.export_rows()['keys'], np.r_[keys[:40], keys[990:]])


def test_growth_never_moves_full_pages():
    cols = PagedColumns({'keys': (np.int64, 0, 'a'), 'values': (np.float32, 4, 'b'),
                         'flag': (np.uint8, 0, 'a')}, 8, 3, 1.25)
    assert cols.dtypes['a'].itemsize == 16 and cols.dtypes['b'].itemsize == 16
    assert cols.capacity == 3 and cols.n_pages == 1
    cols.grow(5, 3)
    assert cols.capacity == 5
    cols.view('values', 0)[:5] = np.arange(20).reshape(5, 4)
    cols.grow(20, 5)                                  # page 0 grows to full, then pages
    assert cols.n_pages == 3 and cols.capacity == 24
    assert (cols.view('values', 0)[:5] == np.arange(20).reshape(5, 4)).all()
    addresses = [p.ctypes.data for p in cols.pages['a']]
    cols.grow(100, 20)
    assert [p.ctypes.data for p in cols.pages['a'][:3]] == addresses
    assert cols.col['flag'][0].tolist()[:3] == [a + 8 for a in addresses]
    rows = np.array([0, 9, 23, 99, 4], np.int64)
    cols.scatter('values', rows, np.arange(20).reshape(5, 4))
    cols.scatter('flag', rows, 7)
    np.testing.assert_array_equal(cols.gather('values', rows), np.arange(20).reshape(5, 4))
    assert cols.view('values', 99 // 8)[99 % 8].tolist() == [12, 13, 14, 15]
    assert cols.gather('flag', rows).tolist() == [7] * 5 and cols.view('flag', 1)[1] == 7
    np.testing.assert_array_equal(cols.flat('values', 10)[[0, 4, 9]],
                                  np.arange(20).reshape(5, 4)[[0, 4, 1]])
    with pytest.raises(ValueError):
        PagedColumns({'keys': (np.int64, 0, 'a')}, 12, 3, 1.25)
