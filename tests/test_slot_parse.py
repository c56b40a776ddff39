"""The numba slot-format kernel vs the former vectorised-numpy parser and Python float()/int().

``old_parse_slot_bytes`` below is a verbatim copy of the numpy implementation that
``mpips.data.slot.parse_slot_bytes`` used before the kernel; the new parser must give
the same rows, ids, labels, bad-line records and counts.  One deliberate difference: the
old parser viewed values as numpy ``S`` strings, which drop trailing NUL bytes, so it
accepted e.g. ``1:5\x00``; the kernel (like Python's ``int()``/``float()`` and the fuzz
reference in test_fuzz_parsers.py) rejects it.  Comparisons with the old parser
therefore use inputs without NUL bytes, and ``test_nul_in_value_is_bad`` pins the rule.
"""
import struct
from decimal import Decimal
from pathlib import Path

import numpy as np

from mpips.data import criteo
from mpips.data.criteo import (BAD_SLOT_KEY, BAD_SLOT_TOKENS, BAD_SLOT_VALUE,
                               MAX_BAD_RECORDS, N_DENSE, N_SPARSE, ParseResult, as_uint8)
from mpips.data.slot import parse_slot_bytes, slot_feature_id
from mpips.kernels import number_parse as N
from mpips.kernels import slot_parse as S
from mpips.kernels import tsv_parse as K

SAMPLE = str(Path(__file__).parent / "data" / "paddle_slot_sample.txt")
N_TOKENS = 1 + N_DENSE + N_SPARSE
KEYS = [b"click"] + [b"dense_feature"] * N_DENSE + [str(k).encode() for k in range(1, 27)]
MAX_VALUE_BYTES = 32


# ------------------------------------------------- reference: the former numpy parser
_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 11, 12, 13, 32]] = True  # bytes.split() whitespace
_KEY_LEN = np.array([len(k) for k in KEYS], dtype=np.int64)  # (40,)
_KEY_W = int(_KEY_LEN.max())
_KEY_MAT = np.zeros((N_TOKENS, _KEY_W), dtype=np.uint8)  # (40, 13) padded keys
for _j, _k in enumerate(KEYS):
    _KEY_MAT[_j, :len(_k)] = np.frombuffer(_k, dtype=np.uint8)
_KEY_MASK = np.arange(_KEY_W)[None, :] < _KEY_LEN[:, None]  # (40, 13)
_GROUPS = ((0, 1), (1, 1 + N_DENSE), (1 + N_DENSE, N_TOKENS))  # label, dense, slot columns


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


def old_parse_slot_bytes(data, *, hash_bucket: int = 0) -> ParseResult:
    """The former vectorised-numpy parse_slot_bytes, verbatim."""
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


# ---------------------------------------------------------------- helpers
def check_same(data: bytes, hash_bucket: int = 0) -> ParseResult:
    """New parser == old parser on ``data`` (dense compared bit for bit)."""
    new = parse_slot_bytes(data, hash_bucket=hash_bucket)
    with np.errstate(over="ignore"):  # e.g. 1e39 -> float32 inf, in both parsers
        old = old_parse_slot_bytes(data, hash_bucket=hash_bucket)
    assert new.dense.dtype == np.float32 and new.dense.shape == old.dense.shape
    np.testing.assert_array_equal(new.dense.view(np.uint32), old.dense.view(np.uint32))
    np.testing.assert_array_equal(new.sparse, old.sparse)
    np.testing.assert_array_equal(new.label, old.label)
    assert new.bad.tolist() == old.bad.tolist()
    assert (new.n_lines, new.n_bad, new.n_rows) == (old.n_lines, old.n_bad, old.n_rows)
    return new


def _float_tokens(rng, n):
    """Float spellings: repr / %g of random doubles, short decimals, exponents, edges."""
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)
    out = []
    for i, v in enumerate(x.tolist()):
        k = i % 8
        if k == 0:
            out.append(repr(v))
        elif k == 1:
            out.append("%.12g" % v)
        elif k == 2:
            out.append("%.*f" % (int(rng.integers(0, 8)), abs(v) % 1000))
        elif k == 3:
            out.append("%.*e" % (int(rng.integers(0, 18)), v))
        elif k == 4:
            out.append(repr(float(rng.random())))
        else:
            out.append(str(rng.choice(EDGE_FLOATS)))
    return [s.encode() for s in out]


