"""The disk tier (mpips.tables.tiered) against the in-memory SparseTable in the same process,
under caps of a few rows (every step misses): pull, push, add, assign, admission, shrink,
change tracking, saves (full, base, delta), loads and re-sharding, all bit-equal."""
import os

import h5py
import numpy as np
import pytest

from mpips import checkpoint as ck
from mpips.kernels.hashmap import subsequence_mask
from mpips.tables.admission import AdmittedTable
from mpips.tables.dense import DenseTable
from mpips.tables.disk import IdFilter, RowStore
from mpips.tiering import check_dir
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.tables.tiered import MIN_MAP_BUDGET, POLICIES, POLICY, TieredTable

DIM, P = 3, 11
OPTS = [OptimizerConfig(name="adam", lr=0.05), OptimizerConfig(name="adagrad", lr=0.1),
        OptimizerConfig(name="sgd", lr=0.1)]


def pair(tmp_path, opt=OPTS[0], cap_rows=4, seed=7, policy=POLICY):
    """(in-memory table, tiered table of ``cap_rows`` resident rows), same settings."""
    ref = SparseTable(DIM, opt, seed=seed, init_range=0.1)
    cache = SparseTable(DIM, opt, seed=seed, init_range=0.1)
    rb = TieredTable.bytes_per_row(cache.export_rows(np.empty(0, np.int64)))
    tier = TieredTable(cache, MIN_MAP_BUDGET + cap_rows * rb, str(tmp_path / "tier"), tag="t",
                       policy=policy)
    assert tier.cap_rows == cap_rows
    return ref, tier


def by_key(table, skip=()):
    data = table.export_rows()
    order = np.argsort(data["keys"])
    return {f: a[order] for f, a in data.items() if f not in skip}


def assert_equal_tables(a, b, skip=()):
    assert len(a) == len(b)
    ra, rb = by_key(a, skip), by_key(b, skip)
    assert ra.keys() == rb.keys()
    for f in ra:
        np.testing.assert_array_equal(ra[f], rb[f], err_msg=f)


def step(tables, rng, pool, create=True):
    """One training step on each table: pull a random batch, push gradients; the pulls
    must agree."""
    keys = np.unique(rng.choice(pool, rng.integers(1, 9)))
    grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
    outs = []
    for t in tables:
        out = np.empty((len(keys), DIM), np.float32)
        t.pull(keys, out, create=create)
        t.push(keys, grads, 0.5)
        outs.append(out)
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o)


POOL = np.array([-2**62, -5, 0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 2**62, 2**63 - 1] +
                list(range(1000, 1040)), np.int64)


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.name)
def test_training_and_shrink_equal_in_memory(tmp_path, opt):
    ref, tier = pair(tmp_path, opt, cap_rows=3)
    rng = np.random.default_rng(1)
    for i in range(120):
        step((ref, tier), rng, POOL)
        if i % 17 == 16:
            assert ref.shrink(2) == tier.shrink(2)
            np.testing.assert_array_equal(ref.evicted_keys(), tier.evicted_keys())
        if i % 29 == 28:
            np.testing.assert_array_equal(np.sort(ref.dirty_keys()), np.sort(tier.dirty_keys()))
            assert ref.count_rows(True) == tier.count_rows(True)
            ref.clear_dirty(), tier.clear_dirty()
            ref.clear_evicted(), tier.clear_evicted()
            assert tier.count_rows(True) == 0
        assert len(tier.cache) <= 3 + 8          # the cap, exceeded by one call's keys at most
    assert tier.store.count > 0 and tier.moved_in > 0 and tier.moved_out > 0
    assert tier.stats()["hit_ratio"] < 0.9
    assert_equal_tables(ref, tier)
    ref.age(3), tier.age(3)
    assert_equal_tables(ref, tier)


