"""Numba kernels for parsing Criteo TSV bytes and hashing categorical features.

Feature hash (the contract other modules and stored models rely on; do not change):

    h = FNV1A_OFFSET                                    # 0xcbf29ce484222325
    h = (h ^ slot) * FNV1A_PRIME        (mod 2**64)     # slot 0..25 (C1..C26), as one byte
    for b in raw_bytes:
        h = (h ^ b) * FNV1A_PRIME       (mod 2**64)     # FNV-1a 64 over the field bytes
    h = splitmix64_finalise(h)                          # avalanche: z ^= z>>30; z *= ...
    id = h reinterpreted as int64          if hash_bucket == 0   (full int64 range)
    id = h % hash_bucket  (h unsigned)     if hash_bucket > 0    (Paddle-style bucketing)

An empty field hashes like any other value (raw_bytes == b"").  The pure-Python
reference is ``mpips.data.criteo.hash_feature``.

Bad-line records written by ``parse_criteo_tsv`` are rows ``(line, reason, detail)``
with ``line`` 0-based relative to the start of the buffer and ``reason`` one of the
``BAD_*`` codes below.
"""
import numpy as np
from numba import njit

from mpips.kernels.number_parse import parse_float

FNV1A_OFFSET = np.uint64(0xCBF29CE484222325)
FNV1A_PRIME = np.uint64(0x100000001B3)
SM_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
SM_MUL2 = np.uint64(0x94D049BB133111EB)

N_DENSE = 13  # integer features I1..I13
N_SPARSE = 26  # categorical features C1..C26
CRITEO_SEEDS = np.array([(0xCBF29CE484222325 ^ k) * 0x100000001B3 % 2**64 for k in range(N_SPARSE)],
                        dtype=np.uint64)  # (26,) FNV-1a state after the slot byte of C1..C26

BAD_FIELDS = 1  # wrong number of tab-separated fields; detail = fields found
BAD_INT = 2  # dense field not a finite number (float()); detail = column (1..D)
BAD_LABEL = 3  # label field not exactly "0" or "1"; detail = 0
BAD_CAPACITY = 4  # output arrays full (caller sized them wrong); detail = 0
# codes 5.. are used by the Python-side readers (too-long line, slot-format errors)

OPT_HAS_LABEL = 0  # opts[0]: 1 if column 0 is the label
OPT_BUCKET = 1  # opts[1]: hash_bucket (0 = full int64 range)
OPT_PAD = 2  # opts[2] (optional): 1 = read a line missing trailing fields with them empty

CNT_ROWS = 0  # counts[0]: rows written
CNT_LINES = 1  # counts[1]: lines seen (incl. blank and bad ones)
CNT_BAD = 2  # counts[2]: bad lines (all of them, even beyond bad's capacity)
CNT_PADDED = 3  # counts[3] (optional): rows read from lines missing trailing fields
CNT_UNDECLARED = 4  # counts[4] (bag readers): tokens of undeclared slots skipped
CNT_TRUNCATED = 5  # counts[5] (bag readers): bags cut to their slot's max_len
N_COUNTS = 6

PADDED = -1  # _parse_line reason: a valid row whose missing trailing fields were empty


@njit(cache=True, nogil=True, inline="always")
def splitmix64_finalise(z):
    """Splitmix64 output mix of a uint64 (bijective avalanche)."""
    z = (z ^ (z >> np.uint64(30))) * SM_MUL1
    z = (z ^ (z >> np.uint64(27))) * SM_MUL2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def fnv1a_slot(buf, start, end, slot):
    """FNV-1a 64 of ``bytes([slot]) + buf[start:end]`` (uint64, not yet finalised)."""
    h = (FNV1A_OFFSET ^ np.uint64(slot & 0xFF)) * FNV1A_PRIME
    for i in range(start, end):
        h = (h ^ np.uint64(buf[i])) * FNV1A_PRIME
    return h


@njit(cache=True, nogil=True)
def hash_bytes(buf, start, end, slot):
    """Hash ``buf[start:end]`` for ``slot``: FNV-1a 64 seeded by slot + splitmix64.

    Parameters
    ----------
    buf : (nbytes,) uint8
    start, end : int, byte range (end exclusive)
    slot : int, 0..255

    Returns
    -------
    uint64 hash (``hash_to_id`` turns it into the feature id)
    """
    return splitmix64_finalise(fnv1a_slot(buf, start, end, slot))


