"""Numba kernel for Paddle slot text with any slots: ``click:1 dense:0.5 ... 101:735 101:52 ...``.

Tokens are split on ASCII whitespace (TAB LF VT FF CR SPACE; LF also ends a line).  Each
token is ``slot:feasign`` (split at its first ``:``) or, with ``token_order =
"feasign:slot"``, ``feasign:slot`` (split at its last ``:``).  Tokens come in any order:

* the label slot: a float() that is 0 or 1, exactly once per line (when labels are read);
* a dense slot of ``dim`` values: its tokens give the values in order; it appears ``dim``
  times or not at all (then its values are missing: NaN here, the group's fill later);
* a sparse slot: an integer feasign (Python ``int()``, in [0, 2**64)), mixed into an id
  (``bag_common.feasign_id``); a repeated slot makes a multi-hot bag in token order, a
  missing slot an empty bag;
* a slot the schema does not declare: skipped and counted (``CNT_UNDECLARED``).

Anything else makes the line bad (``bag_common.BAD_*``, first problem wins).
"""
import numpy as np
from numba import njit

from mpips.kernels.bag_common import (BAD_DENSE_DIM, BAD_NO_LABEL, BAD_TOKEN, BAD_VALUE,
                                      KIND_DENSE, KIND_LABEL, KIND_SPARSE, emit_bags, end_line,
                                      feasign_id, find_key)
from mpips.kernels.number_parse import parse_float, parse_uint64
from mpips.kernels.slot_parse import IS_WS, _skip_line
from mpips.kernels.tsv_parse import (BAD_CAPACITY, CNT_BAD, CNT_LINES, CNT_ROWS,
                                     CNT_UNDECLARED)

OPT_HAS_LABEL = 0  # opts[0]: 1 = the label slot must be on every line
OPT_BUCKET = 1  # opts[1]: hash_bucket (0 = mixed or raw int64 ids)
OPT_RAW_IDS = 2  # opts[2]: 1 = feasigns are ids as they are
OPT_FEASIGN_FIRST = 3  # opts[3]: 1 = tokens are feasign:slot


@njit(cache=True, nogil=True)
def _colon(buf, s, e, last):
    """Index of the first (or last) ':' in buf[s:e], or -1."""
    if last:
        for i in range(e - 1, s - 1, -1):
            if buf[i] == 58:
                return i
        return -1
    for i in range(s, e):
        if buf[i] == 58:
            return i
    return -1


@njit(cache=True, nogil=True)
def _value(buf, vs, ve, kk, kinfo, kseen, opts, salts, dense_row, label, r, tmp_slot, tmp_id,
           k):
    """Parse the value of key kk into the row: (ok, ids collected so far)."""
    kind = kinfo[kk, 0]
    q = kseen[kk]
    kseen[kk] += 1
    if kind == KIND_LABEL:
        ok, v = parse_float(buf, vs, ve)
        if ok and (v == 0.0 or v == 1.0):
            label[r, kinfo[kk, 1]] = v
            return True, k
        return False, k
    if kind == KIND_DENSE:
        if q >= kinfo[kk, 2]:  # too many: reported once the line is done
            return True, k
        ok, v = parse_float(buf, vs, ve)
        dense_row[kinfo[kk, 1] + q] = v
        return ok, k
    ok, u = parse_uint64(buf, vs, ve)
    slot = kinfo[kk, 1]
    tmp_slot[k] = slot
    tmp_id[k] = feasign_id(u, salts[slot], opts[OPT_BUCKET], opts[OPT_RAW_IDS] != 0)
    return ok, k + 1


@njit(cache=True, nogil=True)
def _check_counts(kinfo, kseen, has_label):
    """(reason, detail) of a line whose tokens all parsed: dense dims and the label."""
    for kk in range(kinfo.shape[0]):
        kind = kinfo[kk, 0]
        if kind == KIND_DENSE and kseen[kk] != 0 and kseen[kk] != kinfo[kk, 2]:
            return BAD_DENSE_DIM, kk
        if kind == KIND_LABEL and has_label and kseen[kk] != 1:
            return BAD_NO_LABEL, kseen[kk] + (kinfo[kk, 1] << 32)   # label t's count
    return 0, 0