@pytest.mark.parametrize("policy", POLICIES)
def test_clean_rows_keep_their_disk_copy(tmp_path, policy):
    """Rows read in and only read (evaluation pulls) are dropped without a write; changed
    ones are written back; a shrink removing a resident row deletes its copy.  Each id
    counts once (``len``) and every walk of the disk skips the resident rows' copies."""
    ref, tier = pair(tmp_path, cap_rows=3, policy=policy)
    rng = np.random.default_rng(9)
    copies = 0
    for i in range(90):
        step((ref, tier), rng, POOL)
        if i % 10 == 9:                                   # an evaluation pass over the pool
            for lo in range(0, len(POOL), 4):
                o = [np.empty((len(POOL[lo:lo + 4]), DIM), np.float32) for _ in range(2)]
                ref.pull(POOL[lo:lo + 4], o[0]), tier.pull(POOL[lo:lo + 4], o[1])
                np.testing.assert_array_equal(o[0], o[1])
            copies = max(copies, tier.copies())
        if i % 23 == 22:
            assert ref.shrink(1) == tier.shrink(1)
            np.testing.assert_array_equal(ref.evicted_keys(), tier.evicted_keys())
        assert len(tier) == len(ref)
        if i % 30 == 29:
            np.testing.assert_array_equal(np.sort(ref.dirty_keys()), np.sort(tier.dirty_keys()))
            assert ref.count_rows(True) == tier.count_rows(True)
            ref.clear_dirty(), tier.clear_dirty()
    assert copies > 0 and 0 < tier.written_back < tier.moved_out
    assert_equal_tables(ref, tier)
    rows = tier.export_rows()
    assert len(np.unique(rows["keys"])) == len(rows["keys"]) == len(ref)


def test_eval_pull_add_assign_and_unknown_ids(tmp_path):
    ref, tier = pair(tmp_path, cap_rows=2)
    rng = np.random.default_rng(2)
    for _ in range(30):
        step((ref, tier), rng, POOL[:12])
    keys = np.array([3, 77777, 13, -5, 4242], np.int64)       # 77777, 4242: no row
    outs = [np.empty((5, DIM), np.float32) for _ in range(2)]
    for t, o in zip((ref, tier), outs):
        t.pull(keys, o, create=False)
        t.add(keys[:3], np.ones((3, DIM), np.float32), create=False)
        t.assign(np.array([21, 99], np.int64), np.full((2, DIM), 0.25, np.float32))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not outs[1][[1, 4]].any()
    np.testing.assert_array_equal(ref.has_rows(keys), tier.has_rows(keys))
    assert_equal_tables(ref, tier)
    assert (tier.rows_of(keys) >= -1).all()


def test_admission_equal_in_memory(tmp_path):
    ref, tier = pair(tmp_path, cap_rows=2)
    a, b = AdmittedTable(ref, "count:2", 5), AdmittedTable(tier, "count:2", 5)
    rng = np.random.default_rng(3)
    for i in range(60):
        step((a, b), rng, POOL)
        if i % 13 == 12:
            assert a.shrink(1) == b.shrink(1)
    assert a.admitted == b.admitted and a.waiting() == b.waiting()
    assert_equal_tables(ref, tier)
    assert_equal_tables(a.counts, b.counts)


def _dense(size=P):
    return DenseTable(np.arange(size, dtype=np.float32), OPTS[0])


def _h5_rows(path):
    """A checkpoint's sparse datasets, rows ordered by id (the tier writes another order)."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".h5"):
            with h5py.File(os.path.join(path, name), "r") as f:
                data = {k: f["sparse"][k][()] for k in f["sparse"]}
            order = np.argsort(data["keys"])
            for k, v in data.items():
                out.setdefault(k, []).append(v if k == "evicted" else v[order])
    return {k: np.concatenate(v) for k, v in out.items()}


def test_saves_and_loads_equal_in_memory(tmp_path):
    """base, then training with shrinks, delta, delta: each file equals the in-memory
    table's (rows by id), and the chain loads equally into either kind of table."""
    ref, tier = pair(tmp_path, cap_rows=3)
    rng = np.random.default_rng(4)
    roots = [str(tmp_path / "ref"), str(tmp_path / "tier-ckpt")]
    paths = {0: [], 1: []}
    for mode in ("base", "delta", "delta", "full"):
        for i in range(25):
            step((ref, tier), rng, POOL)
            if i % 9 == 8:
                ref.shrink(1), tier.shrink(1)
        for j, t in enumerate((ref, tier)):
            paths[j].append(ck.save_local(roots[j], t, _dense(), mode))
        a, b = _h5_rows(paths[0][-1]), _h5_rows(paths[1][-1])
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{mode} {k}")
        assert tier.count_rows(True) == ref.count_rows(True)
        assert (tier.count_rows(True) > 0) == (mode == "full")    # a full save clears nothing
    # the last delta's chain (base + 2 deltas) into memory, into a tier, into 2 servers
    chain = paths[0][2]
    loaded = SparseTable(DIM, OPTS[0], seed=7, init_range=0.1)
    ck.load_local(chain, loaded, _dense())
    r2, t2 = pair(tmp_path / "load", cap_rows=2)
    ck.load_local(paths[1][2], t2, _dense())
    assert t2.store.count > 0
    assert_equal_tables(loaded, t2)
    t3 = pair(tmp_path / "full", cap_rows=2)[1]
    ck.load_local(paths[1][3], t3, _dense())             # the tier's full save
    assert_equal_tables(ref, t3, skip=("dirty",))
    # training goes on equally from the loaded tier
    ck.load_local(chain, r2, _dense())
    for _ in range(10):
        step((r2, t2), rng, POOL)
    assert_equal_tables(r2, t2)


