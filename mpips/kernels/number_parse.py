"""Numba kernels parsing decimal numbers out of bytes, as Python's ``float()`` / ``int()`` do.

``parse_float(buf, start, end)`` -> (ok, float64) and ``parse_uint64(buf, start, end)`` ->
(ok, uint64) take a byte range of a uint8 buffer; the ``*_prefix`` forms stop at the
first byte that cannot continue the number (for tokenizers that call them inline).

Float parsing follows Python's ``float()`` grammar (sign, digits with PEP 515 ``_``,
fraction, exponent; inf/nan are rejected as non-finite) and rounds correctly:
Clinger's exact fast path (<= 2**53 mantissa, |exp10| <= 22), otherwise Eisel-Lemire
with a 128-bit power-of-five table, which is exact for every decimal with <= 19
significant digits (Mushtak & Lemire 2023, "Fast number parsing without fallback").
Longer mantissas (at most 32 digits fit in a 32-byte value) use the first 19 digits
truncated: the float64 may then be one ulp low, which changes the float32 output only
if that ulp straddles a float32 rounding boundary (p ~ 2**-29 per such value), and a
value within one ulp below the float64 overflow threshold is accepted where ``float()``
may say inf.  The float64 is rounded to float32 (as ``astype(np.float32)`` does).
"""
import math

import numpy as np
from numba import njit

IS_DIGIT = np.zeros(256, dtype=np.bool_)  # (256,) '0'..'9'
IS_DIGIT[48:58] = True
POW10 = np.array([float(10 ** k) for k in range(23)])  # (23,) exact doubles
_U32 = np.uint64(32)
_M32 = np.uint64(0xFFFFFFFF)
_MAX_DIV10 = np.uint64(1844674407370955161)  # (2**64 - 1) // 10
_TWO53 = np.uint64(1 << 53)
_HIDDEN = np.uint64(1 << 52)
Q_MIN = -342  # smallest power of ten with a table entry
Q_MAX = 308


def _pow5_table() -> np.ndarray:
    """(651, 2) uint64 [hi, lo]: 128-bit normalised 5**q, q = -342..308 (fast_float's)."""
    rows = []
    for q in range(Q_MIN, Q_MAX + 1):
        if q < 0:
            p5 = 5 ** -q
            z = p5.bit_length()  # 2**z > p5 (p5 is never a power of two)
            b = z + 127 if q >= -27 else 2 * z + 128
            c = 2 ** b // p5 + 1
            while c >= 1 << 128:
                c //= 2
        else:
            c = 5 ** q
            c <<= max(0, 127 - (c.bit_length() - 1))
            c >>= max(0, c.bit_length() - 128)
        rows.append((c >> 64, c & ((1 << 64) - 1)))
    return np.array(rows, dtype=np.uint64)


POW5 = _pow5_table()


@njit(cache=True, nogil=True)
def _underscore_ok(buf, i, start, end):
    """PEP 515: ``_`` at i is valid only between two digits inside [start, end)."""
    return i > start and i + 1 < end and IS_DIGIT[buf[i - 1]] and IS_DIGIT[buf[i + 1]]


@njit(cache=True, nogil=True)
def _mul128(a, b):
    """Full 64 x 64 -> 128-bit product of uint64s: (hi, lo)."""
    a0, a1, b0, b1 = a & _M32, a >> _U32, b & _M32, b >> _U32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _U32) + (p01 & _M32) + (p10 & _M32)
    return p11 + (p01 >> _U32) + (p10 >> _U32) + (mid >> _U32), (mid << _U32) | (p00 & _M32)


@njit(cache=True, nogil=True)
def _clz64(w):
    """Leading zero bits of a non-zero uint64."""
    n = 0
    for k in (32, 16, 8, 4, 2, 1):
        if (w >> np.uint64(64 - k)) == np.uint64(0):
            w = w << np.uint64(k)
            n += k
    return n


