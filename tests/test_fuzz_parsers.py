"""Hypothesis fuzz of the TSV and slot parsers: no crash, counts add up, good lines right.

Each test draws at most MAX_EXAMPLES inputs (random bytes, or valid lines with random
field mutations).  Out-of-bounds reads in the numba kernel are checked separately by
re-running a fixed fuzz corpus in a subprocess compiled with NUMBA_BOUNDSCHECK=1.
"""
import os
import subprocess
import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpips.data.criteo import MAX_BAD_RECORDS, hash_feature, parse_tsv_bytes
from mpips.data.slot import parse_slot_bytes, slot_feature_id

MAX_EXAMPLES = 200
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

field_bytes = st.binary(max_size=12) | st.sampled_from(
    [b"", b"0", b"-3", b"+7", b"12345678901234567890", b"1.5", b"-", b"a\r", b"\r",
     b"68fd1e64", b"\t", b"\n", b"\r\n", b"\x00", b"\xff"])


def split_lines(data: bytes):
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


@st.composite
def tsv_lines(draw):
    """A few valid Criteo lines, some fields replaced, dropped or duplicated."""
    out = []
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))  # valid base lines
    for _ in range(draw(st.integers(1, 4))):
        f = [bytes(rng.choice([b"0", b"1"]))]
        f += [bytes(x) for x in rng.choice([b"", b"0", b"5", b"-2", b"999"], 13)]
        f += [bytes(x) for x in rng.choice([b"", b"a1b2c3d4", b"x"], 26)]
        for _ in range(draw(st.integers(0, 3))):
            i = draw(st.integers(0, len(f) - 1))
            op = draw(st.sampled_from(["set", "drop", "dup"]))
            if op == "set":
                f[i] = draw(field_bytes)
            elif op == "drop" and len(f) > 1:
                f.pop(i)
            else:
                f.insert(i, f[i])
        out.append(b"\t".join(f) + draw(st.sampled_from([b"\n", b"\r\n", b""])))
    if not out[-1].endswith(b"\n"):
        out[-1] += b"\n"
    return b"".join(out)


def is_number(raw: bytes) -> bool:
    """Python's float() reads ``raw`` as a finite value."""
    try:
        return bool(np.isfinite(float(raw)))
    except ValueError:
        return False


def ref_good_rows(data: bytes, has_label=True, pad=False):
    """Sparse ids of the lines a correct parser accepts (plain Python); with ``pad`` a
    line with a good label and all 13 dense fields is read with empty trailing fields."""
    rows, blank = [], 0
    for line in split_lines(data):
        line = line[:-1] if line.endswith(b"\r") else line
        if not line:
            blank += 1
            continue
        f = line.split(b"\t")
        if not has_label:
            f = [b"0"] + f
        if pad and 14 <= len(f) < 40 and f[0] in (b"0", b"1"):
            f += [b""] * (40 - len(f))
        if (len(f) != 40 or f[0] not in (b"0", b"1")
                or any(x and not is_number(x) for x in f[1:14])):
            continue
        rows.append([hash_feature(k, f[14 + k]) for k in range(26)])
    return np.array(rows, np.int64).reshape(-1, 26), blank


def check_tsv(data: bytes, has_label=True, pad=False):
    r = parse_tsv_bytes(data, has_label=has_label, pad=pad)
    want, blank = ref_good_rows(data, has_label, pad)
    assert r.n_lines == len(split_lines(data))
    assert r.n_rows + r.n_bad + blank == r.n_lines
    np.testing.assert_array_equal(r.sparse, want)
    assert r.bad.shape[0] == min(r.n_bad, MAX_BAD_RECORDS)
    assert np.all(np.diff(r.bad[:, 0]) > 0) and np.all(r.bad[:, 0] < max(r.n_lines, 1))
    assert np.all(np.isfinite(r.dense))


@FUZZ
@given(st.binary(max_size=600))
def test_tsv_random_bytes(data):
    check_tsv(data)
    check_tsv(data, has_label=False)


@FUZZ
@given(tsv_lines())
def test_tsv_mutated_lines(data):
    check_tsv(data)
    check_tsv(data, pad=True)
    check_tsv(data, has_label=False, pad=True)