EDGE_FLOATS = ["0", "-0", "+0.0", ".5", "5.", "-.5e-3", "1E5", "1e+05", "00.5", "1_000.5",
               "1.5_5", "1e1_0", "9007199254740993", "9007199254740995", "1e22", "1e23",
               "8.98846567431158e307", "1.7976931348623157e308", "4.9e-324", "2.5e-324",
               "2.4e-324", "1e-400", "0e999999", "123456789012345678901234567890",
               "0.000000000000000000000000000001", "2.2250738585072011e-308",
               "2.2250738585072014e-308", "3.4028235677973366e38", "1e39", "-1e39"]


def _valid_line(rng, crlf=False) -> bytes:
    t = [b"click:" + (b"1" if rng.random() < 0.5 else b"0")]
    t += [b"dense_feature:" + f for f in _float_tokens(rng, N_DENSE)]
    ids = rng.integers(0, 2 ** 64 - 1, N_SPARSE, dtype=np.uint64, endpoint=True).tolist()
    for k, v in enumerate(ids, 1):
        s = [str(v), str(v % 1000), "+%d" % v, "00%d" % (v % 99), "-0", "1_000",
             "18446744073709551615"][int(rng.integers(0, 7))]
        t.append(b"%d:%s" % (k, s.encode()))
    sep = [b" ", b"\t", b"  ", b" \x0b"][int(rng.integers(0, 4))]
    return sep.join(t) + (b"\r\n" if crlf else b"\n")


MUT_ALPHABET = b"0123456789.eE+-_: \t\r\n\x0b\x0cxnaifclk\xff\x01"


def _mutate(rng, line: bytes) -> bytes:
    b = bytearray(line)
    for _ in range(int(rng.integers(1, 4))):
        i = int(rng.integers(0, len(b) + 1))
        op = int(rng.integers(0, 4))
        ch = MUT_ALPHABET[int(rng.integers(0, len(MUT_ALPHABET)))]
        if op == 0 and i < len(b):
            b[i] = ch
        elif op == 1:
            b.insert(i, ch)
        elif op == 2 and i < len(b):
            del b[i]
        else:  # lengthen a value past MAX_VALUE_BYTES or duplicate a piece
            b[i:i] = b"7" * int(rng.integers(1, 40))
    return bytes(b)


def _spans(tokens):
    lens = np.array([len(t) for t in tokens], dtype=np.int64)
    ends = np.cumsum(lens)
    return np.frombuffer(b"".join(tokens) + b" ", np.uint8), ends - lens, ends


def kernel_floats(tokens):
    buf, s, e = _spans(tokens)
    res = [N.parse_float(buf, i, j) for i, j in zip(s.tolist(), e.tolist())]
    return np.array([r[0] for r in res], bool), np.array([r[1] for r in res])


def py_float(t: bytes):
    try:
        v = float(t)
    except ValueError:
        return False, 0.0
    return bool(np.isfinite(v)), v


def bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", v))[0]


# ---------------------------------------------------------------- tests
def test_codes_match_criteo():
    assert (S.BAD_SLOT_TOKENS, S.BAD_SLOT_KEY, S.BAD_SLOT_VALUE) == (
        BAD_SLOT_TOKENS, BAD_SLOT_KEY, BAD_SLOT_VALUE)
    assert S.MAX_VALUE_BYTES == MAX_VALUE_BYTES and S.N_TOKENS == N_TOKENS


def test_sample_file_same_as_old():
    data = open(SAMPLE, "rb").read()
    r = check_same(data)
    assert r.n_rows == 80 and r.n_bad == 0
    r2 = check_same(data, hash_bucket=1000001)
    assert r2.sparse[0, 0] == 737395
    assert r.sparse[0, 3] == slot_feature_id(3, 286224)
    check_same(data, hash_bucket=7)


def test_random_valid_lines_same_as_old():
    rng = np.random.default_rng(11)
    lines = [_valid_line(rng, crlf=i % 5 == 0) for i in range(600)]
    data = b"".join(lines)
    for hb in (0, 1000001):
        r = check_same(data, hash_bucket=hb)
    assert r.n_bad == 0 and r.n_rows == 600
    check_same(data[:-1])  # last line without LF
    check_same(b"\n  \r\n" + data + b"\t\n")  # blank lines


