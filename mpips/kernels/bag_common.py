"""Numba pieces shared by the bag readers (slot, MultiSlot and CSV text -> CSR batches).

A bag reader writes one row per valid line: dense values (raw float64, NaN where a value
is missing; ``mpips.data.formats`` normalises and fills them), the label, and the ids of
the row's bags, example-major.  While a line is scanned its ids are collected with their
slot in the order they appear (``tmp_slot``, ``tmp_id``); ``emit_bags`` then places them slot
by slot (a stable counting sort: a bag keeps the order of its tokens), keeps the first
``max_len`` of each bag and writes the row's offsets.

Names (slot keys of slot/MultiSlot lines, CSV header columns) are looked up in a small
open-addressing table built by ``mpips.data.formats.key_table``: FNV-1a 64 of the name's
bytes, ``tab`` of power-of-two size holding key indices (-1 empty), names verified bytewise.

Bad-line reason codes of the bag readers are the ``BAD_*`` below (the detail in brackets;
``mpips.data.formats.describe_bad`` words them); 1..9 are ``mpips.data.criteo``'s.
"""
import numpy as np
from numba import njit

from mpips.kernels.tsv_parse import (BAD_CAPACITY, CNT_TRUNCATED, FNV1A_OFFSET, FNV1A_PRIME,
                                     splitmix64_finalise)

BAD_TOKEN = 10  # a token without ':' [token index, 0-based]
BAD_VALUE = 11  # a value that does not parse [input key index]
BAD_DENSE_DIM = 12  # a dense slot seen neither 0 nor dim times [key index]
BAD_NO_LABEL = 13  # the label is missing or given twice [times seen + (label index << 32)]
BAD_COLUMNS = 14  # csv: not as many columns as the header [columns found]
BAD_QUOTE = 15  # csv: a quote that does not close, or text after a closing quote [column]
BAD_COUNT = 16  # multislot: a count missing, not an integer, or past the line [field index]
BAD_EXTRA = 17  # multislot: tokens after the last field [tokens left]

KIND_LABEL = 0  # kinfo[k, 0]: what key k is
KIND_DENSE = 1  # kinfo[k, 1] = first dense position, kinfo[k, 2] = dim
KIND_SPARSE = 2  # kinfo[k, 1] = slot index
KIND_SKIP = 3  # a name the schema does not use (csv columns, multislot fields)

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True)
def name_hash(buf, s, e):
    """FNV-1a 64 of ``buf[s:e]`` (the key table's hash)."""
    h = FNV1A_OFFSET
    for i in range(s, e):
        h = (h ^ np.uint64(buf[i])) * FNV1A_PRIME
    return h


@njit(cache=True, nogil=True)
def find_key(buf, s, e, kbytes, koff, tab):
    """Index of the name ``buf[s:e]`` in the key table, or -1."""
    mask = np.uint64(tab.shape[0] - 1)
    j = name_hash(buf, s, e) & mask
    while True:
        k = tab[j]
        if k < 0:
            return -1
        a, b = koff[k], koff[k + 1]
        if b - a == e - s:
            same = True
            for t in range(b - a):
                if kbytes[a + t] != buf[s + t]:
                    same = False
                    break
            if same:
                return k
        j = (j + np.uint64(1)) & mask


@njit(cache=True, nogil=True)
def is_token(buf, s, e, tbytes, toff):
    """Is ``buf[s:e]`` one of the tokens ``tbytes[toff[k]:toff[k + 1]]`` (null tokens)?"""
    for k in range(toff.shape[0] - 1):
        a, b = toff[k], toff[k + 1]
        if b - a != e - s:
            continue
        same = True
        for t in range(b - a):
            if tbytes[a + t] != buf[s + t]:
                same = False
                break
        if same:
            return True
    return False


@njit(cache=True, nogil=True, inline="always")
def feasign_id(u, salt, opts_bucket, raw_ids):
    """Id of integer feasign ``u`` (uint64) of a slot with ``salt`` (see mpips.data.slot)."""
    if opts_bucket > 0:
        return np.int64(u % np.uint64(opts_bucket))
    if raw_ids:
        return np.int64(u)
    return np.int64(splitmix64_finalise(u + salt * GOLDEN))


@njit(cache=True, nogil=True, inline="always")
def text_id(h, bucket):
    """Id of an unfinalised FNV-1a state ``h`` of a text value (Criteo's hash)."""
    z = splitmix64_finalise(h)
    if bucket > 0:
        return np.int64(z % np.uint64(bucket))
    return np.int64(z)


@njit(cache=True, nogil=True)
def emit_bags(k, tmp_slot, tmp_id, max_len, cur, lim, r, ids, offsets):
    """Place the k collected (slot, id) pairs of row r into ``ids`` by slot.

    ``offsets[r*S]`` is where row r starts; writes ``offsets[r*S + 1 .. (r+1)*S]``.
    ``cur``/``lim`` are (S,) int64 scratch.  Returns the number of bags truncated to their
    ``max_len`` (0 = keep all; N > 0 keeps the first N ids of a slot, -N the last N), or
    -1 when ``ids`` has no room (the caller's sizing bug).
    """
    S = max_len.shape[0]
    for s in range(S):
        cur[s] = 0
    for j in range(k):
        cur[tmp_slot[j]] += 1
    start = offsets[r * S]
    pos = start
    trunc = 0
    for s in range(S):
        c = cur[s]
        keep = max_len[s] if max_len[s] >= 0 else -max_len[s]
        cur[s] = pos
        if keep > 0 and c > keep:
            trunc += 1
            if max_len[s] < 0:           # keep the last N: skip the first c - N
                cur[s] = pos - (c - keep)
            c = keep
        pos += c
        lim[s] = pos
    if pos > ids.shape[0]:
        return -1
    for j in range(k):
        s = tmp_slot[j]
        c = cur[s]
        if c < lim[s]:
            if c >= (lim[s - 1] if s > 0 else start):
                ids[c] = tmp_id[j]
            cur[s] = c + 1
    for s in range(S):
        offsets[r * S + s + 1] = lim[s]
    return trunc


@njit(cache=True, nogil=True)
def record_bad(bad, nb, line, reason, detail):
    """Write bad-line record nb (if there is room); returns nb + 1."""
    if nb < bad.shape[0]:
        bad[nb, 0] = line
        bad[nb, 1] = reason
        bad[nb, 2] = detail
    return nb + 1


@njit(cache=True, nogil=True, inline="always")
def end_line(reason, detail, trunc, r, line, counts, bad, nb):
    """Account for one line of a bag kernel: (rows, bad records).

    reason 0: a row whose bags were emitted with ``trunc`` cut (``trunc < 0``: no room, a
    BAD_CAPACITY line); reason > 0: a bad line, recorded; -1: a blank line."""
    if reason == 0 and trunc < 0:
        reason, detail = BAD_CAPACITY, 0
    if reason == 0:
        counts[CNT_TRUNCATED] += trunc
        r += 1
    if reason > 0:
        nb = record_bad(bad, nb, line, reason, detail)
    return r, nb