@njit(cache=True, nogil=True, inline="always")
def hash_to_id(h, bucket):
    """Map a uint64 hash to an int64 id: full range, or ``h % bucket`` if bucket > 0."""
    if bucket > 0:
        return np.int64(h % np.uint64(bucket))
    return np.int64(h)  # two's-complement reinterpretation


@njit(cache=True, nogil=True, inline="always")
def parse_int_field(buf, start, end):
    """Parse ``[+-]?[0-9]+`` in ``buf[start:end]``.

    Returns
    -------
    (status, value) : status 0 ok, 1 empty field, 2 malformed; value float64
    """
    if start == end:
        return 1, 0.0
    i = start
    neg = False
    if buf[i] == 45 or buf[i] == 43:  # '-' or '+'
        neg = buf[i] == 45
        i += 1
    if i == end:
        return 2, 0.0
    v = 0.0
    while i < end:
        c = buf[i]
        if c < 48 or c > 57:
            return 2, 0.0
        v = v * 10.0 + (c - 48)
        i += 1
    return 0, -v if neg else v


@njit(cache=True, nogil=True, inline="always")
def parse_number_field(buf, start, end):
    """A dense field as Python's ``float()`` reads a finite value: (status, value).

    Status 0 ok, 1 empty, 2 malformed.  Plain integers take the fast path; anything else
    (``260.0``, ``1e3``, surrounding spaces) goes through the correctly rounded parser.
    """
    st, v = parse_int_field(buf, start, end)
    if st != 2:
        return st, v
    return _parse_decimal(buf, start, end)


@njit(cache=True, nogil=True)
def _parse_decimal(buf, start, end):
    """The slow path of ``parse_number_field``: strip spaces, then ``float()``."""
    while start < end and (buf[start] == 32 or buf[start] == 11 or buf[start] == 12
                           or buf[start] == 13):
        start += 1
    while end > start and (buf[end - 1] == 32 or buf[end - 1] == 11 or buf[end - 1] == 12
                           or buf[end - 1] == 13):
        end -= 1
    ok, v = parse_float(buf, start, end)
    return (0, v) if ok else (2, 0.0)


@njit(cache=True, nogil=True)
def _skip_line(buf, pos):
    """Index just past the LF ending the line that starts at ``pos`` (or len(buf))."""
    n = buf.shape[0]
    while pos < n and buf[pos] != 10:
        pos += 1
    return pos + 1


@njit(cache=True, nogil=True, inline="always")
def _is_blank(buf, pos):
    n = buf.shape[0]
    if buf[pos] == 10:
        return True
    return buf[pos] == 13 and (pos + 1 == n or buf[pos + 1] == 10)


@njit(cache=True, nogil=True, inline="always")
def _field_end(buf, s):
    """Index of the TAB/LF ending the field that starts at ``s`` (or len(buf))."""
    n = buf.shape[0]
    while s < n and buf[s] != 9 and buf[s] != 10:
        s += 1
    return s


@njit(cache=True, nogil=True, inline="always")
def _scan_hash(buf, s, seed):
    """Scan the field at ``s`` and FNV-1a hash it at once from state ``seed``: (end, hash).

    A CR just before an LF is excluded from the hash (CRLF line ending).
    """
    n = buf.shape[0]
    h = seed
    e = s
    while e < n:
        c = buf[e]
        if c == 9 or c == 10:
            break
        h = (h ^ np.uint64(c)) * FNV1A_PRIME
        e += 1
    if e > s and buf[e - 1] == 13 and (e == n or buf[e] == 10):  # rare: redo without CR
        h = seed
        for i in range(s, e - 1):
            h = (h ^ np.uint64(buf[i])) * FNV1A_PRIME
    return e, h


@njit(cache=True, nogil=True, inline="always")
def _seed(seeds, slot):
    """FNV state column ``slot`` is hashed from: Criteo's slot byte when ``seeds`` is None
    (compiled as a constant: the Criteo fast path), else ``seeds[slot]``."""
    if seeds is None:
        return (FNV1A_OFFSET ^ np.uint64(slot & 0xFF)) * FNV1A_PRIME
    return seeds[slot]


