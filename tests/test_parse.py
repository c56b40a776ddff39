"""Criteo TSV / Paddle slot parsers and the feature hash, against plain-Python references."""
import re
from pathlib import Path

import numpy as np
import pytest

from mpips.data import criteo, slot
from mpips.data.criteo import (CONT_DIFF, CONT_MIN, hash_feature, make_norm, parse_tsv_bytes)
from mpips.kernels import tsv_parse as K

SAMPLE = str(Path(__file__).parent / "data" / "paddle_slot_sample.txt")


# ---------------------------------------------------------------- references
def py_number(raw: bytes):
    """What Python's float() takes for a finite value, else None."""
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if np.isfinite(v) else None


def ref_tsv(data: bytes, has_label=True, hash_bucket=0, lo=CONT_MIN, diff=CONT_DIFF, pad=False,
            padded=None):
    """Plain-Python Criteo parser: (dense, sparse, label, bad [(line, reason, detail)]).

    Dense fields are what float() reads finitely; with ``pad`` a short line gets empty
    trailing fields (its line number appended to ``padded``)."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    want = 39 + (1 if has_label else 0)
    dense, sparse, label, bad = [], [], [], []
    for i, line in enumerate(lines):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            continue
        f = line.split(b"\t")
        if pad and 14 - (0 if has_label else 1) <= len(f) < want and \
                f[0] in ((b"0", b"1") if has_label else (f[0],)):
            f += [b""] * (want - len(f))
            if padded is not None:
                padded.append(i)
        if len(f) != want:
            bad.append((i, K.BAD_FIELDS, len(f)))
            continue
        if not has_label:
            f = [b"0"] + f
        if f[0] not in (b"0", b"1"):
            bad.append((i, K.BAD_LABEL, 0))
            continue
        bad_int = [j for j in range(1, 14) if f[j] and py_number(f[j]) is None]
        if bad_int:
            bad.append((i, K.BAD_INT, bad_int[0]))
            continue
        dense.append([0.0 if not f[j] else (py_number(f[j]) - lo[j - 1]) / diff[j - 1]
                      for j in range(1, 14)])
        sparse.append([hash_feature(k, f[14 + k], hash_bucket) for k in range(26)])
        label.append(float(f[0]) if has_label else 0.0)
    return (np.array(dense, np.float32).reshape(-1, 13), np.array(sparse, np.int64).reshape(-1, 26),
            np.array(label, np.float32), bad)


def check_tsv(data: bytes, **kw):
    r = parse_tsv_bytes(data, **kw)
    padded = []
    d, s, l, bad = ref_tsv(data, kw.get("has_label", True), kw.get("hash_bucket", 0),
                           pad=kw.get("pad", False), padded=padded)
    assert r.padded == len(padded)
    np.testing.assert_array_equal(r.dense, d)
    np.testing.assert_array_equal(r.sparse, s)
    np.testing.assert_array_equal(r.label, l)
    assert r.n_bad == len(bad)
    assert [tuple(b) for b in r.bad.tolist()] == bad[:criteo.MAX_BAD_RECORDS]
    return r


def line(label=b"1", ints=None, cats=None, end=b"\n"):
    ints = ints if ints is not None else [b"1", b"-3", b"", b"7"] + [b""] * 9
    cats = cats if cats is not None else [b"68fd1e64"] * 25 + [b""]
    return b"\t".join([label] + ints + cats) + end


# ---------------------------------------------------------------- hash
def test_hash_golden_values_are_stable():
    # pinned: ids are stored in checkpoints, so the hash must never change
    assert hash_feature(0, b"68fd1e64") == -293622452090429438
    assert hash_feature(1, b"68fd1e64") == -8573133083117075715
    assert hash_feature(25, b"68fd1e64") == 6500791573166208311
    assert hash_feature(3, b"") != hash_feature(4, b"")
    assert 0 <= hash_feature(0, b"68fd1e64", 1000001) < 1000001


def test_hash_kernel_matches_reference():
    rng = np.random.default_rng(1)
    raws = [b"", b"a", b"68fd1e64", bytes(rng.integers(0, 256, 50, dtype=np.uint8))]
    for raw in raws:
        buf = np.frombuffer(b"xx" + raw + b"yy", np.uint8)
        for slot_ in (0, 7, 25):
            h = np.uint64(K.hash_bytes(buf, 2, 2 + len(raw), slot_))
            assert K.hash_to_id(h, 0) == hash_feature(slot_, raw)
            assert K.hash_to_id(h, 1000001) == hash_feature(slot_, raw, 1000001)
            assert K.hash_to_id(h, 7) == hash_feature(slot_, raw, 7)


def test_hash_spreads_over_full_int64_range():
    ids = np.array([hash_feature(k % 26, b"%08x" % k) for k in range(2000)])
    assert (ids < 0).mean() == pytest.approx(0.5, abs=0.06)
    assert len(set(ids.tolist())) == ids.size


# ---------------------------------------------------------------- TSV parser
def test_tricky_lines_match_reference():
    data = b"".join([
        line(),
        line(end=b"\r\n"),  # CRLF
        line(ints=[b"-3"] * 13),  # negative ints
        line(cats=[b""] * 26),  # trailing empty fields
        line(ints=[b"+5", b"00012"] + [b""] * 11),
        b"\n", b"\r\n",  # blank lines: skipped, not bad
        line(label=b"2"),  # bad label
        line(label=b""),  # bad label
        line(ints=[b"1"] * 12 + [b"1x"]),  # non-numeric int
        line(ints=[b"-"] + [b""] * 12),  # sign only
        line(ints=[b"1.5", b"260.0", b" 2e1 ", b"1_0"] + [b""] * 9),  # float() reads these
        line(ints=[b"nan"] + [b""] * 12),  # not finite
        line(ints=[b"1e999"] + [b""] * 12),  # not finite
        line(cats=[b"a"] * 25),  # too few fields
        line(cats=[b"a"] * 27),  # too many fields
        b"garbage\n",
        line(end=b""),  # no trailing newline
    ])
    r = check_tsv(data)
    assert r.n_rows == 7 and r.n_bad == 9 and r.n_lines == 18
    assert r.dense[5, 1] == np.float32((260.0 + 3) / 603)
    r = check_tsv(data, pad=True)  # the line short of categoricals; not 'garbage' (no label)
    assert r.n_rows == 8 and r.padded == 1
    assert r.dense[0, 0] == pytest.approx(0.05) and r.dense[0, 1] == 0.0  # (1-0)/20, (-3+3)/603


def test_hash_bucket_and_no_label_modes():
    data = line() + line(label=b"0", cats=[b"x%d" % i for i in range(26)])
    r = check_tsv(data, hash_bucket=1000001)
    assert r.sparse.min() >= 0 and r.sparse.max() < 1000001
    nolab = b"".join(l.split(b"\t", 1)[1] for l in data.splitlines(keepends=True))
    r2 = check_tsv(nolab + line(), has_label=False)  # a 40-field line is bad here
    assert r2.n_rows == 2 and r2.n_bad == 1 and np.all(r2.label == 0)
    np.testing.assert_array_equal(r2.sparse, parse_tsv_bytes(data).sparse)


def test_empty_input_and_only_blank_lines():
    for data in (b"", b"\n", b"\r\n\r\n", b"\r"):
        r = check_tsv(data)
        assert r.n_rows == 0 and r.n_bad == 0


def test_garbage_bytes_do_not_crash():
    rng = np.random.default_rng(7)
    junk = bytes(rng.integers(0, 256, 200_000, dtype=np.uint8))
    r = check_tsv(junk + b"\n" + line() + junk[:1000])
    assert r.n_rows >= 1 and r.n_bad > 0
    # tabs-heavy garbage with the right field count goes through the full field parser
    tabby = bytes(rng.choice(np.frombuffer(b"\t\t\t\n01-+9a\r", np.uint8), 100_000))
    check_tsv(tabby)


def test_custom_normalisation_and_validation():
    lo = np.arange(13.0)
    diff = np.full(13, 2.0)
    data = line(ints=[b"10"] * 13)
    r = parse_tsv_bytes(data, norm=make_norm(lo, diff))
    np.testing.assert_allclose(r.dense[0], (10 - lo) / 2)
    with pytest.raises(ValueError, match="13 values"):
        make_norm(np.zeros(12), None)
    with pytest.raises(ValueError, match="non-zero"):
        make_norm(None, np.zeros(13))
    with pytest.raises(ValueError, match="hash_bucket"):
        parse_tsv_bytes(data, hash_bucket=-1)


def test_bad_record_capacity_counts_all():
    data = b"x\n" * (criteo.MAX_BAD_RECORDS + 10)
    r = parse_tsv_bytes(data)
    assert r.n_bad == criteo.MAX_BAD_RECORDS + 10 and r.bad.shape == (criteo.MAX_BAD_RECORDS, 3)


_TOKENS = [b"", b"0", b"1", b"-3", b"+7", b"12", b"x", b"68fd1e64", b"\r", b"-", b"\x00\xff"]


def test_random_lines_match_reference():
    rng = np.random.default_rng(11)
    for _ in range(150):
        parts = []
        for _ in range(rng.integers(0, 7)):
            toks = [_TOKENS[i] for i in rng.integers(0, len(_TOKENS), rng.integers(37, 43))]
            parts.append(b"\t".join(toks) + [b"\n", b"\r\n"][rng.integers(0, 2)])
        data = b"".join(parts)
        if rng.random() < 0.3:
            data = data.rstrip(b"\r\n")  # last line without newline
        check_tsv(data)
        check_tsv(data, has_label=False, hash_bucket=97)


def test_describe_bad_messages():
    assert "expected 40" in criteo.describe_bad(K.BAD_FIELDS, 3)
    assert "expected 39" in criteo.describe_bad(K.BAD_FIELDS, 3, has_label=False)
    assert "I4" in criteo.describe_bad(K.BAD_INT, 4)
    assert "label" in criteo.describe_bad(K.BAD_LABEL, 0)


# ---------------------------------------------------------------- slot format
def ref_slot(data: bytes, hash_bucket=0):
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    dense, sparse, label, bad = [], [], [], []
    for i, ln in enumerate(lines):
        toks = ln.split()
        if not toks:
            continue
        if len(toks) != 40:
            bad.append((i, criteo.BAD_SLOT_TOKENS, len(toks)))
            continue
        kv = [t.partition(b":") for t in toks]
        keys_ok = [sep == b":" and k == slot.KEYS[j] for j, (k, sep, _) in enumerate(kv)]
        if not all(keys_ok):
            bad.append((i, criteo.BAD_SLOT_KEY, keys_ok.index(False)))
            continue
        vals = [v for _, _, v in kv]
        ok = [vals[0] in (b"0", b"1")] + [_float_ok(v) for v in vals[1:14]] + \
             [_uint_ok(v) for v in vals[14:]]
        if not all(ok):
            bad.append((i, criteo.BAD_SLOT_VALUE, ok.index(False)))
            continue
        label.append(float(vals[0]))
        dense.append([float(v) for v in vals[1:14]])
        sparse.append([slot.slot_feature_id(k, int(vals[14 + k]), hash_bucket) for k in range(26)])
    return (np.array(dense, np.float32).reshape(-1, 13), np.array(sparse, np.int64).reshape(-1, 26),
            np.array(label, np.float32), bad)


def _float_ok(v):
    try:
        return np.isfinite(float(v)) and len(v) <= slot.MAX_VALUE_BYTES
    except ValueError:
        return False


def _uint_ok(v):
    try:
        return 0 <= int(v) < 2**64 and len(v) <= slot.MAX_VALUE_BYTES
    except ValueError:
        return False


def check_slot(data, hash_bucket=0):
    r = slot.parse_slot_bytes(data, hash_bucket=hash_bucket)
    d, s, l, bad = ref_slot(data, hash_bucket)
    np.testing.assert_array_equal(r.dense, d)
    np.testing.assert_array_equal(r.sparse, s)
    np.testing.assert_array_equal(r.label, l)
    assert [tuple(b) for b in r.bad.tolist()] == bad[:criteo.MAX_BAD_RECORDS]
    assert r.n_bad == len(bad)
    return r


def test_slot_sample_matches_reference():
    data = open(SAMPLE, "rb").read()
    r = check_slot(data)
    assert r.n_rows == 80 and r.n_bad == 0
    r2 = check_slot(data, hash_bucket=1000001)
    assert r2.sparse[0, 0] == 737395  # Paddle's own id kept in bucket mode
    assert r.sparse[0, 0] != r.sparse[0, 1]


def test_slot_tricky_lines():
    good = open(SAMPLE, "rb").read().split(b"\n")[:3]
    data = b"\n".join([
        good[0] + b"\r",  # CRLF
        b"", b"   ",  # blank
        good[1].replace(b"5:", b"9:"),  # wrong key
        good[1].replace(b"click:1", b"click:2"),  # bad label
        good[2].replace(b"dense_feature:0.0 ", b"dense_feature:nan ", 1),  # non-finite
        good[2].replace(b" 3:", b" 3:-", 1),  # negative id
        re.sub(rb" 3:[0-9]+", b" 3:18446744073709551616", good[2]),  # > uint64
        re.sub(rb" 3:[0-9]+", b" 3:18446744073709551615", good[2]),  # max uint64 is fine
        good[2].replace(b" 3:", b" 3", 1),  # no colon
        b"click:0 1:2",  # too few tokens
        b"\x00\xff garbage",
        good[0],  # no trailing newline
    ])
    r = check_slot(data)
    assert r.n_rows == 3


def test_slot_garbage_and_empty():
    rng = np.random.default_rng(3)
    check_slot(bytes(rng.integers(0, 256, 50_000, dtype=np.uint8)))
    assert check_slot(b"").n_rows == 0
