"""Feature admission (count / probability) in front of a SparseTable, against a Python dict."""
import numpy as np
import pytest

from mpips.tables.admission import AdmittedTable, parse_entry
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable


def table(spec, seed=1):
    inner = SparseTable(4, OptimizerConfig(name="sgd", lr=0.1), seed=7, init_range=0.5)
    return AdmittedTable(inner, spec, seed)


def pull(t, keys, create=True):
    out = np.full((len(keys), t.dim), np.nan, np.float32)
    t.pull(np.asarray(keys, np.int64), out, create=create)
    return out


def test_parse_entry():
    assert parse_entry("") == (None, 0.0)
    assert parse_entry("count:3") == ("count", 3)
    assert parse_entry("probability:0.25") == ("probability", 0.25)
    for bad in ("count:0", "count:1.5", "probability:0", "probability:2", "often:3", "count"):
        with pytest.raises(ValueError, match="--entry must be"):
            parse_entry(bad)


def test_count_filter_row_appears_exactly_at_nth_sighting():
    t = table("count:3")
    ref = SparseTable(4, OptimizerConfig(name="sgd"), seed=7, init_range=0.5)
    init = np.empty((1, 4), np.float32)
    ref.pull(np.array([42], np.int64), init, create=True)      # what the row starts as
    sightings = {}
    rng = np.random.default_rng(0)
    for _ in range(30):
        keys = np.unique(rng.integers(0, 12, 6))
        got = pull(t, keys)
        for k, row in zip(keys.tolist(), got):
            sightings[k] = sightings.get(k, 0) + 1
            if sightings[k] < 3:
                assert not row.any(), (k, sightings[k])           # zeros before admission
                assert t.rows_of(np.array([k]))[0] < 0
            else:
                assert t.rows_of(np.array([k]))[0] >= 0
    assert len(t) == sum(1 for c in sightings.values() if c >= 3)
    for _ in range(3):
        row = pull(t, [42])
    np.testing.assert_array_equal(row, init)      # admitted row starts at its (seed, id) init


def test_evaluation_pulls_do_not_count_and_pushes_are_dropped():
    t = table("count:2")
    for _ in range(5):
        assert not pull(t, [5], create=False).any()
    assert len(t) == 0 and t.waiting() == 0
    pull(t, [5])                                                     # first sighting
    t.push(np.array([5], np.int64), np.ones((1, 4), np.float32))    # dropped: no row yet
    assert len(t) == 0 and t.waiting() == 1
    first = pull(t, [5])                                             # second: admitted
    assert len(t) == 1 and t.waiting() == 0 and t.admitted == 1
    t.push(np.array([5], np.int64), np.ones((1, 4), np.float32))
    np.testing.assert_allclose(pull(t, [5], create=False), first - 0.1, rtol=1e-6)


def test_probability_entry_rate_and_reproducibility():
    p, n = 0.2, 20000
    keys = np.arange(n, dtype=np.int64) * 7919
    a, b = table(f"probability:{p}", seed=3), table(f"probability:{p}", seed=3)
    pull(a, keys)
    pull(b, keys[::-1].copy())
    rate = len(a) / n
    assert abs(rate - p) < 4 * np.sqrt(p * (1 - p) / n)           # 4 sigma
    np.testing.assert_array_equal(np.sort(a.export_rows()["keys"]),
                                  np.sort(b.export_rows()["keys"]))
    pull(a, keys)                                                     # second sighting
    expect = 1 - (1 - p) ** 2
    assert abs(len(a) / n - expect) < 4 * np.sqrt(expect * (1 - expect) / n)


def test_shrink_ages_waiting_counts_too():
    t = table("count:3")
    pull(t, [1, 2])
    assert t.waiting() == 2
    t.shrink(0)                       # seen since the last shrink: kept
    assert t.waiting() == 2
    t.shrink(0)                       # unseen for one shrink > threshold 0: forgotten
    assert t.waiting() == 0
    pull(t, [1])
    pull(t, [1])
    assert len(t) == 0                # the count restarted: 2 sightings since forgetting
    pull(t, [1])
    assert len(t) == 1


def test_counts_are_occurrences_in_the_batch():
    t = table("count:3")
    out = np.empty((2, 4), np.float32)
    t.pull(np.array([1, 2], np.int64), out, create=True, counts=np.array([3.0, 2.0]))
    assert t.rows_of(np.array([1, 2], np.int64)).tolist()[0] >= 0     # 3 occurrences: in
    assert t.rows_of(np.array([2], np.int64))[0] < 0                    # 2 so far: waiting
    t.pull(np.array([2], np.int64), out[:1], create=True, counts=np.array([1.0]))
    assert len(t) == 2


def test_seen_count_counts_the_admitting_pull_once():
    """A row's seen_count = training pulls since its row exists, as without admission."""
    t, plain = table("count:2"), table("")
    for _ in range(2):                          # sighting 1: waiting; 2: admitted
        pull(t, [9])
    pull(plain, [9])                            # no filter: the row is made at once
    seen = lambda x: int(x.export_rows()["seen_count"][0])      # noqa: E731
    assert seen(t) == seen(plain) == 1
    pull(t, [9])
    pull(plain, [9])
    assert seen(t) == seen(plain) == 2


def test_entry_counts_beyond_float32_integers_are_refused():
    parse_entry(f"count:{2 ** 24}")
    with pytest.raises(ValueError, match="at most 16777216"):
        parse_entry(f"count:{2 ** 24 + 1}")
