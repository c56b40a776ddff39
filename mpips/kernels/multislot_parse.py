"""Numba kernel for MultiSlot lines, what Paddle's ``MultiSlotDataGenerator`` prints.

A line holds, for each name of the schema's ``fields`` in order, a count and then that
many values, all separated by ASCII whitespace (``13 0.05 0.006 ... 1 715353 1 817085 ...
1 0``).  Per field kind (``finfo[f] = kind, index, dim`` with ``bag_common.KIND_*``):

* label: count 1 and a float() that is 0 or 1;
* dense of ``dim`` values: count ``dim`` (float() values) or 0 (missing: NaN here, the
  group's fill later);
* sparse: any count of integer feasigns (Python ``int()`` in [0, 2**64)); 0 = an empty bag;
* a name the schema does not use (``KIND_SKIP``): its values are skipped unread.

A count that is missing or not an integer, values past the end of the line, or tokens
after the last field make the line bad (``bag_common.BAD_*``).
"""
import numpy as np
from numba import njit

from mpips.kernels.bag_common import (BAD_COUNT, BAD_DENSE_DIM, BAD_EXTRA, BAD_VALUE,
                                      KIND_DENSE, KIND_LABEL, KIND_SPARSE, emit_bags, end_line,
                                      feasign_id)
from mpips.kernels.number_parse import parse_float, parse_uint64
from mpips.kernels.slot_parse import IS_WS, _skip_line
from mpips.kernels.slot_bags import OPT_BUCKET, OPT_HAS_LABEL, OPT_RAW_IDS
from mpips.kernels.tsv_parse import BAD_CAPACITY, CNT_BAD, CNT_LINES, CNT_ROWS


@njit(cache=True, nogil=True, inline="always")
def _next_token(buf, i):
    """(start, end) of the next token at or after i on this line; start == end: none."""
    n = buf.shape[0]
    while i < n and buf[i] != 10 and IS_WS[buf[i]]:
        i += 1
    s = i
    while i < n and not IS_WS[buf[i]]:
        i += 1
    return s, i


@njit(cache=True, nogil=True)
def _field(buf, i, f, finfo, opts, salts, dense_row, label, r, tmp_slot, tmp_id, k):
    """Read field f's count and values at i: (next i, reason, ids collected so far)."""
    s, e = _next_token(buf, i)
    ok, cnt = parse_uint64(buf, s, e)
    if s == e or not ok or cnt > np.uint64(buf.shape[0]):
        return e, BAD_COUNT, k
    kind, at, dim = finfo[f, 0], finfo[f, 1], finfo[f, 2]
    c = np.int64(cnt)
    if kind == KIND_DENSE and c != 0 and c != dim:
        return e, BAD_DENSE_DIM, k
    if kind == KIND_LABEL and c != 1:
        return e, BAD_COUNT, k
    i = e
    for q in range(c):
        s, i = _next_token(buf, i)
        if s == i:
            return i, BAD_COUNT, k
        if kind == KIND_SPARSE:
            ok, u = parse_uint64(buf, s, i)
            tmp_slot[k] = at
            tmp_id[k] = feasign_id(u, salts[at], opts[OPT_BUCKET], opts[OPT_RAW_IDS] != 0)
            k += 1
        elif kind == KIND_DENSE:
            ok, v = parse_float(buf, s, i)
            dense_row[at + q] = v
        elif kind == KIND_LABEL and opts[OPT_HAS_LABEL] != 0:
            ok, v = parse_float(buf, s, i)
            ok = ok and (v == 0.0 or v == 1.0)
            label[r, at] = v
        if not ok:
            return i, BAD_VALUE, k
    return i, 0, k


@njit(cache=True, nogil=True)
def _multislot_line(buf, pos, finfo, opts, salts, out, scratch, r):
    """Parse the line at ``pos`` into row r: (next_pos, reason, detail, ids collected).

    reason 0 = valid, -1 = blank, else BAD_* (detail = field index, or tokens left)."""
    dense, label, ids, offsets = out
    tmp_slot, tmp_id = scratch[0], scratch[1]
    for j in range(dense.shape[1]):
        dense[r, j] = np.nan
    for t in range(label.shape[1]):
        label[r, t] = 0.0
    s, e = _next_token(buf, pos)
    if s == e:
        return e + 1, -1, 0, 0
    i, k = pos, 0
    for f in range(finfo.shape[0]):
        i, reason, k = _field(buf, i, f, finfo, opts, salts, dense[r], label, r, tmp_slot,
                              tmp_id, k)
        if reason != 0:
            return _skip_line(buf, i)[0], reason, f, k
    left = 0
    while True:
        s, i = _next_token(buf, i)
        if s == i:
            break
        left += 1
    if left:
        return i + 1, BAD_EXTRA, left, k
    return i + 1, 0, 0, k


@njit(cache=True, nogil=True)
def parse_multislot(buf, finfo, slots, opts, out, scratch, bad, counts):
    """Parse MultiSlot bytes into rows with CSR bags (see the module doc).

    Parameters
    ----------
    buf : (nbytes,) uint8, whole lines
    finfo : (F, 3) int64, per field in line order: kind (bag_common.KIND_*), index (first
        dense position, or slot), dim
    slots : (salts (S,) uint64, max_len (S,) int64)
    opts : (4,) int64, as ``slot_bags.parse_slot_bags`` (feasign_first unused)
    out, scratch, bad, counts : as ``slot_bags.parse_slot_bags``

    Returns
    -------
    int, rows written.  cap >= lines and icap >= nbytes // 2 + 1 always suffice.
    """
    n = buf.shape[0]
    dense = out[0]
    ids, offsets = out[2], out[3]
    tmp_slot, tmp_id, cur, lim = scratch[0], scratch[1], scratch[2], scratch[3]
    pos = line = r = nb = 0
    while pos < n:
        if r < dense.shape[0]:
            pos, reason, detail, k = _multislot_line(buf, pos, finfo, opts, slots[0], out,
                                                     scratch, r)
        else:  # (never with cap >= lines)
            pos, any_tok = _skip_line(buf, pos)
            reason, detail, k = (BAD_CAPACITY if any_tok else -1), 0, 0
        trunc = 0
        if reason == 0:
            trunc = emit_bags(k, tmp_slot, tmp_id, slots[1], cur, lim, r, ids, offsets)
        r, nb = end_line(reason, detail, trunc, r, line, counts, bad, nb)
        line += 1
    counts[CNT_ROWS] = r
    counts[CNT_LINES] = line
    counts[CNT_BAD] = nb
    return r