@njit(cache=True, nogil=True)
def eisel_lemire(w, q):
    """Correctly rounded float64 of ``w * 10**q`` (w: non-zero uint64, q: int).

    fast_float's ``compute_float<binary64>`` (no-fallback version): exact for all w.
    Returns a float64 (inf on overflow, 0.0 on underflow).
    """
    if q < Q_MIN:
        return 0.0
    if q > Q_MAX:
        return math.inf
    lz = _clz64(w)
    w = w << np.uint64(lz)
    hi, lo = _mul128(w, POW5[q - Q_MIN, 0])
    if (hi & np.uint64(0x1FF)) == np.uint64(0x1FF):  # refine with the low 64 table bits
        hi2, _ = _mul128(w, POW5[q - Q_MIN, 1])
        lo = lo + hi2
        if hi2 > lo:
            hi = hi + np.uint64(1)
    upper = np.int64(hi >> np.uint64(63))
    shift = np.uint64(upper + 9)
    m = hi >> shift
    p2 = (((152170 + 65536) * q) >> 16) + 63 + upper - lz + 1023
    if p2 <= 0:  # subnormal (or zero)
        if -p2 + 1 >= 64:
            return 0.0
        m = m >> np.uint64(-p2 + 1)
        m = (m + (m & np.uint64(1))) >> np.uint64(1)
        return math.ldexp(float(m), -1074)  # covers the round-up to the smallest normal
    if lo <= np.uint64(1) and q >= -4 and q <= 23 and (m & np.uint64(3)) == np.uint64(1):
        if (m << shift) == hi:  # exactly halfway: round to even
            m = m & ~np.uint64(1)
    m = (m + (m & np.uint64(1))) >> np.uint64(1)
    if m >= (_HIDDEN << np.uint64(1)):
        m = _HIDDEN
        p2 += 1
    if p2 >= 0x7FF:
        return math.inf
    return math.ldexp(float(m | _HIDDEN), p2 - 1075)


@njit(cache=True, nogil=True)
def _to_double(w, q, neg):
    """Correctly rounded float64 of ``(-1 if neg) * w * 10**q`` (w: uint64)."""
    if w == np.uint64(0):
        v = 0.0
    elif w <= _TWO53 and q >= -22 and q <= 22:  # Clinger: a single exact rounding
        v = float(w) * POW10[q] if q >= 0 else float(w) / POW10[-q]
    else:
        v = eisel_lemire(w, q)
    return -v if neg else v


@njit(cache=True, nogil=True)
def float_general(buf, start, end):
    """``float()`` of all of ``buf[start:end]`` incl. ``_`` and > 19 digits: (ok, value)."""
    i = start
    neg = False
    if i < end and (buf[i] == 45 or buf[i] == 43):  # '-' '+'
        neg = buf[i] == 45
        i += 1
    w = np.uint64(0)
    nd = 0  # digits kept in w (leading zeros excluded), at most 19
    ndig = 0  # all mantissa digits seen
    q = 0
    frac = False
    while i < end:
        c = buf[i]
        if IS_DIGIT[c]:
            ndig += 1
            if nd < 19:
                if nd > 0 or c != 48:
                    w = w * np.uint64(10) + np.uint64(c - 48)
                    nd += 1
                q -= 1 if frac else 0
            else:  # truncated (see the module docstring)
                q += 0 if frac else 1
        elif c == 95 and _underscore_ok(buf, i, start, end):
            pass
        elif c == 46 and not frac:  # '.'
            frac = True
        else:
            break
        i += 1
    if ndig == 0:
        return False, 0.0
    if i < end and (buf[i] == 101 or buf[i] == 69):  # 'e' 'E'
        i += 1
        eneg = False
        if i < end and (buf[i] == 45 or buf[i] == 43):
            eneg = buf[i] == 45
            i += 1
        ex = 0
        edig = 0
        while i < end:
            c = buf[i]
            if IS_DIGIT[c]:
                edig += 1
                if ex < 100000:  # saturate: far beyond any finite / non-zero result
                    ex = ex * 10 + (c - 48)
            elif not (c == 95 and _underscore_ok(buf, i, start, end)):
                break
            i += 1
        if edig == 0:
            return False, 0.0
        q += -ex if eneg else ex
    if i != end:
        return False, 0.0
    v = _to_double(w, q, neg)
    return not math.isinf(v), v


