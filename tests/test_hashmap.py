"""Hash map kernels and the sparse table's id -> row map, against a Python dict."""
import numpy as np
import pytest

from mpips.kernels.hashmap import (INIT_SALT, age_rows, init_rows, insert_missing,
                                   lookup_rows, read_rows, rebuild_slots, touch_rows)
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable

M64 = (1 << 64) - 1
I64_MIN, I64_MAX = -2**63, 2**63 - 1


def splitmix64_ref(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def init_ref(key, seed, init_range, dim):
    base = splitmix64_ref(seed ^ int(INIT_SALT))
    h0 = splitmix64_ref((key & M64) ^ base)
    out = []
    for j in range(dim):
        h = splitmix64_ref((h0 + j * 0x9E3779B97F4A7C15) & M64)
        out.append(init_range * (2.0 * ((h >> 40) / 2.0**24) - 1.0))
    return np.array(out, np.float32)


def adversarial_keys():
    seq = np.arange(-50, 1000, dtype=np.int64)
    high = np.arange(1, 200, dtype=np.int64) << 40     # differ only in high bits
    pow2 = np.arange(1, 200, dtype=np.int64) * 2**20    # same low bits
    edge = np.array([0, -1, 1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1], np.int64)
    return np.unique(np.concatenate([seq, high, pow2, edge]))


def table(capacity=16, dim=3):
    return SparseTable(dim, OptimizerConfig('sgd', lr=0.1), seed=7, capacity=capacity)


def test_kernels_insert_lookup_with_duplicates():
    slots = np.full(64, -1, np.int32)
    row_keys = np.empty(32, np.int64)
    keys = np.array([5, I64_MIN, 5, -1, I64_MAX, -1, 0], np.int64)
    rows = np.empty(7, np.int64)
    assert lookup_rows(slots, row_keys, keys, rows) == 0
    assert (rows == -1).all()
    n = insert_missing(slots, row_keys, 0, keys, rows)
    assert n == 5
    assert rows.tolist() == [0, 1, 0, 2, 3, 2, 4]
    assert row_keys[:5].tolist() == [5, I64_MIN, -1, I64_MAX, 0]
    again = np.empty(7, np.int64)
    assert lookup_rows(slots, row_keys, keys, again) == 7
    assert (again == rows).all()
    big = np.full(256, -1, np.int32)
    rebuild_slots(row_keys, n, big)
    assert lookup_rows(big, row_keys, keys, again) == 7 and (again == rows).all()
    miss = np.array([1, 6, -2], np.int64)
    assert lookup_rows(big, row_keys, miss, again[:3]) == 0 and (again[:3] == -1).all()


def test_table_matches_dict_under_random_inserts_and_growth():
    rng = np.random.default_rng(0)
    t = table(capacity=16)
    ref = {}
    pool = np.concatenate([adversarial_keys(), rng.integers(I64_MIN, I64_MAX, 3000,
                                                           dtype=np.int64, endpoint=True)])
    out = np.empty((0, 3), np.float32)
    for step in range(40):
        keys = rng.choice(pool, size=rng.integers(1, 300))        # duplicates included
        if out.shape[0] != keys.shape[0]:
            out = np.empty((keys.shape[0], 3), np.float32)
        t.pull(keys, out, create=step % 3 != 2)
        if step % 3 != 2:
            for k in keys.tolist():
                ref.setdefault(k, len(ref))
        probe = rng.choice(pool, size=200)
        rows = t.rows_of(probe)
        expect = [ref.get(k, -1) for k in probe.tolist()]
        assert rows.tolist() == expect
        assert len(t) == len(ref)
    assert t.capacity >= len(ref) and len(ref) <= 0.6 * t.n_slots
    exported = t.export_rows()['keys']
    assert exported.tolist() == list(ref)           # rows appended in first-seen order


def test_adversarial_keys_all_distinct_rows():
    keys = adversarial_keys()
    t = table(capacity=16)
    out = np.empty((keys.shape[0], 3), np.float32)
    t.pull(keys, out, create=True)
    assert len(t) == keys.shape[0]
    rows = t.rows_of(keys)
    assert np.unique(rows).shape[0] == keys.shape[0]
    assert (t.export_rows(rows)['keys'] == keys).all()


def test_init_rows_matches_reference_and_range():
    keys = np.array([0, -1, I64_MIN, I64_MAX, 12345], np.int64)
    out = np.empty((5, 6), np.float32)
    init_rows(keys, 42, 0.05, out)
    for i, k in enumerate(keys.tolist()):
        assert np.array_equal(out[i], init_ref(k, 42, 0.05, 6))
    many = np.empty((20000, 4), np.float32)
    init_rows(np.arange(20000, dtype=np.int64), 1, 0.01, many)
    assert many.min() >= -0.01 and many.max() < 0.01
    assert abs(many.mean()) < 2e-4 and abs(many.std() - 0.01 / np.sqrt(3)) < 2e-4
    other = np.empty_like(out)
    init_rows(keys, 43, 0.05, other)
    assert not np.any(other == out)                   # seed changes every value


def test_init_independent_of_order_and_table():
    rng = np.random.default_rng(1)
    keys = np.unique(rng.integers(I64_MIN, I64_MAX, 2000, dtype=np.int64))
    a, b = table(capacity=16), table(capacity=5000)
    out_a = np.empty((keys.shape[0], 3), np.float32)
    a.pull(keys, out_a, create=True)
    perm = rng.permutation(keys.shape[0])
    out_b = np.empty_like(out_a)
    for part in np.array_split(perm, 7):              # other order, other chunks
        tmp = np.empty((part.shape[0], 3), np.float32)
        b.pull(keys[part], tmp, create=True)
        out_b[part] = tmp
    assert np.array_equal(out_a, out_b)
    direct = np.empty_like(out_a)
    init_rows(keys, 7, 0.01, direct)                  # what a GEO worker computes
    assert np.array_equal(out_a, direct)


def test_read_touch_age_kernels():
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = np.full((3, 3), 9, np.float32)
    read_rows(values, np.array([2, -1, 0]), out)
    assert np.array_equal(out, np.array([values[2], np.zeros(3), values[0]]))
    flag = np.zeros(4, np.uint8)
    count = np.array([0, 0, 0xFFFFFFFF, 0], np.uint32)
    dirty = np.zeros(4, np.uint8)
    touch_rows(np.array([0, 2, 0]), flag, count, dirty, True, False)
    assert flag.tolist() == [1, 0, 1, 0] and count.tolist() == [2, 0, 0xFFFFFFFF, 0]
    assert not dirty.any()
    touch_rows(np.array([3]), flag, count, dirty, False, True)
    assert dirty.tolist() == [0, 0, 0, 1] and count[3] == 0
    unseen = np.array([5, 1, 2, 65535], np.uint16)
    flag[:] = [1, 0, 0, 0]
    keep = np.empty(4, np.bool_)
    assert age_rows(unseen, flag, 4, 2, keep) == 2
    assert unseen.tolist() == [0, 2, 3, 65535] and keep.tolist() == [1, 1, 0, 0]
    assert not flag.any()


@pytest.mark.parametrize('n', [0, 1])
def test_tiny_calls(n):
    t = table()
    keys = np.arange(n, dtype=np.int64)
    out = np.empty((n, 3), np.float32)
    t.pull(keys, out, create=True)
    t.push(keys, np.ones((n, 3), np.float32))
    assert len(t) == n


def test_prefetching_paths_on_flat_arrays_match_a_dict():
    """Calls longer than the kernels' prefetch distance (pages.AHEAD) on plain arrays:
    the prefetch of a slot, a key and a 2-D row must change nothing (flat-array paths
    of ``prefetch``; the paged ones run in every table test)."""
    from mpips.kernels.pages import AHEAD
    rng = np.random.default_rng(3)
    n = 40 * AHEAD
    keys = rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64, endpoint=True)
    slots, row_keys = np.full(4 * n, -1, np.int32), np.empty(n, np.int64)
    rows = np.full(n, -1, np.int64)
    assert insert_missing(slots, row_keys, 0, keys, rows) == len(set(keys.tolist()))
    ref = {}
    for k in keys.tolist():
        ref.setdefault(k, len(ref))
    probe = np.concatenate([keys[::-1], rng.integers(0, 1 << 20, n)])
    got = np.empty(probe.shape[0], np.int64)
    lookup_rows(slots, row_keys, probe, got)
    assert got.tolist() == [ref.get(k, -1) for k in probe.tolist()]
    for m in range(2 * AHEAD + 3):      # calls as short as the ring of home slots, and shorter
        part = np.concatenate([keys[m::7][:m // 2], probe[n:][:m - m // 2]])
        short = np.empty(m, np.int64)
        lookup_rows(slots, row_keys, part, short)
        assert short.tolist() == [ref.get(k, -1) for k in part.tolist()]
    values = rng.standard_normal((n, 5)).astype(np.float32)
    out = np.empty((probe.shape[0], 5), np.float32)
    read_rows(values, got, out)
    expect = np.where(got[:, None] >= 0, values[np.maximum(got, 0)], 0)
    assert np.array_equal(out, expect)