def test_mutated_lines_same_as_old():
    rng = np.random.default_rng(12)
    base = [_valid_line(rng) for _ in range(60)]
    for rep in range(6):
        lines = [_mutate(rng, ln) if rng.random() < 0.7 else ln for ln in base]
        r = check_same(b"".join(lines), hash_bucket=rep % 2 * 1009)
        assert r.n_bad > 0 and r.n_rows > 0
    # more than MAX_BAD_RECORDS bad lines
    r = check_same(b"".join(_mutate(rng, ln) for ln in base * 3))
    assert r.n_bad > MAX_BAD_RECORDS == r.bad.shape[0]


def test_garbage_same_as_old():
    rng = np.random.default_rng(13)
    raw = rng.integers(1, 256, 40_000, dtype=np.uint8)  # no NUL (see module docstring)
    check_same(raw.tobytes())
    alpha = np.frombuffer(b"0123456789:. \n\te-_click", np.uint8)
    check_same(rng.choice(alpha, 40_000).tobytes())
    for data in (b"", b"\n", b" ", b"\r\n\r\n", b"click:1", b":", b"1:", b"click:0 " * 40,
                 b"dense_feature:", b"26:"):
        check_same(data)


def test_specific_bad_lines():
    good = open(SAMPLE, "rb").read().split(b"\n")[0]
    toks = good.split(b" ")

    def line_with(i, tok):
        t = list(toks)
        t[i] = tok
        return b" ".join(t)

    cases = [  # (line, reason, detail)
        (b"click:0 1:2", BAD_SLOT_TOKENS, 2),
        (good + b" 27:1", BAD_SLOT_TOKENS, 41),
        (line_with(5, b"dense_feature0.5"), BAD_SLOT_KEY, 5),
        (line_with(20, b"07:5"), BAD_SLOT_KEY, 20),
        (line_with(39, b"26x:5"), BAD_SLOT_KEY, 39),
        (line_with(0, b"click:2"), BAD_SLOT_VALUE, 0),
        (line_with(0, b"click:01"), BAD_SLOT_VALUE, 0),
        (line_with(3, b"dense_feature:nan"), BAD_SLOT_VALUE, 3),
        (line_with(3, b"dense_feature:1e309"), BAD_SLOT_VALUE, 3),
        (line_with(3, b"dense_feature:1__0"), BAD_SLOT_VALUE, 3),
        (line_with(3, b"dense_feature:" + b"1" * 33), BAD_SLOT_VALUE, 3),
        (line_with(14, b"1:-1"), BAD_SLOT_VALUE, 14),
        (line_with(14, b"1:18446744073709551616"), BAD_SLOT_VALUE, 14),
        (line_with(14, b"1:1:2"), BAD_SLOT_VALUE, 14),
        (line_with(14, b"1:"), BAD_SLOT_VALUE, 14),
    ]
    # a bad key after a bad value wins
    both = line_with(30, b"x:1").replace(b"click:0", b"click:5")
    cases.append((both, BAD_SLOT_KEY, 30))
    data = b"\n".join(c[0] for c in cases) + b"\n"
    r = check_same(data)
    assert r.n_rows == 0
    assert r.bad.tolist() == [[i, c[1], c[2]] for i, c in enumerate(cases)]
    assert [criteo.describe_bad(int(b[1]), int(b[2])) for b in r.bad[-2:]] == [
        "bad value in token 15", "unexpected key in token 31"]


def test_nul_in_value_is_bad():
    good = open(SAMPLE, "rb").read().split(b"\n")[0]
    for bad in (good.replace(b"1:737395", b"1:737395\x00"),
                good.replace(b"click:0", b"click:0\x00"),
                good.replace(b"dense_feature:0.05", b"dense_feature:0.05\x00")):
        r = parse_slot_bytes(bad)
        assert r.n_rows == 0 and r.bad[0, 1] == BAD_SLOT_VALUE


