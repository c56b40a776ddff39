"""The serving table (base + overlay, mpips/serving/table.py) against a plain dict.

A chain of patches (rows changed, ids evicted, evicted ids coming back, an id evicted and
rewritten in one patch, evictions of ids never seen) is applied to a Table, with folds
forced small and never, and the table is read back by ``gather`` and ``rows``: each must
equal a dict {id: row} that the same patches were applied to, and ``bundle.merge_rows``
(the checkpoint's fold) applied to the same chain.  An older Table is unchanged by the
patches made from it.
"""
import numpy as np
import pytest

import mpips.serving.bundle as bd
from mpips.serving.table import Table

DIM = 3


def patch_of(rng, universe, ref):
    """(new keys, new values, evicted) touching ids in and out of ``ref``."""
    live = np.array(sorted(ref), np.int64)
    pick = rng.random(len(universe))
    new = universe[pick < 0.08]
    evicted = universe[pick > 0.93]
    if len(live):
        evicted = np.concatenate([evicted, rng.choice(live, min(5, len(live)))])
    both = new[:3]                          # evicted and rewritten in one patch: keeps the row
    evicted = np.concatenate([evicted, both])
    values = rng.normal(size=(len(new), DIM)).astype(np.float32)
    return new, values, evicted


def apply_ref(ref, new, values, evicted):
    for k in evicted.tolist():
        ref.pop(k, None)
    for k, v in zip(new.tolist(), values):
        ref[k] = v


def check(table, ref, probe):
    out = table.gather(probe, np.full((len(probe), DIM), 7.0, np.float32))
    want = np.array([ref.get(k, np.zeros(DIM, np.float32)) for k in probe.tolist()],
                    np.float32).reshape(-1, DIM)
    assert np.array_equal(out, want)
    assert len(table) == len(ref)
    keys, values = table.rows()
    assert len(keys) == len(ref) == len(np.unique(keys))
    assert np.array_equal(values, np.array([ref[k] for k in keys.tolist()],
                                           np.float32).reshape(-1, DIM))


@pytest.mark.parametrize("fold_min,fold_fraction", [(10 ** 9, 1.0), (0, 0.0), (150, 0.2)])
def test_patches_equal_a_dict_and_merge_rows(fold_min, fold_fraction):
    rng = np.random.default_rng(5)
    universe = np.unique(rng.integers(-2 ** 62, 2 ** 62, 700))[:600]
    rng.shuffle(universe)
    base = universe[:300]
    values = rng.normal(size=(300, DIM)).astype(np.float32)
    ref = dict(zip(base.tolist(), values))
    table = Table(base, values)
    keys_m, values_m = base, values
    probe = np.concatenate([universe, universe[:50], [0, -1]])   # duplicates, never-seen ids
    history = [(table, dict(ref))]
    folded = 0
    for _ in range(12):
        new, vals, evicted = patch_of(rng, universe, ref)
        apply_ref(ref, new, vals, evicted)
        table = table.patched(new, vals, evicted, fold_fraction=fold_fraction, fold_min=fold_min)
        folded += len(table.ov_keys) == 0
        keys_m, values_m = bd.merge_rows(keys_m, values_m, new, vals, evicted)
        check(table, ref, probe)
        k, v = table.rows()
        order, order_m = np.argsort(k), np.argsort(keys_m)
        assert np.array_equal(k[order], keys_m[order_m])
        assert np.array_equal(v[order], values_m[order_m])
        history.append((table, dict(ref)))
    for old, old_ref in history:                   # versions made before are untouched
        check(old, old_ref, probe)
    if fold_min == 0:
        assert folded == 12                        # every patch folded
    elif fold_min == 10 ** 9:
        assert folded == 0 and len(table.keys) == 300   # the base is never rebuilt
    else:
        assert 0 < folded < 12


def test_a_patch_copies_the_overlay_not_the_base():
    """Patching shares the base arrays: the cost is the overlay's."""
    rng = np.random.default_rng(1)
    keys = np.arange(0, 200_000, dtype=np.int64) * 3
    table = Table(keys, rng.normal(size=(len(keys), DIM)).astype(np.float32))
    t2 = table.patched(keys[:10], np.ones((10, DIM), np.float32), keys[10:15])
    assert t2.keys is table.keys and t2.values is table.values and t2.slots is table.slots
    assert len(t2.ov_keys) == 15 and len(t2) == len(keys) - 5
    got = t2.gather(keys[:20], np.empty((20, DIM), np.float32))
    assert np.array_equal(got[:10], np.ones((10, DIM)))
    assert not got[10:15].any()
    assert np.array_equal(got[15:], table.values[15:20])
    # evicting ids the table does not hold adds nothing to the overlay
    t3 = t2.patched(np.empty(0, np.int64), np.empty((0, DIM), np.float32),
                    np.array([1, 2, 4], np.int64))
    assert len(t3.ov_keys) == 15 and len(t3) == len(t2)


def test_versions_travel_to_a_process_through_shared_memory(tmp_path):
    """``shared.Pool.share`` moves a version into memfd segments (a patch: a new top segment
    over the same base; a fold: a new base) and ``Child.receive`` maps what was sent: the
    scores are those of the private model it came from."""
    import json
    import socket
    import types

    from mpips.serving import Predictor, shared
    from mpips.serving.live import Serving
    from tests import serve_models as sm
    lines = sm.criteo_lines(150, seed=3)
    data, schema = sm.criteo_data(), sm.criteo_schema()
    keys = sm.ids_of(lines, schema, data)
    m = sm.write_full(str(tmp_path / "b.h5"), keys, schema, data)
    sm.write_patch(str(tmp_path / "p.h5"), m, keys, seed=2, seq=2)
    ref = Predictor(str(tmp_path / "b.h5"))
    pool = shared.Pool(None, print)
    first = pool.share(ref.model)
    assert np.array_equal(Predictor(model=first).predict_lines(lines), ref.predict_lines(lines))
    live = types.SimpleNamespace(current=Serving(first))
    t = first.table
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = shared.Child(0, None, theirs, (pool.base[0], {k: getattr(t, k) for k in
                                                          ("keys", "values", "slots")}))

    def send_and_receive(model):
        pool.share(model)
        meta, fds = pool.message
        socket.send_fds(ours, [json.dumps({**meta, "reload": [True, 0.5]}).encode()], fds)
        new, reload = child.receive(live, None)
        assert reload == [True, 0.5]
        live.current = new
        return new
    running = Predictor(model=first)              # patched in shared memory, as the master does
    running.apply(str(tmp_path / "p.h5"))
    ref.apply(str(tmp_path / "p.h5"))             # ... and privately
    new = send_and_receive(running.model)
    assert pool.base[0] == 1 and new.model.table.keys is t.keys   # the same base segment
    assert len(new.model.table.ov_keys) > 0 and new.version == "ckpt-000002-delta"
    assert np.array_equal(new.lines.predict_lines(lines), ref.predict_lines(lines))
    folded = running.model.with_table(running.model.table.folded())
    new = send_and_receive(folded)
    assert pool.base[0] == 2 and len(new.model.table.ov_keys) == 0   # a new base segment
    assert np.array_equal(new.lines.predict_lines(lines), ref.predict_lines(lines))
    ours.close()
    assert child.receive(live, None) == (None, None)                  # the master's end
