"""Paddle slot text format (PaddleRec CTR-DNN sample data) -> the same arrays as TSV.

A line is 40 whitespace-separated ``key:value`` tokens in this order::

    click:0 dense_feature:0.0 ... (13 dense_feature tokens) 1:737395 2:210498 ... 26:306163

* ``click``: label, exactly ``0`` or ``1``.
* ``dense_feature``: already normalised floats, taken as they are (must be finite).
* ``k:v`` for slot k = 1..26: ``v`` is Paddle's already-hashed id (an unsigned 64-bit
  integer).  With ``hash_bucket == 0`` the id is mixed with its slot so equal values in
  different slots differ: ``id = splitmix64_finalise(v + k * 0x9E3779B97F4A7C15)`` as
  int64 (k = slot 1..26, i.e. slot index + 1; see ``slot_feature_id``).  With
  ``hash_bucket = B > 0`` the id is ``v % B``: Paddle's own id for ``B >= 1000001``.

Lines that break these rules are bad lines (counted, reported, no row), as for TSV.
The parser is vectorised numpy over a buffer of whole lines; it is a migration path for
data already in Paddle's format, not the fast path.
"""
import numpy as np

from mpips.data.criteo import (BAD_SLOT_KEY, BAD_SLOT_TOKENS, BAD_SLOT_VALUE,
                               MAX_BAD_RECORDS, N_DENSE, N_SPARSE, ParseResult, as_uint8,
                               splitmix64_finalise)
from mpips.kernels import parse as K

N_TOKENS = 1 + N_DENSE + N_SPARSE  # 40
KEYS = [b"click"] + [b"dense_feature"] * N_DENSE + [str(k).encode() for k in range(1, 27)]
MAX_VALUE_BYTES = 32  # longer values make the line bad
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 11, 12, 13, 32]] = True  # bytes.split() whitespace
_KEY_LEN = np.array([len(k) for k in KEYS], dtype=np.int64)  # (40,)
_KEY_W = int(_KEY_LEN.max())
_KEY_MAT = np.zeros((N_TOKENS, _KEY_W), dtype=np.uint8)  # (40, 13) padded keys
for _j, _k in enumerate(KEYS):
    _KEY_MAT[_j, :len(_k)] = np.frombuffer(_k, dtype=np.uint8)
_KEY_MASK = np.arange(_KEY_W)[None, :] < _KEY_LEN[:, None]  # (40, 13)
_GROUPS = ((0, 1), (1, 1 + N_DENSE), (1 + N_DENSE, N_TOKENS))  # label, dense, slot columns


def slot_feature_id(slot: int, value: int, hash_bucket: int = 0) -> int:
    """Reference id for value ``value`` in slot index ``slot`` (0..25 for slots 1..26)."""
    if hash_bucket > 0:
        return value % hash_bucket
    h = splitmix64_finalise((value + (slot + 1) * _GOLDEN) & _MASK64)
    return h - (1 << 64) if h >= (1 << 63) else h


def _token_spans(buf: np.ndarray):
    """Token starts/ends (ends exclusive) and the 0-based line of each token."""
    ws = _WS[buf]  # (nbytes,)
    padded = np.ones(buf.size + 2, dtype=bool)  # whitespace sentinels at both ends
    padded[1:-1] = ws
    starts = np.flatnonzero(~ws & padded[:-2])  # (ntok,) previous byte is whitespace
    ends = np.flatnonzero(~ws & padded[2:]) + 1  # (ntok,) next byte is whitespace
    lf = np.flatnonzero(buf == 10)
    line = np.searchsorted(lf, starts)  # LFs before each token start
    return starts, ends, line, lf


def _gather(buf, pos, width, length):
    """(..., width) uint8 bytes buf[pos:pos+length] zero-padded (pos, length: (...,))."""
    idx = pos[..., None] + np.arange(width)  # (..., width)
    out = buf[np.minimum(idx, buf.size - 1)]
    out[np.arange(width) >= length[..., None]] = 0
    return out


def _first_bad(mask_ok: np.ndarray) -> np.ndarray:
    """Index of the first False per row of (m, k) ``mask_ok`` (0 if none)."""
    return np.argmin(mask_ok, axis=1)


def _convert(strings: np.ndarray, dtype):
    """astype with a per-element fallback; returns (values, ok) of strings' shape."""
    try:
        vals = strings.astype(dtype)
        ok = np.ones(strings.shape, dtype=bool)
    except (ValueError, OverflowError):  # error path only: find the culprits one by one
        flat = strings.reshape(-1)
        vals = np.zeros(flat.shape, dtype=dtype)
        ok = np.zeros(flat.shape, dtype=bool)
        for i, s in enumerate(flat.tolist()):
            try:
                v = float(s) if dtype is np.float64 else int(s)
                if dtype is np.uint64 and not 0 <= v < 2**64:
                    continue
                vals[i] = v
                ok[i] = True
            except (ValueError, OverflowError):
                pass
        vals, ok = vals.reshape(strings.shape), ok.reshape(strings.shape)
    if dtype is np.float64:
        ok &= np.isfinite(vals)
    return vals, ok