def test_parse_float_matches_python_float():
    rng = np.random.default_rng(14)
    toks = _float_tokens(rng, 20_000)
    # 1..19 significant digits over the whole exponent range, incl. subnormals
    for nd in range(1, 20):
        for ex in rng.integers(-345, 310, 60).tolist():
            m = int(rng.integers(10 ** (nd - 1), 10 ** nd, dtype=np.uint64))
            toks.append(b"%de%d" % (m, ex - nd + 1))
    # exact halfway cases between doubles (ties to even), <= 19 digits: odd 54-bit n
    # times 2**t (integers) or over 2**u (decimals ending in 5, 25, 125)
    for n in (2 ** 53 + 2 * rng.integers(0, 2 ** 52, 40, dtype=np.int64) + 1).tolist():
        toks += [str(n << t).encode() for t in range(10)]
        toks += [str(Decimal(n) / Decimal(2 ** u)).encode() for u in (1, 2, 3)]
    for v in rng.standard_normal(200).tolist() + [1.0, 2.0 ** 53, 5e-324, 1e307]:
        toks.append(repr(np.nextafter(v, np.inf)).encode())
    toks += [b"9007199254740993", b"2.4703282292062327e-324",
             b"2.4703282292062328e-324", b"1.7976931348623158e308", b"1.797693134862316e308",
             b"", b"+", b"-", b".", b"e5", b"1e", b"1e+", b"1.2.3", b"1_", b"_1", b"1_.5",
             b"1._5", b"1e_5", b"1_e5", b"inf", b"-Infinity", b"nan", b"0x10", b"1,5", b"1d5",
             b"--1", b"1e+-5", b"\xff", b"1.5\x00"]
    ok, vals = kernel_floats(toks)
    for t, k_ok, k_v in zip(toks, ok.tolist(), vals.tolist()):
        p_ok, p_v = py_float(t)
        assert k_ok == p_ok, t
        if p_ok:
            assert bits(k_v) == bits(p_v), (t, k_v, p_v)


def test_parse_float_long_mantissas_float32_exact():
    """> 19 significant digits: exact after the float32 rounding (module docstring)."""
    rng = np.random.default_rng(15)
    toks = []
    for _ in range(3000):
        nd = int(rng.integers(20, 31))
        digits = "".join(rng.choice(list("0123456789"), nd))
        toks.append(b"%s.%se%d" % (digits[:1].encode(), digits[1:].encode(),
                                   int(rng.integers(-320, 300))))
    toks.append(b"9007199254740993.0000000001")  # float64 1 ulp low, float32 exact
    ok, vals = kernel_floats(toks)
    want = np.array([float(t) for t in toks])
    np.testing.assert_array_equal(ok, np.isfinite(want))
    with np.errstate(over="ignore"):  # > 3.4e38 -> float32 inf, as in the parser
        np.testing.assert_array_equal(vals.astype(np.float32).view(np.uint32)[ok],
                                      want.astype(np.float32).view(np.uint32)[ok])


def test_parse_uint64_matches_python_int():
    toks = [b"0", b"-0", b"+0", b"+5", b"007", b"1_0", b"0_0", b"1__0", b"_1", b"1_", b"-1",
            b"+", b"-", b"", b"18446744073709551615", b"18446744073709551616",
            b"99999999999999999999", b"000000000000000000000000000005", b"1e3", b"1.0",
            b"0x10", b"12a", b"1_8446744073709551615", b"-0_0"]
    rng = np.random.default_rng(16)
    toks += [str(v).encode() for v in rng.integers(0, 2 ** 64 - 1, 500, dtype=np.uint64,
                                                   endpoint=True).tolist()]
    buf, s, e = _spans(toks)
    res = [N.parse_uint64(buf, i, j) for i, j in zip(s.tolist(), e.tolist())]
    for t, (k_ok, k_v) in zip(toks, res):
        try:
            p = int(t)
            p_ok = 0 <= p < 2 ** 64
        except ValueError:
            p_ok = False
        assert k_ok == p_ok, t
        if p_ok:
            assert k_v == p, t


def test_capacity_guard():
    data = open(SAMPLE, "rb").read()
    buf = as_uint8(data)
    dense = np.empty((5, N_DENSE), np.float32)
    sparse = np.empty((5, N_SPARSE), np.int64)
    label = np.empty(5, np.float32)
    bad = np.empty((MAX_BAD_RECORDS, 3), np.int64)
    counts = np.zeros(3, np.int64)
    n = S.parse_slot(buf, 0, dense, sparse, label, bad, counts)
    assert n == 5 and counts[K.CNT_BAD] == 75 and bad[0, 1] == K.BAD_CAPACITY
    ref = parse_slot_bytes(data)
    np.testing.assert_array_equal(sparse, ref.sparse[:5])
