"""Criteo TSV format: constants, feature hash reference, and a bytes -> arrays parser.

One example a line: ``label \\t I1..I13 \\t C1..C26`` (40 fields; 39 without label).

* Integer field ``Ik``: what Python's ``float()`` reads as a finite value (``260``,
  ``260.0``, ``1e3``; plain integers on a fast path), or empty.  Dense value
  ``(x - cont_min[k]) / cont_diff[k]`` (float64 maths, stored float32); empty -> 0.0,
  as in Paddle's CTR-DNN reader.  Defaults are Paddle's constants.
* Categorical field ``Ck`` (any bytes but TAB/LF, usually 8 hex digits or empty):
  id = ``hash_feature(k - 1, raw)`` — see ``mpips.kernels.tsv_parse`` for the exact hash.
  Empty is a value of its own.  ``hash_bucket=B`` gives ``unsigned_hash % B`` instead
  (Paddle's ``% 1000001`` bucketing; ids then collide across slots, as in Paddle).
* Lines end in LF, optionally CRLF; this parser reads a last line without LF (a line
  handed over alone, as the predictor does).  A *file* whose last line has no LF is cut
  (``mpips.data.reader`` treats that line as bad: ``BAD_NO_NEWLINE``).  Blank lines are
  skipped silently.  Bad lines (wrong field count, an I-field that is not a number, label
  not 0/1) produce no row and are reported with their line number.  With ``pad=True`` a
  line that ends after its label and I-fields is read with the missing categoricals empty
  (``ParseResult.padded`` counts them; the reader pads unless ``--strict``).
"""
from dataclasses import dataclass

import numpy as np

from mpips.data.sources import open_input
from mpips.kernels import tsv_parse as K

