"""Numba kernel for delimited text with RFC 4180 quoting (CSV/TSV with a header).

A line is fields separated by one delimiter byte.  A field that starts with ``"`` is
quoted: it ends at the next lone ``"``, ``""`` inside stands for one ``"``, and delimiters
inside are data; after the closing quote comes the delimiter or the line end, anything
else is bad quoting.  Other fields are taken as they are (up to the delimiter; a CR before
the LF is dropped).  A quoted field cannot hold a line break (lines are read one by one).
Columns, by index (``colinfo[c] = kind, index, dim``, ``bag_common.KIND_*``):

* label: a float() that is 0 or 1 (label column t writes ``label[r, t]``);
* dense: a finite float(), else a null token (``na_values``, by default ``""``, ``NA``,
  ``null``, ``NaN``; matched after stripping spaces, and only when float() fails, so the
  common case costs nothing) = missing (NaN here, the group's fill later);
* sparse: the value's bytes hashed from the slot's seed (FNV-1a + splitmix64, the Criteo
  hash); with a separator byte the value is split on it, each non-empty piece an id of
  the bag in order; an empty value is an empty bag;
* skip: a column the schema does not use.

A line with another number of columns than the header, bad quoting, or a bad label or
dense value is bad (``bag_common.BAD_*``; detail = column index or columns found).
"""
import numpy as np
from numba import njit

from mpips.kernels.bag_common import (BAD_COLUMNS, BAD_QUOTE, BAD_VALUE, KIND_DENSE,
                                      KIND_LABEL, KIND_SPARSE, emit_bags, end_line, is_token,
                                      text_id)
from mpips.kernels.number_parse import parse_float
from mpips.kernels.tsv_parse import (BAD_CAPACITY, CNT_BAD, CNT_LINES, CNT_ROWS,
                                     FNV1A_PRIME)

OPT_HAS_LABEL = 0  # opts[0]: 1 = read the label column
OPT_BUCKET = 1  # opts[1]: hash_bucket (0 = full int64 ids)
OPT_DELIM = 2  # opts[2]: the delimiter byte


@njit(cache=True, nogil=True, inline="always")
def _is_space(c):
    return c == 32 or c == 9 or c == 11 or c == 12 or c == 13 or c == 10


@njit(cache=True, nogil=True)
def _number(src, a, b):
    """float() of src[a:b] with surrounding ASCII whitespace: (ok, value)."""
    while a < b and _is_space(src[a]):
        a += 1
    while b > a and _is_space(src[b - 1]):
        b -= 1
    return parse_float(src, a, b)


@njit(cache=True, nogil=True)
def _is_null(src, a, b, tbytes, toff):
    """Is src[a:b], spaces stripped, a null token?"""
    while a < b and _is_space(src[a]):
        a += 1
    while b > a and _is_space(src[b - 1]):
        b -= 1
    return is_token(src, a, b, tbytes, toff)


@njit(cache=True, nogil=True)
def _field(buf, i, delim, unq):
    """Scan the field at i: (src, a, b, end, ok); its value is src[a:b] (``unq`` for a
    quoted field, unescaped), ``end`` the index of its delimiter / LF (or len(buf))."""
    n = buf.shape[0]
    if i < n and buf[i] == 34:  # '"'
        j, m = i + 1, 0
        while True:
            if j >= n or buf[j] == 10:
                return unq, 0, m, j, False
            if buf[j] == 34:
                if j + 1 < n and buf[j + 1] == 34:
                    unq[m] = 34
                    m += 1
                    j += 2
                    continue
                j += 1
                break
            unq[m] = buf[j]
            m += 1
            j += 1
        if j < n and buf[j] == 13 and (j + 1 == n or buf[j + 1] == 10):
            return unq, 0, m, j + 1, True
        ok = j >= n or buf[j] == delim or buf[j] == 10
        while j < n and buf[j] != delim and buf[j] != 10:
            j += 1
        return unq, 0, m, j, ok
    e = i
    while e < n and buf[e] != delim and buf[e] != 10:
        e += 1
    b = e - 1 if (e > i and buf[e - 1] == 13 and (e == n or buf[e] == 10)) else e
    return buf, i, b, e, True


