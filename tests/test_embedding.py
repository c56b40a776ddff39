"""Worker-side embedding kernels against numpy references (speed: bench/bench_kernels.py)."""
import numpy as np
import pytest

from mpips.kernels.embedding import (gather_rows, owner_of, scatter_add_rows,
                                     sum_duplicates, unique_inverse)
from mpips.kernels.hashmap import OWNER_SALT, SLOT_SALT

M64 = (1 << 64) - 1


def splitmix64_ref(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ctr_batch(rng, n=512 * 26):
    """Heavy-tailed ids as in a Criteo batch (many repeats), spread over int64."""
    z = rng.zipf(1.3, size=n).astype(np.int64)
    slot = np.tile(np.arange(26), n // 26 + 1)[:n]
    return (z * 1000003 + slot * 7919) * 0x9E3779B1


@pytest.mark.parametrize('case', ['ctr', 'empty', 'one', 'edge', 'all_unique'])
def test_unique_inverse_matches_numpy(case):
    rng = np.random.default_rng(0)
    ids = {'ctr': ctr_batch(rng),
           'empty': np.empty(0, np.int64),
           'one': np.array([-5], np.int64),
           'edge': np.array([0, -1, -2**63, 2**63 - 1, 0, -1, -2**63], np.int64),
           'all_unique': rng.permutation(np.arange(-3000, 3000, dtype=np.int64))}[case]
    u, inv = unique_inverse(ids)
    ref_u, ref_inv = np.unique(ids, return_inverse=True)
    assert np.array_equal(u, ref_u) and np.array_equal(inv, ref_inv)


def test_gather_and_scatter_add():
    rng = np.random.default_rng(2)
    table = rng.normal(size=(7, 3)).astype(np.float32)
    inv = rng.integers(0, 7, 50)
    out = np.empty((50, 3), np.float32)
    gather_rows(table, inv, out)
    assert np.array_equal(out, table[inv])
    grads = rng.normal(size=(50, 3)).astype(np.float32)
    acc = np.full((7, 3), 99.0, np.float32)                # kernel zeroes it
    scatter_add_rows(grads, inv.astype(np.int32), acc)
    ref = np.zeros((7, 3), np.float64)
    np.add.at(ref, inv, grads)
    np.testing.assert_allclose(acc, ref, rtol=1e-5, atol=1e-6)


def test_sum_duplicates():
    rng = np.random.default_rng(3)
    keys = rng.choice(np.array([-2**63, -1, 0, 5, 2**63 - 1], np.int64), 40)
    vals = rng.normal(size=(40, 4)).astype(np.float32)
    uk, uv = sum_duplicates(keys, vals)
    ref_k = np.unique(keys)
    assert np.array_equal(uk, ref_k)
    for k, row in zip(ref_k, uv):
        np.testing.assert_allclose(row, vals[keys == k].sum(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        sum_duplicates(keys, vals[:3])


def test_owner_of_reference_balance_and_independence():
    rng = np.random.default_rng(4)
    keys = np.concatenate([np.arange(-1000, 19000, dtype=np.int64),
                           np.array([-2**63, 2**63 - 1], np.int64)])
    out = np.empty(keys.shape[0], np.int32)
    owner_of(keys, 3, out)
    ref = [splitmix64_ref((k & M64) ^ int(OWNER_SALT)) % 3 for k in keys[:2000].tolist()]
    assert out[:2000].tolist() == ref
    assert out[-2:].tolist() == [splitmix64_ref((k & M64) ^ int(OWNER_SALT)) % 3
                                 for k in (-2**63, 2**63 - 1)]
    counts = np.bincount(out, minlength=3) / keys.shape[0]
    assert np.all(np.abs(counts - 1 / 3) < 0.02)           # sequential ids spread evenly
    # ids of one server are not clustered in its slot array: low slot-hash bits uniform
    mine = keys[out == 0][:3000]
    low = [splitmix64_ref((k & M64) ^ int(SLOT_SALT)) & 7 for k in mine.tolist()]
    frac = np.bincount(low, minlength=8) / len(low)
    assert np.all(np.abs(frac - 1 / 8) < 0.03)
    one = np.empty(keys.shape[0], np.int32)
    owner_of(keys, 1, one)
    assert not one.any()
    big = rng.integers(-2**63, 2**63 - 1, 5000, dtype=np.int64)
    o2 = np.empty(5000, np.int32)
    owner_of(big, 2, o2)
    assert 0.45 < o2.mean() < 0.55


@pytest.mark.parametrize('case', ['random', 'empty', 'one', 'edge', 'dups', 'high_bits_only',
                                  'low_byte', 'sorted', 'reversed'])
def test_radix_sort_matches_numpy_sort(case):
    from mpips.kernels.embedding import radix_sort_
    rng = np.random.default_rng(1)
    keys = {'random': rng.integers(-2**63, 2**63 - 1, 5001, dtype=np.int64, endpoint=True),
            'empty': np.empty(0, np.int64),
            'one': np.array([7], np.int64),
            'edge': np.array([0, -1, -2**63, 2**63 - 1, 1, -2**63 + 1, 2**63 - 2], np.int64),
            'dups': rng.integers(-3, 3, 1000).astype(np.int64),
            'high_bits_only': rng.integers(-100, 100, 999).astype(np.int64) << 48,
            'low_byte': rng.integers(0, 256, 777).astype(np.int64),       # one pass: odd
            'sorted': np.arange(-500, 500, dtype=np.int64) * 0x9E3779B1,
            'reversed': np.arange(500, -500, -1, dtype=np.int64) * 0x9E3779B1}[case]
    want = np.sort(keys)
    radix_sort_(keys, np.empty_like(keys))
    assert np.array_equal(keys, want)


@pytest.mark.parametrize('n_servers', [2, 3, 7])
def test_plan_keys_groups_by_owner_as_a_stable_argsort(n_servers):
    """plan_keys' grouping (a counting sort in numba) against numpy's stable argsort."""
    from mpips.tables.ownership import owners, plan_keys
    rng = np.random.default_rng(n_servers)
    ids = ctr_batch(rng, 3000).reshape(100, 30)
    ukeys, inv = np.unique(ids.reshape(-1), return_inverse=True)
    own = owners(ukeys, n_servers)
    order = np.argsort(own, kind='stable')
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    plan = plan_keys(ids, n_servers)
    assert np.array_equal(plan.keys, ukeys[order])
    assert np.array_equal(plan.inverse, rank[inv])
    assert np.array_equal(plan.keys[plan.inverse], ids.reshape(-1))
    assert np.array_equal(plan.offsets, np.concatenate([[0], np.cumsum(
        np.bincount(own, minlength=n_servers))]))
    for s in range(n_servers):
        grp = plan.keys[plan.offsets[s]:plan.offsets[s + 1]]
        assert np.all(owners(grp, n_servers) == s) and np.all(np.diff(grp) > 0)
