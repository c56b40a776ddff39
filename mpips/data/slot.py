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

Lines that break these rules are bad lines (counted, reported, no row), as for TSV;
the exact rules (token count, then keys, then values) are in ``mpips.kernels.slot_parse``,
whose numba kernel parses a buffer of whole lines in one pass.  Values are read as
Python's ``float()`` / ``int()`` read them (floats correctly rounded, see the kernel).
"""
from mpips.data.criteo import (N_DENSE, N_SPARSE, ParseResult, as_uint8, kernel_outputs, parse_result,
                               splitmix64_finalise)
from mpips.kernels import slot_parse as S

N_TOKENS = 1 + N_DENSE + N_SPARSE  # 40
KEYS = [b"click"] + [b"dense_feature"] * N_DENSE + [str(k).encode() for k in range(1, 27)]
MAX_VALUE_BYTES = S.MAX_VALUE_BYTES  # longer values make the line bad
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def slot_feature_id(slot: int, value: int, hash_bucket: int = 0) -> int:
    """Reference id for value ``value`` in slot index ``slot`` (0..25 for slots 1..26)."""
    if hash_bucket > 0:
        return value % hash_bucket
    h = splitmix64_finalise((value + (slot + 1) * _GOLDEN) & _MASK64)
    return h - (1 << 64) if h >= (1 << 63) else h


def parse_slot_bytes(data, *, hash_bucket: int = 0) -> ParseResult:
    """Parse whole slot-format lines in ``data`` (bytes-like or uint8 array)."""
    if hash_bucket < 0:
        raise ValueError(f"hash_bucket must be >= 0 (0 = mixed int64 ids); got {hash_bucket}")
    buf = as_uint8(data)
    out = kernel_outputs(buf)
    return parse_result(S.parse_slot(buf, int(hash_bucket), *out), *out)
