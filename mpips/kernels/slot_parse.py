"""Numba kernel for Paddle slot-format lines (``click:0 dense_feature:0.05 ... 26:306163``).

One pass per line: tokens are split on ASCII whitespace (bytes.split(): TAB LF VT FF CR
SPACE; LF also ends the line), each token is ``key:value`` split at its first ``:``.
Rules (identical to the former vectorised parser in ``mpips.data.slot``):

* a line without tokens is blank (counted, not bad);
* not exactly 40 tokens -> ``BAD_SLOT_TOKENS``, detail = tokens found;
* else the first token whose key is wrong (no ``:``, or key != click / dense_feature x13 /
  1..26) -> ``BAD_SLOT_KEY``, detail = token index 0..39 (key errors win over values);
* else the first token whose value is bad -> ``BAD_SLOT_VALUE``, detail = token index.
  A value is 1..32 bytes and is ``0``/``1`` (click), a finite Python ``float()`` (dense)
  or a Python ``int()`` in [0, 2**64) (slots; ``_`` between digits, sign, leading zeros
  allowed exactly as ``int()`` allows them).

Number parsing (``float()`` / ``int()`` semantics, correctly rounded) is in
``mpips.kernels.number_parse``.
"""
import math

import numpy as np
from numba import njit

from mpips.kernels.number_parse import (float_general, float_prefix, uint_general,
                                        uint_prefix)
from mpips.kernels.tsv_parse import (BAD_CAPACITY, CNT_BAD, CNT_LINES, CNT_ROWS,
                                     splitmix64_finalise)

N_DENSE = 13
N_SPARSE = 26
N_TOKENS = 1 + N_DENSE + N_SPARSE  # 40
MAX_VALUE_BYTES = 32  # longer values make the line bad

BAD_SLOT_TOKENS = 6  # same codes as mpips.data.criteo.BAD_SLOT_*
BAD_SLOT_KEY = 7
BAD_SLOT_VALUE = 8

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
KEY_DENSE = np.frombuffer(b"dense_feature", dtype=np.uint8).copy()  # (13,)
KEY_CLICK = np.frombuffer(b"click", dtype=np.uint8).copy()  # (5,)
IS_WS = np.zeros(256, dtype=np.bool_)  # (256,) bytes.split() whitespace: TAB LF VT FF CR SP
IS_WS[[9, 10, 11, 12, 13, 32]] = True
@njit(cache=True, nogil=True, inline="always")
def _key_colon(buf, s, k):
    """Index of the ':' if token k at ``s`` starts with its key + ':', else -1.

    (Equivalent to: the token's first ':' ends exactly the expected key.)"""
    n = buf.shape[0]
    if k <= N_DENSE:
        key = KEY_CLICK if k == 0 else KEY_DENSE
        klen = key.shape[0]
        if s + klen >= n:
            return -1
        for j in range(klen):
            if buf[s + j] != key[j]:
                return -1
    else:
        slot = k - N_DENSE
        klen = 1 if slot < 10 else 2
        if s + klen >= n:
            return -1
        if klen == 1:
            if buf[s] != 48 + slot:
                return -1
        elif buf[s] != 48 + slot // 10 or buf[s + 1] != 48 + slot % 10:
            return -1
    return s + klen if buf[s + klen] == 58 else -1


@njit(cache=True, nogil=True)
def _token_end(buf, i):
    n = buf.shape[0]
    while i < n and not IS_WS[buf[i]]:
        i += 1
    return i


@njit(cache=True, nogil=True, inline="always")
def _value(buf, vs, k, bucket, dense, sparse, label, r):
    """Parse the value of token k (starting at ``vs``) into row r: (token end, ok)."""
    n = buf.shape[0]
    if k == 0:
        e = vs + 1 if vs + 1 < n and IS_WS[buf[vs + 1]] else _token_end(buf, vs)
        ok = e - vs == 1 and (buf[vs] == 48 or buf[vs] == 49)
        label[r] = buf[vs] - 48 if ok else 0
        return e, ok
    if k <= N_DENSE:
        stop, code, v = float_prefix(buf, vs, n)
        e = stop if code == 0 and (stop == n or IS_WS[buf[stop]]) else _token_end(buf, stop)
        if e - vs > MAX_VALUE_BYTES:
            return e, False
        if code == 2:
            ok, v = float_general(buf, vs, e)
        else:
            ok = code == 0 and e == stop and not math.isinf(v)
        dense[r, k - 1] = v
        return e, ok
    stop, code, u = uint_prefix(buf, vs, n)
    e = stop if code == 0 and (stop == n or IS_WS[buf[stop]]) else _token_end(buf, stop)
    if e - vs > MAX_VALUE_BYTES:
        return e, False
    if code == 2:
        ok, u = uint_general(buf, vs, e)
    else:
        ok = code == 0 and e == stop
    slot = k - 1 - N_DENSE  # 0..25
    if bucket > 0:
        sparse[r, slot] = np.int64(u % np.uint64(bucket))
    else:
        sparse[r, slot] = np.int64(splitmix64_finalise(u + np.uint64(slot + 1) * GOLDEN))
    return e, ok


