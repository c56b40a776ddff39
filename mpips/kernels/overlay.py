"""Numba kernels of the serving table: a read-only base hash map under a small overlay.

Both maps use the layout of :mod:`mpips.kernels.hashmap` (int32 ``slots``, -1 empty,
linear probing from ``splitmix64(key ^ SLOT_SALT)``) over plain arrays.  The overlay holds
the ids changed since the base was built: a live row (new values) or a dead one (the id
was evicted).  An id is read from the overlay when it is there, else from the base; a
dead id or an id in neither reads zeros.  All kernels release the GIL.
"""
import numpy as np
from numba import njit

from mpips.kernels.hashmap import _home_slot


@njit(cache=True, nogil=True, inline='always')
def _find(slots, keys, key):
    """Row of ``key`` in one map, or -1."""
    mask = np.uint64(slots.shape[0] - 1)
    s = _home_slot(key, mask)
    while True:
        cand = slots[s]
        if cand < 0:
            return np.int64(-1)
        if keys[cand] == key:
            return np.int64(cand)
        s = (s + 1) & np.int64(mask)


@njit(cache=True, nogil=True)
def gather(slots, keys, values, ov_slots, ov_keys, ov_values, ov_dead, ids, out):
    """``out[i]`` = the row of ``ids[i]``: the overlay's if it holds the id (zeros when dead),
    else the base's, else zeros.

    slots int32 (S,), keys int64 (n,), values float32 (n, dim): the base;
    ov_slots, ov_keys (m,), ov_values (m, dim), ov_dead uint8 (m,): the overlay;
    ids int64 (k,); out float32 (k, dim).
    """
    dim = out.shape[1]
    for i in range(ids.shape[0]):
        key = ids[i]
        r = _find(ov_slots, ov_keys, key)
        if r >= 0:
            if ov_dead[r]:
                for j in range(dim):
                    out[i, j] = 0.0
            else:
                for j in range(dim):
                    out[i, j] = ov_values[r, j]
            continue
        r = _find(slots, keys, key)
        if r >= 0:
            for j in range(dim):
                out[i, j] = values[r, j]
        else:
            for j in range(dim):
                out[i, j] = 0.0


@njit(cache=True, nogil=True)
def fold(slots, keys, values, ov_keys, ov_values, ov_dead, out_keys, out_values):
    """Write the table base + overlay as one set of rows: the base rows the overlay does
    not hold (in order), then the overlay's live rows (in order).  ``out_*`` hold exactly
    that many rows; returns the number written."""
    keep = np.ones(keys.shape[0], np.bool_)
    for i in range(ov_keys.shape[0]):
        r = _find(slots, keys, ov_keys[i])
        if r >= 0:
            keep[r] = False
    w = 0
    dim = values.shape[1]
    for r in range(keys.shape[0]):
        if keep[r]:
            out_keys[w] = keys[r]
            for j in range(dim):
                out_values[w, j] = values[r, j]
            w += 1
    for i in range(ov_keys.shape[0]):
        if not ov_dead[i]:
            out_keys[w] = ov_keys[i]
            for j in range(dim):
                out_values[w, j] = ov_values[i, j]
            w += 1
    return w