@pytest.mark.parametrize("n_servers", [2, 3])
def test_reshard_into_tiers(tmp_path, n_servers):
    ref, tier = pair(tmp_path, cap_rows=3)
    rng = np.random.default_rng(5)
    for _ in range(40):
        step((ref, tier), rng, POOL)
    path = ck.save_local(str(tmp_path / "c"), tier, _dense(), "full")
    bounds = np.linspace(0, P, n_servers + 1).astype(int)
    total = 0
    for s in range(n_servers):
        mem, til = pair(tmp_path / f"s{s}", cap_rows=2)
        dm, dt = (DenseTable(np.zeros(bounds[s + 1] - bounds[s], np.float32), OPTS[0])
                  for _ in range(2))
        ck.load_shard_into(path, mem, dm, s, n_servers, bounds)
        ck.load_shard_into(path, til, dt, s, n_servers, bounds)
        assert_equal_tables(mem, til)
        total += len(til)
    assert total == len(ref)


def test_store_rows_round_trip_and_scan(tmp_path):
    """The store against a dict: put, get (found and not), delete, scan in id order."""
    t = SparseTable(DIM, OPTS[0], seed=1)
    store = RowStore(str(tmp_path), t.export_rows(np.empty(0, np.int64)), map_budget=20000)
    rng = np.random.default_rng(6)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 300, dtype=np.int64))
    out = np.empty((len(keys), DIM), np.float32)
    t.pull(keys, out, create=True)
    rows = t.export_rows()
    store.write(put=rows)
    ref = {int(k): i for i, k in enumerate(rows["keys"])}
    gone = keys[::3]
    store.write(delete=gone)
    for g in gone:
        del ref[int(g)]
    ask = np.concatenate([keys[:50], np.array([12345], np.int64)])
    found, got = store.get(ask)
    np.testing.assert_array_equal(found, [int(k) in ref for k in ask])
    np.testing.assert_array_equal(store.contains(ask), found)
    idx = [ref[int(k)] for k in got["keys"]]
    for f in rows:
        np.testing.assert_array_equal(got[f], rows[f][idx])
    scanned = np.concatenate([c["keys"] for c in store.scan(7)])
    np.testing.assert_array_equal(scanned, np.sort(np.array(list(ref), np.int64)))
    assert store.count == len(ref) and store.reopens >= 3   # the map was dropped, rows kept
    with pytest.raises(OSError, match="were not stored"):
        store.write(delete=gone[:2])
    store.close()