@njit(cache=True, nogil=True)
def _slot_line(buf, pos, bucket, dense, sparse, label, r):
    """Parse the line at ``pos`` into row r: (next_pos, tokens, reason, detail).

    reason 0 = valid row; -1 = blank line; else a BAD_SLOT_* code.  A bad line may be
    partly written into the row; the caller reuses it.
    """
    n = buf.shape[0]
    ntok = 0
    kbad = -1
    vbad = -1
    i = pos
    while True:
        while i < n and buf[i] != 10 and IS_WS[buf[i]]:
            i += 1
        if i >= n or buf[i] == 10:
            break
        if ntok < N_TOKENS and kbad < 0:
            c = _key_colon(buf, i, ntok)
            if c < 0:
                kbad = ntok
                i = _token_end(buf, i)
            elif vbad < 0:
                i, ok = _value(buf, c + 1, ntok, bucket, dense, sparse, label, r)
                if not ok:
                    vbad = ntok
            else:
                i = _token_end(buf, c + 1)
        else:
            i = _token_end(buf, i)
        ntok += 1
    nxt = i + 1
    if ntok == 0:
        return nxt, ntok, -1, 0
    if ntok != N_TOKENS:
        return nxt, ntok, BAD_SLOT_TOKENS, ntok
    if kbad >= 0:
        return nxt, ntok, BAD_SLOT_KEY, kbad
    if vbad >= 0:
        return nxt, ntok, BAD_SLOT_VALUE, vbad
    return nxt, ntok, 0, 0


@njit(cache=True, nogil=True)
def _skip_line(buf, pos):
    """(index past the line at ``pos``, whether it has a non-whitespace byte)."""
    n = buf.shape[0]
    any_tok = False
    while pos < n and buf[pos] != 10:
        any_tok |= not IS_WS[buf[pos]]
        pos += 1
    return pos + 1, any_tok


@njit(cache=True, nogil=True)
def parse_slot(buf, bucket, dense, sparse, label, bad, counts):
    """Parse Paddle slot-format bytes (40 ``key:value`` tokens per line; see module doc).

    Lines end with LF (CR is whitespace); a final line without LF is parsed too.  Blank
    lines are counted in lines, not bad.  Bad lines produce no row and are recorded in
    ``bad`` (the first ``bad.shape[0]`` of them, in line order).

    Parameters
    ----------
    buf : (nbytes,) uint8, whole lines
    bucket : int, 0 -> id = splitmix64_finalise(v + (slot+1) * 0x9E3779B97F4A7C15) as
        int64; > 0 -> id = v % bucket
    dense : (cap, 13) float32, out
    sparse : (cap, 26) int64, out
    label : (cap,) float32, out
    bad : (bcap, 3) int64, out rows (line 0-based, reason code, detail)
    counts : (3,) int64, out [rows, lines, bad] (``CNT_*`` of mpips.kernels.tsv_parse)

    Returns
    -------
    int, rows written.  ``cap`` >= number of LF + 1 always suffices (else lines past
    capacity are recorded as ``BAD_CAPACITY``).
    """
    n = buf.shape[0]
    cap = dense.shape[0]
    pos = 0
    line = 0
    r = 0
    nb = 0
    while pos < n:
        if r < cap:
            pos, _, reason, detail = _slot_line(buf, pos, bucket, dense, sparse, label, r)
        else:
            pos, any_tok = _skip_line(buf, pos)
            reason, detail = (BAD_CAPACITY if any_tok else -1), 0
        if reason == 0:
            r += 1
        elif reason > 0:
            if nb < bad.shape[0]:
                bad[nb, 0] = line
                bad[nb, 1] = reason
                bad[nb, 2] = detail
            nb += 1
        line += 1
    counts[CNT_ROWS] = r
    counts[CNT_LINES] = line
    counts[CNT_BAD] = nb
    return r
