"""Numba kernels for the sparse table's open-addressing hash map and row init.

Layout (owned by :class:`mpips.tables.sparse.SparseTable`):

* ``slots``    int32 (S,), S a power of two; ``-1`` marks an empty slot, any other
  value is a row index. Ids span the whole int64 range, so there is no sentinel key.
* ``row_keys`` int64 (R,); rows ``0 .. n_rows-1`` are live and stored contiguously,
  new rows are appended at ``n_rows``.

Row columns (``row_keys``, ``values``, metadata) may be plain arrays or paged columns
(:mod:`mpips.kernels.pages`); the kernels read them through ``row`` / ``at`` / ``put``.

A key's home slot is ``splitmix64(key ^ SLOT_SALT) & (S - 1)``; collisions probe
linearly. Rows are never deleted in place: eviction rebuilds the arrays, so there are
no tombstones.
"""
import numpy as np
from numba import njit

from mpips.kernels.pages import AHEAD, at, prefetch, put, row

# splitmix64 constants (Steele, Lea & Flood 2014; Vigna's reference implementation).
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
# Salts keep the three uses of the mixer independent of each other.
SLOT_SALT = np.uint64(0x2545F4914F6CDD1D)   # table slot hash
INIT_SALT = np.uint64(0x5851F42D4C957F2D)   # row init stream
OWNER_SALT = np.uint64(0xD6E8FEB86659FD93)  # id -> server (embedding.owner_of)
BLOOM_SALT = np.uint64(0x9FB21C651E98DF25)  # the disk tier's filter of ids on disk
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S40 = np.uint64(40)
_INV_2_24 = 1.0 / 16777216.0
RING = 32                 # lookup_rows' ring of home slots: a power of two above 2 AHEAD
assert RING > 2 * AHEAD and RING & (RING - 1) == 0


@njit(cache=True, nogil=True, inline='always')
def splitmix64(x):
    """Finaliser of splitmix64: a bijective 64-bit mixer.

    Parameters
    ----------
    x : uint64

    Returns
    -------
    uint64
    """
    z = x + GOLDEN
    z = (z ^ (z >> _S30)) * MIX1
    z = (z ^ (z >> _S27)) * MIX2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True, inline='always')
def _home_slot(key, mask):
    return np.int64(splitmix64(np.uint64(key) ^ SLOT_SALT) & mask)


@njit(cache=True, nogil=True)
def lookup_rows(slots, row_keys, keys, rows_out):
    """Find the row of each key.

    Parameters
    ----------
    slots : int32 (S,)          slot -> row index, -1 empty; S a power of two
    row_keys : int64 (R,)       row -> key
    keys : int64 (n,)           keys to look up (any order, duplicates allowed)
    rows_out : int64 (n,)       out: row index, or -1 when the key has no row

    Returns
    -------
    int : number of keys found
    """
    mask = np.uint64(slots.shape[0] - 1)
    found = 0
    n = keys.shape[0]
    # the home slots of keys i .. i + 2 AHEAD, each hashed once (RING > 2 AHEAD, a power of 2)
    home = np.empty(RING, np.int64)
    for j in range(min(2 * AHEAD, n)):
        home[j] = _home_slot(keys[j], mask)
    for i in range(n):
        # two stages ahead: the home slot of key i + 2 AHEAD, then the key record its
        # slot names for key i + AHEAD (in cache by then), so misses overlap
        if i + 2 * AHEAD < n:
            h = _home_slot(keys[i + 2 * AHEAD], mask)
            home[(i + 2 * AHEAD) & (RING - 1)] = h
            prefetch(slots, h)
        if i + AHEAD < n:
            ahead = slots[home[(i + AHEAD) & (RING - 1)]]
            if ahead >= 0:
                prefetch(row_keys, ahead)
        key = keys[i]
        s = home[i & (RING - 1)]
        r = np.int64(-1)
        while True:
            cand = slots[s]
            if cand < 0:
                break
            if at(row_keys, cand) == key:
                r = np.int64(cand)
                found += 1
                break
            s = (s + 1) & np.int64(mask)
        rows_out[i] = r
    return found