@njit(cache=True, nogil=True)
def _bag(src, a, b, sep, seed, bucket, slot, tmp_slot, tmp_id, k):
    """Hash the value src[a:b] (split on ``sep`` >= 0) into ids of ``slot``: new k."""
    h = seed
    has = False
    for i in range(a, b + 1):
        if i == b or (sep >= 0 and src[i] == sep):
            if has:
                tmp_slot[k] = slot
                tmp_id[k] = text_id(h, bucket)
                k += 1
            h = seed
            has = False
        else:
            h = (h ^ np.uint64(src[i])) * FNV1A_PRIME
            has = True
    return k


@njit(cache=True, nogil=True)
def _csv_line(buf, pos, colinfo, slots, opts, out, scratch, r):
    """Parse the line at ``pos`` into row r: (next_pos, reason, detail, ids collected)."""
    n = buf.shape[0]
    seeds, seps = slots[0], slots[2]
    dense, label = out[0], out[1]
    tmp_slot, tmp_id, unq = scratch[0], scratch[1], scratch[4]
    if buf[pos] == 10 or (buf[pos] == 13 and (pos + 1 == n or buf[pos + 1] == 10)):
        return (pos + 1 if buf[pos] == 10 else pos + 2), -1, 0, 0
    for j in range(dense.shape[1]):
        dense[r, j] = np.nan
    for t in range(label.shape[1]):
        label[r, t] = 0.0
    C = colinfo.shape[0]
    col = k = reason = detail = 0
    i = pos
    while True:
        src, a, b, e, ok = _field(buf, i, opts[OPT_DELIM], unq)
        if reason == 0 and not ok:
            reason, detail = BAD_QUOTE, col
        if reason == 0 and col < C:
            kind, at = colinfo[col, 0], colinfo[col, 1]
            if kind == KIND_SPARSE:
                k = _bag(src, a, b, seps[at], seeds[at], opts[OPT_BUCKET], at, tmp_slot,
                         tmp_id, k)
            elif kind == KIND_DENSE:
                ok, v = _number(src, a, b)
                if ok:
                    dense[r, at] = v
                else:                       # a null token stays NaN (missing)
                    ok = _is_null(src, a, b, slots[3], slots[4])
            elif kind == KIND_LABEL and opts[OPT_HAS_LABEL] != 0:
                ok, v = _number(src, a, b)
                ok = ok and (v == 0.0 or v == 1.0)
                label[r, at] = v
            if not ok:
                reason, detail = BAD_VALUE, col
        col += 1
        if e >= n or buf[e] == 10:
            break
        i = e + 1
    if col != C:
        return e + 1, BAD_COLUMNS, col, k
    return e + 1, reason, detail, k


@njit(cache=True, nogil=True)
def parse_csv(buf, colinfo, slots, opts, out, scratch, bad, counts):
    """Parse delimited lines (no header: the caller took it) into rows with CSR bags.

    Parameters
    ----------
    buf : (nbytes,) uint8, whole lines
    colinfo : (C, 3) int64, per column: kind (bag_common.KIND_*), index (dense position or
        slot), dim
    slots : (seeds (S,) uint64 FNV states, max_len (S,) int64, seps (S,) int64 separator
        byte or -1, null token bytes (uint8), their offsets (T + 1,) int64)
    opts : (3,) int64, [has_label, hash_bucket, delimiter byte]
    out : as ``slot_bags.parse_slot_bags``
    scratch : (tmp_slot (icap,), tmp_id (icap,), cur (S,), lim (S,), unq (nbytes + 1,) uint8)
    bad, counts : as ``slot_bags.parse_slot_bags``

    Returns
    -------
    int, rows written.  cap >= lines and icap >= nbytes // 2 + 1 always suffice.
    """
    n = buf.shape[0]
    dense, ids, offsets = out[0], out[2], out[3]
    tmp_slot, tmp_id, cur, lim = scratch[0], scratch[1], scratch[2], scratch[3]
    pos = line = r = nb = 0
    while pos < n:
        rr = r if r < dense.shape[0] else dense.shape[0] - 1
        pos, reason, detail, k = _csv_line(buf, pos, colinfo, slots, opts, out, scratch, rr)
        if reason == 0 and rr != r:
            reason = BAD_CAPACITY  # (never with cap >= lines)
        trunc = 0
        if reason == 0:
            trunc = emit_bags(k, tmp_slot, tmp_id, slots[1], cur, lim, r, ids, offsets)
        r, nb = end_line(reason, detail, trunc, r, line, counts, bad, nb)
        line += 1
    counts[CNT_ROWS] = r
    counts[CNT_LINES] = line
    counts[CNT_BAD] = nb
    return r