N_DENSE = K.N_DENSE
N_SPARSE = K.N_SPARSE
CONT_MIN = np.array([0, -3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=np.float64)
CONT_DIFF = np.array([20, 603, 100, 50, 64000, 500, 100, 50, 500, 10, 10, 10, 50],
                     dtype=np.float64)
PADDLE_HASH_BUCKET = 1000001
# The feature-id hashing of this version (TSV: hash_feature; slot: slot_feature_id), stored
# in every checkpoint: change it whenever either hash changes, so that checkpoints holding
# rows under the old ids are refused instead of silently never read.
ID_HASH = "fnv1a64-splitmix64/1"

BAD_LINE_TOO_LONG = 5  # Python-side: line longer than the reader's max_line_bytes
BAD_SLOT_TOKENS = 6  # slot format: wrong token count; detail = tokens found
BAD_SLOT_KEY = 7  # slot format: unexpected key at token index = detail
BAD_SLOT_VALUE = 8  # slot format: unparsable value at token index = detail
BAD_NO_NEWLINE = 9  # reader: a file's last line has no LF (cut?); detail = its bytes

MAX_BAD_RECORDS = 64  # bad lines recorded (with number and reason) per parse call

_MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def splitmix64_finalise(z: int) -> int:
    """Pure-Python splitmix64 output mix of a 64-bit unsigned int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def hash_feature(slot: int, raw: bytes, hash_bucket: int = 0) -> int:
    """Reference feature id of categorical ``raw`` in ``slot`` (0..25 for C1..C26).

    FNV-1a 64 over ``bytes([slot]) + raw``, then the splitmix64 finaliser; returned as
    a signed int64 value, or ``hash % hash_bucket`` when ``hash_bucket > 0``.
    """
    h = ((_FNV_OFFSET ^ (slot & 0xFF)) * _FNV_PRIME) & _MASK64
    for b in raw:
        h = ((h ^ b) * _FNV_PRIME) & _MASK64
    h = splitmix64_finalise(h)
    if hash_bucket > 0:
        return h % hash_bucket
    return h - (1 << 64) if h >= (1 << 63) else h


def describe_bad(reason: int, detail: int, has_label: bool = True) -> str:
    """Human-readable text for a bad-line record ``(reason, detail)``."""
    if reason == K.BAD_FIELDS:
        want = N_DENSE + N_SPARSE + (1 if has_label else 0)
        return f"expected {want} tab-separated fields, found {detail}"
    if reason == K.BAD_INT:
        return f"integer field I{detail} is not a number"
    if reason == K.BAD_LABEL:
        return "label is not 0 or 1"
    if reason == K.BAD_CAPACITY:
        return "internal: output buffer too small"
    if reason == BAD_LINE_TOO_LONG:
        return f"line longer than {detail} bytes (binary or corrupt data?)"
    if reason == BAD_SLOT_TOKENS:
        return f"expected 40 space-separated 'key:value' tokens, found {detail}"
    if reason == BAD_SLOT_KEY:
        return f"unexpected key in token {detail + 1}"
    if reason == BAD_SLOT_VALUE:
        return f"bad value in token {detail + 1}"
    if reason == BAD_NO_NEWLINE:
        return (f"last line ({detail} bytes) does not end in a newline: the file may be cut "
                "(a copy or write still going?), so the line is not trusted")
    return f"malformed (reason {reason}, detail {detail})"


@dataclass
class ParseResult:
    """Arrays parsed from one buffer of whole lines."""

    dense: np.ndarray  # (n, 13) float32
    sparse: np.ndarray  # (n, 26) int64
    label: np.ndarray  # (n,) float32
    bad: np.ndarray  # (min(n_bad, MAX_BAD_RECORDS), 3) int64: line (0-based), reason, detail
    n_lines: int  # lines in the buffer (incl. blank and bad)
    n_bad: int  # all bad lines (may exceed len(bad))
    offsets: np.ndarray | None = None  # None: sparse is (n, S); else (n*S + 1,) CSR bag offsets
    padded: int = 0  # lines read with missing trailing fields as empty (Criteo TSV)
    undeclared: int = 0  # tokens of slots the schema does not declare, skipped
    truncated: int = 0  # bags cut to their slot's max_len

    @property
    def n_rows(self) -> int:
        return int(self.label.shape[0])


def make_norm(cont_min=None, cont_diff=None, n_dense: int = N_DENSE) -> np.ndarray:
    """(2, n_dense) float64 [cont_min, cont_diff]; validates user-given statistics.

    Without statistics: Paddle's Criteo constants (only for 13 dense values)."""
    if (cont_min is None or cont_diff is None) and n_dense != N_DENSE:
        raise ValueError(f"min-max normalisation of {n_dense} dense values needs statistics "
                         f"(--stats FILE with cont_min and cont_diff lists of {n_dense} numbers)")
    lo = CONT_MIN if cont_min is None else np.asarray(cont_min, dtype=np.float64)
    diff = CONT_DIFF if cont_diff is None else np.asarray(cont_diff, dtype=np.float64)
    if lo.shape != (n_dense,) or diff.shape != (n_dense,):
        raise ValueError(f"cont_min and cont_diff must have {n_dense} values each; "
                         f"got shapes {lo.shape} and {diff.shape}")
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(diff)) and np.all(diff != 0)):
        raise ValueError("cont_min must be finite and cont_diff finite and non-zero "
                         f"(got cont_min={lo.tolist()}, cont_diff={diff.tolist()})")
    return np.ascontiguousarray(np.stack([lo, diff]))


