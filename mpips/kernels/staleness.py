"""Numba kernel of the staleness count of a push (see :mod:`mpips.tables.staleness`)."""
import numpy as np
from numba import njit

WRAP = 0xFFFFFFFF       # versions are uint32: differences modulo 2**32


@njit(cache=True, nogil=True)
def count_push(version, rows, then, hit, stale, hist, acc):
    """Staleness of each pushed row, counted, then one more update of each row.

    Parameters
    ----------
    version : uint32 (R,)    in/out, updates applied to each table row (wrapping)
    rows : int64 (n,)        table row of each pushed key; -1: no row (not counted, kept)
    then : uint32 (n,)       each row's version at the worker's pull (read where hit)
    hit : bool (n,) or (0,)  which keys the pull recorded; length 0 = all of them
    stale : int64 (n,)       out, version[row] - then (0 where not hit or no row)
    hist : int64 (B,)        in/out, += 1 at min(staleness, B - 1) for each hit row
    acc : int64 (3,)         in/out, [0] += rows counted, [1] += their staleness,
                             [2] = max(acc[2], largest staleness)

    Returns
    -------
    None
    """
    top = hist.shape[0] - 1
    every = hit.shape[0] == 0
    for i in range(rows.shape[0]):
        r = rows[i]
        stale[i] = 0
        if r < 0:
            continue
        cur = version[r]
        if every or hit[i]:
            d = (np.int64(cur) - np.int64(then[i])) & WRAP
            stale[i] = d
            hist[min(d, top)] += 1
            acc[0] += 1
            acc[1] += d
            if d > acc[2]:
                acc[2] = d
        version[r] = np.uint32((np.int64(cur) + 1) & WRAP)