@njit(cache=True, nogil=True, inline="always")
def _n_sparse(seeds):
    if seeds is None:
        return N_SPARSE
    return seeds.shape[0]


@njit(cache=True, nogil=True, inline="always")
def _empty_dense(norm, j):
    """Value of an empty dense field j: 0, or norm[2, j] (e.g. NaN) with a third row."""
    return norm[2, j] if norm.shape[0] > 2 else 0.0


@njit(cache=True, nogil=True, inline="always")
def _parse_field(buf, s, f, opts, norm, seeds, dense_row, sparse_row):
    """Scan and parse logical field ``f`` (0 label, 1..D numbers, D+1.. categoricals) at ``s``.

    Returns (end, reason, value): end = index of the terminating TAB/LF (or len(buf)),
    reason 0 when fine, value = the label (f == 0) or the bad column (BAD_INT).
    """
    nd = norm.shape[1]
    if f > nd:
        slot = f - 1 - nd
        e, h = _scan_hash(buf, s, _seed(seeds, slot))
        sparse_row[slot] = hash_to_id(splitmix64_finalise(h), opts[OPT_BUCKET])
        return e, 0, 0
    e = _field_end(buf, s)
    fe = e - 1 if (e > s and buf[e - 1] == 13 and (e == buf.shape[0] or buf[e] == 10)) else e
    if f == 0:
        if fe - s != 1 or (buf[s] != 48 and buf[s] != 49):
            return e, BAD_LABEL, 0
        return e, 0, buf[s] - 48
    st, v = parse_number_field(buf, s, fe)
    if st == 2:
        return e, BAD_INT, f
    if st == 1:
        dense_row[f - 1] = _empty_dense(norm, f - 1)
    else:
        dense_row[f - 1] = (v - norm[0, f - 1]) / norm[1, f - 1]
    return e, 0, 0


@njit(cache=True, nogil=True)
def _pad_row(f, last, opts, norm, seeds, dense_row, sparse_row):
    """Fill logical fields f..last of a short line as empty fields."""
    nd = norm.shape[1]
    for g in range(max(f, 1), last + 1):
        if g <= nd:
            dense_row[g - 1] = _empty_dense(norm, g - 1)
        else:
            h = splitmix64_finalise(_seed(seeds, g - 1 - nd))
            sparse_row[g - 1 - nd] = hash_to_id(h, opts[OPT_BUCKET])


@njit(cache=True, nogil=True)
def _parse_line(buf, pos, opts, norm, seeds, dense_row, sparse_row, label_cell):
    """Parse the non-blank line starting at ``pos`` into one row, in a single scan.

    Returns (next_pos, reason, detail); reason 0 means the row is valid, PADDED that it
    is valid with its missing trailing categorical fields read as empty (when
    opts[OPT_PAD] is 1; the label and dense columns must be there).
    A bad row may be partly written; the caller reuses the slot.
    """
    n = buf.shape[0]
    f = 0 if opts[OPT_HAS_LABEL] != 0 else 1  # logical field index
    last = norm.shape[1] + _n_sparse(seeds)
    label_cell[0] = 0.0
    reason = 0
    detail = 0
    s = pos
    while True:
        if reason == 0 and f <= last:
            e, reason, detail = _parse_field(buf, s, f, opts, norm, seeds, dense_row,
                                             sparse_row)
            if f == 0 and reason == 0:
                label_cell[0] = detail
                detail = 0
        else:
            e = _field_end(buf, s)
        f += 1
        if e >= n or buf[e] == 10:
            break
        s = e + 1
    if f != last + 1:  # field count wins over any other complaint
        if (f < last + 1 and f > norm.shape[1] and reason == 0 and opts.shape[0] > OPT_PAD
                and opts[OPT_PAD] != 0):  # label and dense columns there: cats missing
            _pad_row(f, last, opts, norm, seeds, dense_row, sparse_row)
            return e + 1, PADDED, 0
        return e + 1, BAD_FIELDS, f - (0 if opts[OPT_HAS_LABEL] != 0 else 1)
    return e + 1, reason, detail