def test_id_filter_against_a_set(tmp_path):
    """The filter of ids on disk against a Python set: never False for an id added (a
    false no would lose a row), rarely True for another (~0.5% by design, < 2% here);
    parts grow by doubling; past its limit it gives up (every id a maybe); and the store
    looks up in LMDB only the filter's maybes."""
    rng = np.random.default_rng(11)
    f, added = IdFilter(first=1000), set()
    for _ in range(30):
        batch = np.unique(rng.integers(-2**63, 2**63 - 1, rng.integers(1, 2000), dtype=np.int64))
        f.add(batch)
        added.update(batch.tolist())
        every = np.array(sorted(added), np.int64)
        assert f.maybe(every).all()
    others = rng.integers(-2**63, 2**63 - 1, 100_000, dtype=np.int64)
    others = others[~np.isin(others, every)]
    false = f.maybe(others).mean()
    assert false < 0.02, false
    assert len(f.parts) >= 4 and f.ids <= len(added)
    assert [p.size for p in f.parts] == [f.parts[0].size * 2 ** i for i in range(len(f.parts))]
    f.add(every)                                    # again: no room taken
    assert f.ids <= len(added)
    small = IdFilter(first=1000, limit=4000)
    small.add(every[:900])
    assert small.maybe(every[:900]).all() and not small.full
    small.add(every[900:5000])
    assert small.full and small.nbytes == 0 and small.maybe(others[:10]).all()

    t = SparseTable(DIM, OPTS[0], seed=1)
    store = RowStore(str(tmp_path), t.export_rows(np.empty(0, np.int64)), first_ids=500)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 300, dtype=np.int64))
    t.pull(keys, np.empty((len(keys), DIM), np.float32), create=True)
    store.write(put=t.export_rows())
    ask = np.concatenate([keys[:10], others[:2000]])
    found, got = store.get(ask)
    np.testing.assert_array_equal(found, np.arange(len(ask)) < 10)
    np.testing.assert_array_equal(got["keys"], keys[:10])
    assert 10 <= store.looked_up <= 10 + 60, store.looked_up
    np.testing.assert_array_equal(store.contains(ask), found)
    store.close()


def test_subsequence_mask_against_isin():
    """The multi-get's found mask (``subsequence_mask``) against numpy's isin; a list of
    found keys that is not a subsequence (out of order, or an id not asked) is caught."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 500):
        keys = rng.permutation(np.arange(n, dtype=np.int64) * 7919 - 3000)
        sub = keys[rng.random(n) < 0.4]
        out = np.empty(n, np.bool_)
        assert subsequence_mask(keys, sub, out) == len(sub)
        np.testing.assert_array_equal(out, np.isin(keys, sub))
        if len(sub) > 1:
            assert subsequence_mask(keys, sub[::-1], out) < len(sub)
        assert subsequence_mask(keys, np.array([10**12], np.int64), out) == 0


def map_rss(path):
    """Bytes of ``path``'s mapping resident in this process (/proc/self/smaps' Rss)."""
    path, rss, ours = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if "-" in line.split(" ", 1)[0]:            # a mapping's header line
                ours = line.rstrip("\n").endswith(" " + path)
            elif ours and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc")
def test_store_map_dropped_within_its_budget(tmp_path):
    """The map's pages resident in the process (smaps, not the store's own measure) stay
    within ``map_budget`` plus one transaction's pages, by madvise, with the rows kept."""
    t = SparseTable(DIM, OPTS[0], seed=1)
    store = RowStore(str(tmp_path), t.export_rows(np.empty(0, np.int64)), map_budget=1 << 18)
    keys = np.arange(20000, dtype=np.int64) * 7919
    t.pull(keys, np.empty((len(keys), DIM), np.float32), create=True)
    rows = t.export_rows()
    data = os.path.join(store.path, "data.mdb")
    peak = 0
    for lo in range(0, len(keys), 2000):
        store.write(put={f: a[lo:lo + 2000] for f, a in rows.items()})
        peak = max(peak, map_rss(data))
    for lo in range(0, len(keys), 3000):
        found, got = store.get(keys[lo:lo + 3000][::-1])
        assert found.all()
        np.testing.assert_array_equal(got["values"], rows["values"][lo:lo + 3000][::-1])
        peak = max(peak, map_rss(data))
    assert store.reopens >= 5 and store._addr            # dropped by madvise, not reopened
    assert peak <= store.map_budget + 64 * store.txn_rows * 4096, peak
    store.close()


def test_store_folders_fresh_removed_and_unwritable_refused(tmp_path):
    t = SparseTable(DIM, OPTS[0], seed=1)
    tpl = t.export_rows(np.empty(0, np.int64))
    stale = tmp_path / "mpips-tier-r0-old"
    stale.mkdir()                                 # a folder another run left
    a, b = RowStore(str(tmp_path), tpl, "r0"), RowStore(str(tmp_path), tpl, "r0")
    assert len({a.path, b.path, str(stale)}) == 3 and a.count == b.count == 0
    a.close()
    assert not os.path.exists(a.path) and os.path.exists(b.path)
    b.close()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="not a writable directory"):
        check_dir(str(blocker / "sub"))