@njit(cache=True, nogil=True)
def _slot_line(buf, pos, keys, salts, opts, out, scratch, r):
    """Parse the line at ``pos`` into row r: (next_pos, reason, detail, ids, undeclared).

    reason 0 = valid row (its ids collected in scratch), -1 = blank line, else BAD_*."""
    n = buf.shape[0]
    kbytes, koff, tab, kinfo = keys
    dense, label, ids, offsets = out
    tmp_slot, tmp_id, cur, lim, kseen = scratch
    for j in range(dense.shape[1]):
        dense[r, j] = np.nan
    kseen[:] = 0
    for t in range(label.shape[1]):
        label[r, t] = 0.0
    last = opts[OPT_FEASIGN_FIRST] != 0
    ntok = k = und = reason = detail = 0
    i = pos
    while True:
        while i < n and buf[i] != 10 and IS_WS[buf[i]]:
            i += 1
        if i >= n or buf[i] == 10:
            break
        s = i
        while i < n and not IS_WS[buf[i]]:
            i += 1
        ntok += 1
        if reason != 0:
            continue
        c = _colon(buf, s, i, last)
        if c < 0:
            reason, detail = BAD_TOKEN, ntok - 1
            continue
        ks, ke, vs, ve = (c + 1, i, s, c) if last else (s, c, c + 1, i)
        kk = find_key(buf, ks, ke, kbytes, koff, tab)
        if kk < 0 or kinfo[kk, 0] > KIND_SPARSE:
            und += 1
            continue
        ok, k = _value(buf, vs, ve, kk, kinfo, kseen, opts, salts, dense[r], label, r,
                       tmp_slot, tmp_id, k)
        if not ok:
            reason, detail = BAD_VALUE, kk
    if ntok == 0:
        return i + 1, -1, 0, 0, 0
    if reason == 0:
        reason, detail = _check_counts(kinfo, kseen, opts[OPT_HAS_LABEL] != 0)
    return i + 1, reason, detail, k, und


@njit(cache=True, nogil=True)
def parse_slot_bags(buf, keys, slots, opts, out, scratch, bad, counts):
    """Parse slot-text bytes into rows with CSR bags (see the module doc).

    Parameters
    ----------
    buf : (nbytes,) uint8, whole lines
    keys : (kbytes uint8, koff (K+1,) int64, tab (T,) int64, kinfo (K, 3) int64), the
        key table of ``mpips.data.formats.key_table`` (kinds ``bag_common.KIND_*``)
    slots : (salts (S,) uint64, max_len (S,) int64)
    opts : (4,) int64, [has_label, hash_bucket, raw_ids, feasign_first]
    out : (dense (cap, D) float64 NaN = missing, label (cap, T) float32 (one column a task), ids (icap,) int64,
        offsets (cap*S + 1,) int64 with offsets[0] = 0), out
    scratch : (tmp_slot (icap,) int64, tmp_id (icap,) int64, cur (S,), lim (S,), kseen (K,))
    bad : (bcap, 3) int64, out rows (line 0-based, reason, detail)
    counts : (N_COUNTS,) int64, out [rows, lines, bad, padded, undeclared, truncated]

    Returns
    -------
    int, rows written.  cap >= lines and icap >= nbytes // 2 + 1 always suffice.
    """
    n = buf.shape[0]
    dense, label, ids, offsets = out
    tmp_slot, tmp_id, cur, lim, kseen = scratch
    max_len = slots[1]
    pos = line = r = nb = 0
    while pos < n:
        if r < dense.shape[0]:
            pos, reason, detail, k, und = _slot_line(buf, pos, keys, slots[0], opts, out,
                                                     scratch, r)
        else:  # (never with cap >= lines)
            pos, any_tok = _skip_line(buf, pos)
            reason, detail, k, und = (BAD_CAPACITY if any_tok else -1), 0, 0, 0
        trunc = 0
        if reason == 0:
            trunc = emit_bags(k, tmp_slot, tmp_id, max_len, cur, lim, r, ids, offsets)
            if trunc >= 0:
                counts[CNT_UNDECLARED] += und
        r, nb = end_line(reason, detail, trunc, r, line, counts, bad, nb)
        line += 1
    counts[CNT_ROWS] = r
    counts[CNT_LINES] = line
    counts[CNT_BAD] = nb
    return r