@njit(cache=True, nogil=True)
def insert_missing(slots, row_keys, n_rows, keys, rows):
    """Give a row to every key whose ``rows[i]`` is -1; duplicates share one row.

    The caller guarantees room: ``row_keys`` can hold ``n_rows + (#rows < 0)`` rows
    and the slot array stays below full. New rows are appended in key order at
    ``n_rows, n_rows + 1, ...``; their values are left for the caller to initialise.

    Parameters
    ----------
    slots : int32 (S,)          in/out
    row_keys : int64 (R,)       in/out
    n_rows : int                live rows before the call
    keys : int64 (n,)
    rows : int64 (n,)           in/out: -1 entries are replaced by the (new) row index

    Returns
    -------
    int : live rows after the call
    """
    mask = np.uint64(slots.shape[0] - 1)
    for i in range(keys.shape[0]):
        if rows[i] >= 0:
            continue
        key = keys[i]
        s = _home_slot(key, mask)
        while True:
            cand = slots[s]
            if cand < 0:
                slots[s] = n_rows
                put(row_keys, n_rows, key)
                rows[i] = n_rows
                n_rows += 1
                break
            if at(row_keys, cand) == key:  # duplicate of a key inserted by this call
                rows[i] = cand
                break
            s = (s + 1) & np.int64(mask)
    return n_rows


@njit(cache=True, nogil=True)
def rebuild_slots(row_keys, n_rows, slots):
    """Fill ``slots`` (any power-of-two size > n_rows) from rows ``0 .. n_rows-1``.

    Parameters
    ----------
    row_keys : int64 (R,)       unique keys of the live rows
    n_rows : int
    slots : int32 (S,)          out: overwritten

    Returns
    -------
    None
    """
    slots[:] = -1
    mask = np.uint64(slots.shape[0] - 1)
    for r in range(n_rows):
        s = _home_slot(at(row_keys, r), mask)
        while slots[s] >= 0:
            s = (s + 1) & np.int64(mask)
        slots[s] = r


@njit(cache=True, nogil=True)
def init_rows(keys, seed, init_range, out):
    """Initial values of rows, a pure function of (seed, key, column).

    ``out[i, j] = init_range * (2 u - 1)`` with ``u = (h >> 40) / 2**24`` in [0, 1) and
    ``h = splitmix64(splitmix64(key ^ splitmix64(seed ^ INIT_SALT)) + j * GOLDEN)``,
    so a row's start does not depend on arrival order nor on which server holds it.
    Values lie in ``[-init_range, init_range)``; ``init_range == 0`` gives zeros.

    Parameters
    ----------
    keys : int64 (n,)
    seed : int                   non-negative, < 2**63
    init_range : float
    out : float32 (n, dim)       out

    Returns
    -------
    None
    """
    base = splitmix64(np.uint64(seed) ^ INIT_SALT)
    dim = out.shape[1]
    for i in range(keys.shape[0]):
        h0 = splitmix64(np.uint64(keys[i]) ^ base)
        for j in range(dim):
            h = splitmix64(h0 + np.uint64(j) * GOLDEN)
            u = np.float64(h >> _S40) * _INV_2_24
            out[i, j] = init_range * (2.0 * u - 1.0)


@njit(cache=True, nogil=True)
def read_rows(values, rows, out):
    """``out[i] = values[rows[i]]``, or zeros where ``rows[i] < 0``.

    Parameters
    ----------
    values : float32 (R, dim)
    rows : int64 (n,)
    out : float32 (n, dim)       out

    Returns
    -------
    None
    """
    dim = out.shape[1]
    n = rows.shape[0]
    for i in range(n):
        if i + AHEAD < n and rows[i + AHEAD] >= 0:
            prefetch(values, rows[i + AHEAD])
        r = rows[i]
        if r < 0:
            for j in range(dim):
                out[i, j] = 0.0
        else:
            w = row(values, r)
            for j in range(dim):
                out[i, j] = w[j]