def as_uint8(data) -> np.ndarray:
    """View bytes / bytearray / memoryview / uint8 array as a (nbytes,) uint8 array."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise ValueError(f"expected a 1-D uint8 array, got {data.dtype} {data.shape}")
        return np.ascontiguousarray(data)
    return np.frombuffer(data, dtype=np.uint8)


def parse_tsv_bytes(data, *, has_label: bool = True, hash_bucket: int = 0,
                    norm: np.ndarray | None = None, pad: bool = False,
                    seeds: np.ndarray | None = None) -> ParseResult:
    """Parse whole Criteo TSV lines in ``data`` (bytes-like or uint8 array).

    ``norm`` is ``make_norm(...)`` (default: Paddle's constants; its width is the number of
    dense columns); ``seeds`` the (S,) uint64 hash states of the categorical columns
    (default: Criteo's C1..C26).  ``pad``: a line missing trailing fields is read with them
    empty and counted in ``padded`` (else it is a bad line).
    """
    if hash_bucket < 0:
        raise ValueError(f"hash_bucket must be >= 0 (0 = full int64 ids); got {hash_bucket}")
    buf = as_uint8(data)
    norm = make_norm() if norm is None else norm
    out = kernel_outputs(buf, norm.shape[1], N_SPARSE if seeds is None else seeds.shape[0],
                         dense_dtype=norm.dtype
                         if norm.shape[0] > 2 else np.float32)
    opts = np.array([1 if has_label else 0, hash_bucket, 1 if pad else 0], dtype=np.int64)
    n = K.parse_criteo_tsv(buf, opts, norm, seeds, *out)
    return parse_result(n, *out)


def kernel_outputs(buf, n_dense=N_DENSE, n_sparse=N_SPARSE, dense_dtype=np.float32):
    """(dense, sparse, label, bad, counts): preallocated outputs of a parse kernel for buf."""
    cap = int(np.count_nonzero(buf == 10)) + 1 if buf.size else 0  # (lines,) upper bound
    return (np.empty((cap, n_dense), dtype=dense_dtype),
            np.empty((cap, n_sparse), dtype=np.int64),
            np.empty(cap, dtype=np.float32), np.empty((MAX_BAD_RECORDS, 3), dtype=np.int64),
            np.zeros(K.N_COUNTS, dtype=np.int64))


def parse_result(n, dense, sparse, label, bad, counts, offsets=None):
    """ParseResult of a kernel that returned n rows into `kernel_outputs` arrays."""
    n_bad = int(counts[K.CNT_BAD])
    extra = [int(counts[k]) if counts.shape[0] > k else 0
             for k in (K.CNT_PADDED, K.CNT_UNDECLARED, K.CNT_TRUNCATED)]
    return ParseResult(dense[:n], sparse if offsets is not None else sparse[:n], label[:n],
                       bad[:min(n_bad, MAX_BAD_RECORDS)], int(counts[K.CNT_LINES]), n_bad,
                       offsets, *extra)


def looks_binary(path):
    """Does the start of ``path``'s text look like binary data (not UTF-8, or NUL bytes)?"""
    with open_input(path) as f:
        head = f.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 3          # (not just a character cut at the end)
    return b"\0" in head


def hint(path, fmt, reason, detail, has_label):
    """What the user most likely got wrong, from the commonest bad-line reason."""
    n = N_DENSE + N_SPARSE
    if reason == BAD_LINE_TOO_LONG or looks_binary(path):
        return "binary or compressed data? decompress it, or convert it with python -m data_prep.criteo"
    if reason == K.BAD_FIELDS and has_label and detail == n:
        return (f"a {n}-field file without labels? training needs the 0/1 label as the first "
                f"of {n + 1} tab-separated fields")
    if reason == K.BAD_FIELDS and fmt == "tsv":
        return ("Paddle slot lines ('click:0 dense_feature:...')? use --data-format slot; "
                f"Criteo TSV has {n + 1} tab-separated fields (label, 13 integers, 26 hex)")
    if reason == BAD_NO_NEWLINE:
        return ("a file cut short? if its last line is complete, end the file with a "
                "newline (echo >> FILE)")
    if reason in (BAD_SLOT_TOKENS, BAD_SLOT_KEY, BAD_SLOT_VALUE):
        return ("Criteo TSV? use --data-format tsv; slot lines are 'click:<0|1>', 13 "
                "'dense_feature:<x>' and 26 '<slot>:<id>' tokens")
    return "check the file's format (docs/data.md); --data-format tsv|slot forces one"