@njit(cache=True, nogil=True)
def parse_criteo_tsv(buf, opts, norm, seeds, dense, sparse, label, bad, counts):
    """Parse Criteo-layout TSV bytes (``label \t D numbers \t S categoricals`` per line).

    Lines end with LF (an optional CR before it is dropped); a final line without LF
    is parsed too.  Blank lines are skipped (counted in lines, not bad).  A line with
    the wrong field count, a dense field that is not a finite number (Python ``float()``;
    plain integers on a fast path) or a label other than 0/1 is bad: it produces no row
    and is recorded in ``bad`` (first ``bad.shape[0]`` of them).  With ``opts[OPT_PAD]``
    a line that ends early, after its label and dense columns, is read with the missing
    trailing categoricals empty (counted).

    Parameters
    ----------
    buf : (nbytes,) uint8, whole lines
    opts : (2,) or (3,) int64, [has_label (0/1), hash_bucket (0 = full int64 ids), pad]
    norm : (2, D) float64, [cont_min, cont_diff]; dense = (x - min) / diff, empty -> 0;
        or (3, D) with row 2 the value for an empty field (raw mode: [0, 1, nan])
    seeds : (S,) uint64, FNV-1a state each categorical column is hashed from, or None for
        Criteo's C1..C26 (the state after the slot byte 0..25, ``CRITEO_SEEDS``)
    dense : (cap, D) float32 (or float64 for exact raw integer values), out
    sparse : (cap, S) int64, out
    label : (cap,) float32, out (0.0 when there is no label column)
    bad : (bcap, 3) int64, out rows (line 0-based, reason code, detail)
    counts : (3,) or (N_COUNTS,) int64, out [rows, lines, bad, padded, ...]

    Returns
    -------
    int, rows written.  ``cap`` >= number of LF + 1 always suffices.
    """
    n = buf.shape[0]
    cap = dense.shape[0]
    pos = 0
    line = 0
    r = 0
    nb = 0
    npad = 0
    while pos < n:
        if _is_blank(buf, pos):
            pos = _skip_line(buf, pos)
            line += 1
            continue
        if r < cap:
            pos, reason, detail = _parse_line(buf, pos, opts, norm, seeds, dense[r], sparse[r],
                                              label[r:r + 1])
        else:
            pos, reason, detail = _skip_line(buf, pos), BAD_CAPACITY, 0
        if reason <= 0:
            r += 1
            npad += reason == PADDED
        else:
            if nb < bad.shape[0]:
                bad[nb, 0] = line
                bad[nb, 1] = reason
                bad[nb, 2] = detail
            nb += 1
        line += 1
    counts[CNT_ROWS] = r
    counts[CNT_LINES] = line
    counts[CNT_BAD] = nb
    if counts.shape[0] > CNT_PADDED:
        counts[CNT_PADDED] = npad
    return r


@njit(cache=True, nogil=True)
def splitmix64_mix_ids(values, slots, bucket, out):
    """Slot-format ids: mix already-hashed integer values with their slot.

    ``id = splitmix64_finalise(value + (slot + 1) * 0x9E3779B97F4A7C15)`` as int64,
    or ``value % bucket`` (Paddle's raw id) when bucket > 0.

    Parameters
    ----------
    values : (n, k) uint64
    slots : (k,) int64, slot index 0.. per column
    bucket : int
    out : (n, k) int64, out
    """
    golden = np.uint64(0x9E3779B97F4A7C15)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = np.uint64(values[i, j])
            if bucket > 0:
                out[i, j] = np.int64(v % np.uint64(bucket))
            else:
                z = v + np.uint64(slots[j] + 1) * golden
                out[i, j] = np.int64(splitmix64_finalise(z))