def _check_tokens(buf, s, e):
    """Keys and values of candidate lines' tokens s, e: (m, 40) -> (values, key_ok, val_ok).

    ``values`` is a list of three (m, k) bytes arrays: label, dense, slot ids.
    """
    cpos = np.flatnonzero(buf == 58)  # ':'
    c = np.append(cpos, buf.size)[np.searchsorted(cpos, s)]  # (m, 40) first ':' in token
    klen = c - s
    key_ok = (c < e) & (klen == _KEY_LEN)  # (m, 40)
    vlen = e - c - 1
    val_ok = (vlen >= 1) & (vlen <= MAX_VALUE_BYTES)
    vlen = np.clip(vlen, 0, MAX_VALUE_BYTES)
    values = []
    for lo, hi in _GROUPS:  # gather only as wide as each group needs
        kw = int(_KEY_LEN[lo:hi].max())
        keys = _gather(buf, s[:, lo:hi], kw, np.minimum(klen[:, lo:hi], kw))  # (m, k, kw)
        key_ok[:, lo:hi] &= np.all((keys == _KEY_MAT[lo:hi, :kw]) | ~_KEY_MASK[lo:hi, :kw],
                                   axis=2)
        vw = max(1, int(vlen[:, lo:hi].max(initial=1)))
        vals = _gather(buf, c[:, lo:hi] + 1, vw, vlen[:, lo:hi])  # (m, k, vw)
        values.append(np.ascontiguousarray(vals).view(f"S{vw}")[..., 0])  # (m, k)
    return values, key_ok, val_ok


def parse_slot_bytes(data, *, hash_bucket: int = 0) -> ParseResult:
    """Parse whole slot-format lines in ``data`` (bytes-like or uint8 array)."""
    if hash_bucket < 0:
        raise ValueError(f"hash_bucket must be >= 0 (0 = mixed int64 ids); got {hash_bucket}")
    buf = as_uint8(data)
    n_lines = 0 if buf.size == 0 else int(np.count_nonzero(buf == 10)) + int(buf[-1] != 10)
    starts, ends, tline, _ = _token_spans(buf)
    ntok = np.bincount(tline, minlength=n_lines)  # (n_lines,)
    cand = ntok == N_TOKENS
    bad_lines = [np.flatnonzero((ntok != N_TOKENS) & (ntok > 0))]
    bad_codes = [np.full(bad_lines[0].size, BAD_SLOT_TOKENS)]
    bad_detail = [ntok[bad_lines[0]]]
    sel = cand[tline]
    s = starts[sel].reshape(-1, N_TOKENS)  # (m, 40)
    e = ends[sel].reshape(-1, N_TOKENS)
    lines = tline[sel].reshape(-1, N_TOKENS)[:, 0]  # (m,)
    (lab, dvals, svals), key_ok, val_ok = _check_tokens(buf, s, e)
    lab = lab[:, 0]
    val_ok[:, 0] &= (lab == b"0") | (lab == b"1")
    dense, d_ok = _convert(dvals, np.float64)
    raw_ids, s_ok = _convert(svals, np.uint64)
    val_ok[:, 1:1 + N_DENSE] &= d_ok
    val_ok[:, 1 + N_DENSE:] &= s_ok
    kbad = ~key_ok.all(axis=1)
    vbad = ~val_ok.all(axis=1) & ~kbad
    for mask, code, det in ((kbad, BAD_SLOT_KEY, _first_bad(key_ok)),
                            (vbad, BAD_SLOT_VALUE, _first_bad(val_ok))):
        bad_lines.append(lines[mask])
        bad_codes.append(np.full(int(mask.sum()), code))
        bad_detail.append(det[mask])
    good = ~(kbad | vbad)
    sparse = np.empty((int(good.sum()), N_SPARSE), dtype=np.int64)
    K.splitmix64_mix_ids(np.ascontiguousarray(raw_ids[good]), np.arange(N_SPARSE),
                         hash_bucket, sparse)
    bl, bc, bd = (np.concatenate(x).astype(np.int64) for x in (bad_lines, bad_codes, bad_detail))
    order = np.argsort(bl, kind="stable")[:MAX_BAD_RECORDS]
    bad = np.stack([bl[order], bc[order], bd[order]], axis=1).reshape(-1, 3)
    return ParseResult(dense[good].astype(np.float32), sparse,
                       (lab[good] == b"1").astype(np.float32), bad, n_lines, int(bl.size))