@st.composite
def slot_lines(draw):
    """A few valid slot lines, some tokens replaced, dropped, duplicated or split."""
    out = []
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))  # valid base lines
    for _ in range(draw(st.integers(1, 4))):
        t = [b"click:" + bytes(rng.choice([b"0", b"1"]))]
        t += [b"dense_feature:" + bytes(x) for x in rng.choice([b"0.5", b"0", b"1e-3"], 13)]
        t += [b"%d:%d" % (k, v) for k, v in
              enumerate(rng.integers(0, 2 ** 64 - 1, 26, dtype=np.uint64, endpoint=True)
                        .tolist(), 1)]
        for _ in range(draw(st.integers(0, 3))):
            i = draw(st.integers(0, len(t) - 1))
            op = draw(st.sampled_from(["set", "drop", "dup", "value"]))
            if op == "set":
                t[i] = draw(field_bytes)
            elif op == "drop" and len(t) > 1:
                t.pop(i)
            elif op == "dup":
                t.insert(i, t[i])
            else:
                t[i] = t[i].split(b":")[0] + b":" + draw(field_bytes)
        sep = draw(st.sampled_from([b" ", b"\t", b"  "]))
        out.append(sep.join(t) + draw(st.sampled_from([b"\n", b"\r\n"])))
    return b"".join(out)


def ref_slot_rows(data: bytes):
    """Slot ids of the lines a correct slot parser accepts, and the blank-line count."""
    rows, blank = [], 0
    keys = [b"click"] + [b"dense_feature"] * 13 + [b"%d" % k for k in range(1, 27)]
    for line in split_lines(data):
        toks = line.split()
        if not toks:
            blank += 1
            continue
        if len(toks) != 40:
            continue
        kv = [t.split(b":", 1) for t in toks]
        if any(len(p) != 2 or p[0] != k or not 1 <= len(p[1]) <= 32 for p, k in zip(kv, keys)):
            continue
        if kv[0][1] not in (b"0", b"1"):
            continue
        try:
            dense = [float(p[1]) for p in kv[1:14]]
            ids = [int(p[1]) for p in kv[14:]]
        except ValueError:
            continue
        if not all(np.isfinite(dense)) or not all(0 <= v < 2 ** 64 for v in ids):
            continue
        rows.append([slot_feature_id(k, v) for k, v in enumerate(ids)])
    return np.array(rows, np.int64).reshape(-1, 26), blank


def check_slot(data: bytes):
    r = parse_slot_bytes(data)
    want, blank = ref_slot_rows(data)
    assert r.n_lines == len(split_lines(data))
    assert r.n_rows + r.n_bad + blank == r.n_lines
    np.testing.assert_array_equal(r.sparse, want)
    assert r.bad.shape[0] == min(r.n_bad, MAX_BAD_RECORDS)


@FUZZ
@given(st.binary(max_size=600))
def test_slot_random_bytes(data):
    check_slot(data)


@FUZZ
@given(slot_lines())
def test_slot_mutated_lines(data):
    check_slot(data)


BOUNDS_SCRIPT = r"""
import numpy as np
from mpips.data.criteo import parse_tsv_bytes
rng = np.random.default_rng(0)
alpha = np.frombuffer(b"\t\t\t\t\n\r01-+9a", np.uint8)
line = b"1\t" + b"5\t" * 13 + b"\t".join([b"ab"] * 26)
inputs = [b"", b"\n", b"\r", b"\t", b"1", b"1\t", line, line + b"\r", line + b"\n\r"]
for n in range(1, 160):
    inputs.append(bytes(rng.choice(alpha, n)))
    inputs.append(line[:n % len(line)])
    inputs.append(bytes(rng.integers(0, 256, n, dtype=np.uint8)))
for data in inputs:
    for has_label in (True, False):
        parse_tsv_bytes(data, has_label=has_label)
        parse_tsv_bytes(data, has_label=has_label, hash_bucket=7)
print("BOUNDS-OK", len(inputs))
"""


def test_tsv_kernel_never_reads_out_of_bounds(tmp_path):
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path),
               PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", BOUNDS_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "BOUNDS-OK" in res.stdout