@njit(cache=True, nogil=True)
def count_int_values(raw, missing, lo, hist, tails):
    """Accumulate exact counts of integer feature values (for percentile statistics).

    Parameters
    ----------
    raw : (n, k) int32, raw feature values; ``missing`` marks an empty field (skipped)
    missing : int, the missing-value sentinel
    lo : int, the value counted in ``hist[:, 0]``
    hist : (k, w) int64, in/out: ``hist[j, v - lo] += 1`` for ``lo <= v < lo + w``
    tails : (k, 4) int64, in/out per feature: [count below lo, count >= lo + w,
        minimum, maximum] of the non-missing values (start min/max at +-2**62)

    Returns
    -------
    int, non-missing values counted
    """
    w = hist.shape[1]
    total = 0
    for i in range(raw.shape[0]):
        for j in range(raw.shape[1]):
            v = np.int64(raw[i, j])
            if v == missing:
                continue
            total += 1
            d = v - lo
            if d < 0:
                tails[j, 0] += 1
            elif d >= w:
                tails[j, 1] += 1
            else:
                hist[j, d] += 1
            if v < tails[j, 2]:
                tails[j, 2] = v
            if v > tails[j, 3]:
                tails[j, 3] = v
    return total


BYTES_OK = 0  # bytes_column_ids: every element read
BYTES_PAST_END = 1  # an element's 4-byte length (or the length itself) runs past the end
BYTES_FORBIDDEN = 2  # an element holds a TAB, LF, CR or NUL (a TSV field cannot)
BYTES_TRAILING = 3  # bytes left after the n-th element


@njit(cache=True, nogil=True)
def bytes_columns_ids(blob, starts, ends, n, bucket, out, filled):
    """Hash V2 BYTES tensors of ``n`` elements each as Criteo fields: column s is
    ``blob[starts[s]:ends[s]]`` (``starts[s] < 0``: not given, every element empty) and
    hashes as field s (``hash_bytes``).

    The layout is the KServe V2 binary one: each element is a little-endian uint32 length
    followed by that many bytes, with nothing between or after the elements.

    Parameters
    ----------
    blob : (nbytes,) uint8, the columns one after the other
    starts, ends : (S,) int64, each column's byte range in ``blob``
    n : int, elements per column (rows)
    bucket : int, hash_bucket (0 = full int64 range)
    out : (n, S) int64, out
    filled : (n,) uint8, in/out: set to 1 where an element is not empty

    Returns
    -------
    (status, column, element): BYTES_OK, or a BYTES_* code and where
    """
    for s in range(starts.shape[0]):
        if starts[s] < 0:
            h = hash_to_id(splitmix64_finalise(fnv1a_slot(blob, 0, 0, s)), bucket)
            for k in range(n):
                out[k, s] = h
            continue
        pos, size = starts[s], ends[s]
        for k in range(n):
            if pos + 4 > size:
                return BYTES_PAST_END, s, k
            ln = (np.int64(blob[pos]) | (np.int64(blob[pos + 1]) << 8)
                  | (np.int64(blob[pos + 2]) << 16) | (np.int64(blob[pos + 3]) << 24))
            pos += 4
            if pos + ln > size:
                return BYTES_PAST_END, s, k
            for i in range(pos, pos + ln):
                c = blob[i]
                if c == 9 or c == 10 or c == 13 or c == 0:
                    return BYTES_FORBIDDEN, s, k
            out[k, s] = hash_to_id(splitmix64_finalise(fnv1a_slot(blob, pos, pos + ln, s)),
                                   bucket)
            if ln > 0:
                filled[k] = 1
            pos += ln
        if pos != size:
            return BYTES_TRAILING, s, n
    return BYTES_OK, -1, n


@njit(cache=True, nogil=True)
def dense_columns(x, norm, out, filled):
    """Normalise V2 dense tensors as the TSV parser does a field holding each value.

    Parameters
    ----------
    x : (D, n) float32 or float64, one row per dense input; NaN: missing (empty field)
    norm : (2, D) float64, [cont_min, cont_diff]
    out : (n, D) float32, out: (x - min) / diff in float64, stored float32; missing -> 0
    filled : (n,) uint8, out: 1 where a row has a value (0 where every one is missing)

    Returns
    -------
    (input, element) of the first infinite value, or (-1, -1)
    """
    for k in range(x.shape[1]):
        filled[k] = 0
    for d in range(x.shape[0]):
        for k in range(x.shape[1]):
            v = np.float64(x[d, k])
            if np.isnan(v):
                out[k, d] = 0.0
            elif np.isinf(v):
                return d, k
            else:
                out[k, d] = (v - norm[0, d]) / norm[1, d]
                filled[k] = 1
    return -1, -1