@njit(cache=True, nogil=True, inline="always")
def float_prefix(buf, start, end):
    """Greedy float at ``start`` without ``_`` and with <= 19 mantissa digits.

    Returns (stop, code, value): code 0 = parsed, ``stop`` = first byte after it;
    1 = syntax error; 2 = needs ``float_general`` (an ``_`` or > 19 digits).
    """
    i = start
    neg = False
    if i < end and (buf[i] == 45 or buf[i] == 43):
        neg = buf[i] == 45
        i += 1
    w = np.uint64(0)
    d0 = i
    while i < end and IS_DIGIT[buf[i]]:
        w = w * np.uint64(10) + np.uint64(buf[i] - 48)
        i += 1
    nd = i - d0
    nfrac = 0
    if i < end and buf[i] == 46:
        i += 1
        f0 = i
        while i < end and IS_DIGIT[buf[i]]:
            w = w * np.uint64(10) + np.uint64(buf[i] - 48)
            i += 1
        nfrac = i - f0
        nd += nfrac
    if nd == 0:
        return i, 1, 0.0
    q = -nfrac
    if i < end and (buf[i] == 101 or buf[i] == 69):
        i += 1
        eneg = False
        if i < end and (buf[i] == 45 or buf[i] == 43):
            eneg = buf[i] == 45
            i += 1
        e0 = i
        ex = 0
        while i < end and IS_DIGIT[buf[i]]:
            if ex < 100000:
                ex = ex * 10 + (buf[i] - 48)
            i += 1
        if i == e0:
            return i, 1, 0.0
        q += -ex if eneg else ex
    if nd > 19 or (i < end and buf[i] == 95):
        return i, 2, 0.0
    return i, 0, _to_double(w, q, neg)


@njit(cache=True, nogil=True)
def parse_float(buf, start, end):
    """Python ``float()`` of ``buf[start:end]`` (a token: no whitespace inside).

    Returns
    -------
    (ok, value) : ok False for a syntax error or a non-finite result; value float64
    """
    stop, code, v = float_prefix(buf, start, end)
    if code == 2:
        return float_general(buf, start, end)
    return code == 0 and stop == end and not math.isinf(v), v


@njit(cache=True, nogil=True)
def uint_general(buf, start, end):
    """``int()`` of all of ``buf[start:end]`` if in [0, 2**64): (ok, uint64)."""
    i = start
    neg = False
    if i < end and (buf[i] == 45 or buf[i] == 43):
        neg = buf[i] == 45
        i += 1
    if i == end:
        return False, np.uint64(0)
    w = np.uint64(0)
    while i < end:
        c = buf[i]
        if IS_DIGIT[c]:
            d = np.uint64(c - 48)
            if w > _MAX_DIV10 or (w == _MAX_DIV10 and d > np.uint64(5)):
                return False, np.uint64(0)
            w = w * np.uint64(10) + d
        elif not (c == 95 and _underscore_ok(buf, i, start, end)):
            return False, np.uint64(0)
        i += 1
    return not (neg and w != np.uint64(0)), w


@njit(cache=True, nogil=True, inline="always")
def uint_prefix(buf, start, end):
    """Greedy ``[+-]?[0-9]{1,19}`` at ``start``: (stop, code, value), codes as
    ``float_prefix`` (2 = an ``_`` or > 19 digits: use ``uint_general``)."""
    i = start
    neg = False
    if i < end and (buf[i] == 45 or buf[i] == 43):
        neg = buf[i] == 45
        i += 1
    w = np.uint64(0)
    d0 = i
    while i < end and IS_DIGIT[buf[i]]:
        w = w * np.uint64(10) + np.uint64(buf[i] - 48)
        i += 1
    if i - d0 > 19 or (i < end and buf[i] == 95):
        return i, 2, w
    if i == d0 or (neg and w != np.uint64(0)):
        return i, 1, w
    return i, 0, w


@njit(cache=True, nogil=True)
def parse_uint64(buf, start, end):
    """Python ``int()`` of ``buf[start:end]`` if it is in [0, 2**64): (ok, uint64)."""
    stop, code, w = uint_prefix(buf, start, end)
    if code == 2:
        return uint_general(buf, start, end)
    return code == 0 and stop == end, w