def test_killed_runs_folders_swept_live_ones_kept(tmp_path):
    """A folder whose owner.lock nobody holds (its process was killed) is removed by the
    next store; a live store's folder, and a folder without a lock file, are kept."""
    tpl = SparseTable(DIM, OPTS[0], seed=1).export_rows(np.empty(0, np.int64))
    live = RowStore(str(tmp_path), tpl, "live")
    dead = RowStore(str(tmp_path), tpl, "dead")
    os.close(dead._lock)             # as a SIGKILL would: the kernel drops the process's lock
    dead._lock, dead = None, tmp_path / os.path.basename(dead.path)
    assert (dead / "data.mdb").exists()
    other = tmp_path / "mpips-tier-nolock-x"
    other.mkdir()
    new = RowStore(str(tmp_path), tpl, "new")
    assert new.swept == [str(dead)] and not dead.exists()
    assert os.path.exists(live.path) and other.exists()
    live.close(), new.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpips-tier-nolock-x"]


def test_a_sweep_while_a_store_is_made_leaves_it_alone(tmp_path, monkeypatch):
    """Two servers of one node start their stores at once under one --table-dir: one's
    sweep runs in the moment the other's folder exists but its lock is not yet taken.  The
    folder must not be taken for a killed run's (it was: the owner's flock failed with
    EAGAIN and the folder was removed, on an 8M-row 2x2 run)."""
    from mpips.tables import disk
    tpl = SparseTable(DIM, OPTS[0], seed=1).export_rows(np.empty(0, np.int64))
    real, seen = disk.fcntl.flock, []

    def flock(fd, op):          # the owner's first flock: another process sweeps just before
        if not seen:
            seen.append(None)
            seen.append(disk.sweep(str(tmp_path)))
        return real(fd, op)
    monkeypatch.setattr(disk.fcntl, "flock", flock)
    store = RowStore(str(tmp_path), tpl, "rank1")
    monkeypatch.setattr(disk.fcntl, "flock", real)
    assert seen == [None, []]                   # the sweep saw no folder to remove
    assert os.path.basename(store.path).startswith(disk.PREFIX + "rank1-")
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(store.path)]
    assert disk.sweep(str(tmp_path)) == []      # held: a live store
    t = SparseTable(DIM, OPTS[0], seed=1)
    t.pull(np.arange(5, dtype=np.int64), np.empty((5, DIM), np.float32), create=True)
    store.write(put=t.export_rows())
    found, got = store.get(np.arange(5, dtype=np.int64))
    assert found.all()
    np.testing.assert_array_equal(got["keys"], np.arange(5))
    store.close()
    assert os.listdir(tmp_path) == []


def _filled_store(tmp_path, n=2000):
    t = SparseTable(DIM, OPTS[0], seed=1)
    t.pull(np.arange(n, dtype=np.int64), np.empty((n, DIM), np.float32), create=True)
    return RowStore(str(tmp_path), t.export_rows(np.empty(0, np.int64))), t.export_rows()


def test_full_disk_is_one_line_and_keeps_the_rows(tmp_path, monkeypatch):
    """The data file's blocks are allocated before a write; ENOSPC there is one line."""
    store, rows = _filled_store(tmp_path)
    half = {f: a[:1000] for f, a in rows.items()}
    store.write(put=half)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    store._allocated = 0                     # the next write must allocate
    with pytest.raises(OSError, match=r"could not grow .*No space left.*--table-dir") as e:
        store.write(put={f: a[1000:] for f, a in rows.items()})
    assert "\n" not in str(e.value) and store.count == 1000
    found, got = store.get(rows["keys"][:1000])
    assert found.all()
    np.testing.assert_array_equal(got["values"], rows["values"][:1000])
    store.close()


def test_engine_error_is_one_line(tmp_path, monkeypatch):
    import mpips.tables.disk as disk
    monkeypatch.setattr(disk, "MAP_SIZE", 1 << 17)           # a map of 32 pages
    store, rows = _filled_store(tmp_path)
    with pytest.raises(OSError, match="the disk tier failed writing rows .*MapFull"):
        store.write(put=rows)
    store.close()