@njit(cache=True, nogil=True)
def touch_rows(rows, seen_flag, seen_count, dirty, count, set_dirty):
    """Mark rows as seen since the last shrink; optionally count and dirty them.

    Parameters
    ----------
    rows : int64 (n,)            row indices (>= 0)
    seen_flag : uint8 (R,)       out: set to 1
    seen_count : uint32 (R,)     out: += 1 (saturating) when ``count``
    dirty : uint8 (R,)           out: set to 1 when ``set_dirty``
    count, set_dirty : bool

    Returns
    -------
    None
    """
    top = np.uint32(0xFFFFFFFF)
    for i in range(rows.shape[0]):
        r = rows[i]
        put(seen_flag, r, np.uint8(1))
        if count:
            c = at(seen_count, r)
            if c < top:
                put(seen_count, r, np.uint32(c + np.uint32(1)))
        if set_dirty:
            put(dirty, r, np.uint8(1))


@njit(cache=True, nogil=True)
def age_rows(unseen, seen_flag, n_rows, threshold, keep_out):
    """One shrink step: age rows, reset the seen ones, decide which rows stay.

    For each live row: if ``seen_flag`` is set, ``unseen = 0`` and the flag clears,
    else ``unseen += 1`` (saturating at 65535). ``keep_out[r] = unseen <= threshold``.

    Parameters
    ----------
    unseen : uint16 (R,)         in/out
    seen_flag : uint8 (R,)       in/out
    n_rows : int
    threshold : int
    keep_out : bool (>= n_rows,) out

    Returns
    -------
    int : number of rows kept
    """
    kept = 0
    for r in range(n_rows):
        u = at(unseen, r)
        if at(seen_flag, r):
            u = np.uint16(0)
            put(seen_flag, r, np.uint8(0))
        elif u < 65535:
            u = np.uint16(u + np.uint16(1))
        put(unseen, r, u)
        keep = np.int64(u) <= threshold
        keep_out[r] = keep
        kept += keep
    return kept


# A blocked Bloom filter (Putze, Sanders & Singler 2007): an id sets BLOOM_PROBES bits of
# one 512-bit block (8 uint64 words, one cache line), so a query costs one cache miss.
BLOOM_PROBES = 7
_S9 = np.uint64(9)
_M511 = np.uint64(511)
_M63 = np.uint64(63)
_S6 = np.uint64(6)
_ONE = np.uint64(1)


@njit(cache=True, nogil=True, inline='always')
def _bloom_hash(key, n_blocks):
    h = splitmix64(np.uint64(key) ^ BLOOM_SALT)
    return np.int64(h % np.uint64(n_blocks)) * 8, splitmix64(h)


@njit(cache=True, nogil=True)
def bloom_add(bits, keys):
    """Set the bits of ``keys`` (int64 (n,)) in the filter ``bits`` (uint64, 8 words a
    block)."""
    n_blocks = bits.shape[0] // 8
    for i in range(keys.shape[0]):
        base, h = _bloom_hash(keys[i], n_blocks)
        for _ in range(BLOOM_PROBES):
            b = h & _M511
            bits[base + np.int64(b >> _S6)] |= _ONE << (b & _M63)
            h = h >> _S9


@njit(cache=True, nogil=True)
def bloom_query(bits, keys, maybe):
    """``maybe[i] |= keys[i]`` may have been added to ``bits`` (False: it was not)."""
    n_blocks = bits.shape[0] // 8
    for i in range(keys.shape[0]):
        if maybe[i]:
            continue
        base, h = _bloom_hash(keys[i], n_blocks)
        hit = True
        for _ in range(BLOOM_PROBES):
            b = h & _M511
            if not bits[base + np.int64(b >> _S6)] & (_ONE << (b & _M63)):
                hit = False
                break
            h = h >> _S9
        maybe[i] = hit


@njit(cache=True, nogil=True)
def subsequence_mask(keys, sub, out):
    """``out[i]``: ``keys[i]`` is matched by ``sub``, a subsequence of ``keys`` (what a
    multi-get returns of the keys it found, in their order); returns how many of ``sub``
    were matched (``len(sub)`` when it is such a subsequence)."""
    j = 0
    for i in range(keys.shape[0]):
        hit = j < sub.shape[0] and keys[i] == sub[j]
        out[i] = hit
        j += hit
    return j
