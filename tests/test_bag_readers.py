"""Schema readers (slot, MultiSlot, CSV, positional Criteo) against plain-Python parsers.

Each generated file is read by ``DataReader(schema=...)`` and by a reference written with
``bytes.split``, ``float()``, ``int()`` and the ``csv`` module; ids, bag layout, dense
values, labels, bad lines and the padded / undeclared / truncated counts must agree.
"""
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpips.data import bags
from mpips.data.criteo import hash_feature, splitmix64_finalise
from mpips.data.reader import DataReader
from mpips.data.slot import parse_slot_bytes
from mpips.schema import DenseGroup, Schema, SparseGroup, load_schema

DATA = Path(__file__).parent / "data"
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GOLDEN = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1


# ---------------------------------------------------------------- references
def signed(h):
    return h - (1 << 64) if h >= (1 << 63) else h


def feasign_id(v, salt, bucket=0, raw=False):
    if bucket:
        return v % bucket
    if raw:
        return signed(v)
    return signed(splitmix64_finalise((v + (salt & M64) * GOLDEN) & M64))


def text_id(seed, raw: bytes, bucket=0):
    h = seed
    for b in raw:
        h = ((h ^ b) * 0x100000001B3) & M64
    h = splitmix64_finalise(h)
    return h % bucket if bucket else signed(h)


def py_float(raw):
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def py_uint(raw):
    try:
        v = int(raw)
    except ValueError:
        return None
    return v if 0 <= v < (1 << 64) else None


def finish(schema, raw_rows, lo=None, diff=None):
    """Reference dense normalisation: (n, D) float32."""
    norms, fills = schema.dense_options("norm"), schema.dense_options("fill")
    out = []
    for row in raw_rows:
        vals = []
        for j, x in enumerate(row):
            if x is None:
                vals.append(fills[j])
            elif norms[j] == "log1p":
                vals.append(math.copysign(math.log1p(abs(x)), x) if x else 0.0)
            elif norms[j] == "minmax":
                vals.append((x - lo[j]) / diff[j])
            else:
                vals.append(x)
        out.append(vals)
    return np.array(out, dtype=np.float64).astype(np.float32).reshape(len(out), schema.n_dense)


class Ref:
    """Expected rows: dense (raw, None = missing), bags (list of S lists), labels."""

    def __init__(self):
        self.dense, self.bags, self.label, self.bad = [], [], [], []
        self.undeclared = self.truncated = 0

    def add(self, schema, dense, bags_, label, und):
        trunc = 0
        for s, ml in enumerate(schema.slot_options("max_len")):
            if ml and len(bags_[s]) > ml:
                bags_[s] = bags_[s][:ml]
                trunc += 1
        self.dense.append(dense)
        self.bags.append(bags_)
        self.label.append(label)
        self.undeclared += und
        self.truncated += trunc


def dense_positions(schema):
    """{name: (first column, dim)} of the schema's dense slots, in schema order."""
    at, pos = {}, 0
    for g in schema.dense:
        for n in g.names:
            at[n] = (pos, g.dim)
            pos += g.dim
    return at


def ref_slot(data: bytes, schema: Schema, has_label=True, bucket=0):
    S = schema.n_sparse
    dense_at = {n.encode(): v for n, v in dense_positions(schema).items()}
    slot_of = {n.encode(): s for s, n in enumerate(schema.sparse_names)}
    salts = schema.feasign_salts()
    label_key = schema.label.encode() if schema.label else None
    ref = Ref()
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    for i, line in enumerate(lines):
        toks = line.split()
        if not toks:
            continue
        dense, bags_, label = [None] * schema.n_dense, [[] for _ in range(S)], 0.0
        seen, und, ok = {}, 0, True
        for t in toks:
            if b":" not in t:
                ok = False
                break
            if schema.token_order == "feasign:slot":
                v, _, k = t.rpartition(b":")
            else:
                k, _, v = t.partition(b":")
            if k == label_key:
                x = py_float(v)
                ok = x in (0.0, 1.0)
                label = x
                seen[k] = seen.get(k, 0) + 1
            elif k in dense_at:
                at, dim = dense_at[k]
                q = seen.get(k, 0)
                seen[k] = q + 1
                if q < dim:
                    x = py_float(v)
                    ok = x is not None
                    dense[at + q] = x
            elif k in slot_of:
                x = py_uint(v)
                ok = x is not None
                if ok:
                    s = slot_of[k]
                    bags_[s].append(feasign_id(x, salts[s], bucket, schema.raw_ids))
            else:
                und += 1
            if not ok:
                break
        if ok:
            ok = all(seen.get(k, 0) in (0, dim) for k, (_, dim) in dense_at.items())
        if ok and has_label and label_key is not None:
            ok = seen.get(label_key, 0) == 1
        if not ok:
            ref.bad.append(i)
            continue
        ref.add(schema, dense, bags_, label if has_label else 0.0, und)
    return ref


# ---------------------------------------------------------------- checking
def read_all(path, schema, **kw):
    rd = DataReader(str(path), 7, schema=schema, prefetch=False, warn=lambda m: None,
                    chunk_bytes=kw.pop("chunk_bytes", 300), **kw)
    batches = list(rd)
    if not batches:
        return None, rd
    whole = bags.concat([(b.dense, b.sparse, b.label, b.offsets) for b in batches])
    return whole, rd


def check(path, schema, ref: Ref, lo=None, diff=None, **kw):
    got, rd = read_all(path, schema, **kw)
    assert rd.stats.bad_lines == len(ref.bad)
    assert rd.stats.undeclared == ref.undeclared
    assert rd.stats.truncated == ref.truncated
    if got is None:
        assert not ref.label
        return rd
    dense, sparse, label, offsets = got
    S = schema.n_sparse
    assert offsets is not None and offsets.shape == (len(ref.label) * S + 1,)
    want_bags = [b for row in ref.bags for b in row]
    got_bags = [sparse[offsets[k]:offsets[k + 1]].tolist() for k in range(len(want_bags))]
    assert got_bags == want_bags
    np.testing.assert_array_equal(label, np.array(ref.label, np.float32))
    np.testing.assert_array_equal(dense, finish(schema, ref.dense, lo, diff))
    return rd


# ---------------------------------------------------------------- slot text
def slot_schema(order="slot:feasign", max_len=0, raw_ids=False):
    return Schema(format="slot", label="click", token_order=order, raw_ids=raw_ids,
                  dense=(DenseGroup(("d1",), dim=2, fill=-1.0, norm="none"),
                         DenseGroup(("dlog",), norm="log1p")),
                  sparse=(SparseGroup(("101", "user_tag"), max_len=max_len),
                          SparseGroup(("7",), pooling="mean")))


@st.composite
def slot_text(draw, order):
    """Lines of tokens in any order: repeated and missing slots, undeclared slots, a few
    broken tokens, both token orders."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    lines = []
    for _ in range(draw(st.integers(1, 12))):
        toks = [(b"click", rng.choice([b"0", b"1", b"1.0"]))]
        if rng.random() < 0.8:
            toks += [(b"d1", b"%g" % rng.normal()) for _ in range(2 if rng.random() < 0.9 else 1)]
        if rng.random() < 0.7:
            toks.append((b"dlog", b"%d" % rng.integers(-50, 50)))
        for name in (b"101", b"user_tag", b"7", b"999"):
            for _ in range(rng.integers(0, 4)):
                toks.append((name, b"%d" % rng.integers(0, 2 ** 63)))
        order_ = rng.permutation(len(toks))
        toks = [toks[j] for j in order_]
        if rng.random() < 0.1:
            toks.append((b"7", rng.choice([b"-1", b"x", b"1.5", b"", b"18446744073709551616"])))
        if rng.random() < 0.05:
            toks = [t for t in toks if t[0] != b"click"]
        words = [k + b":" + v if order == "slot:feasign" else v + b":" + k for k, v in toks]
        if rng.random() < 0.05:
            words.append(b"nocolon")
        sep = rng.choice([b" ", b"\t", b"  "])
        lines.append(sep.join(words) + rng.choice([b"\n", b"\r\n"]))
    if rng.random() < 0.3:
        lines.insert(int(rng.integers(0, len(lines))), b"\n")
    return b"".join(lines)


@FUZZ
@given(st.data())
def test_slot_text_matches_reference(tmp_path, data):
    order = data.draw(st.sampled_from(["slot:feasign", "feasign:slot"]))
    schema = slot_schema(order, max_len=data.draw(st.sampled_from([0, 2])),
                         raw_ids=data.draw(st.booleans()))
    text = data.draw(slot_text(order))
    p = tmp_path / "part.txt"
    p.write_bytes(text)
    check(p, schema, ref_slot(text, schema))
    bucket = 1000
    check(p, schema, ref_slot(text, schema, bucket=bucket), hash_bucket=bucket)


def test_paddle_sample_reads_with_its_schema_and_keeps_todays_ids():
    schema = load_schema(str(DATA / "paddle_slot.toml"))
    sample = DATA / "paddle_slot_sample.txt"
    rd = check(sample, schema, ref_slot(sample.read_bytes(), schema))
    assert rd.stats.bad_lines == 0 and rd.stats.rows == 80
    got, _ = read_all(sample, schema)
    today = parse_slot_bytes(sample.read_bytes())  # the Criteo slot reader (one-hot)
    np.testing.assert_array_equal(got[1].reshape(-1, 26), today.sparse)
    np.testing.assert_array_equal(got[0], today.dense)


def test_slot_undeclared_and_truncated_are_reported(tmp_path):
    schema = slot_schema(max_len=1)
    p = tmp_path / "a.txt"
    p.write_bytes(b"click:1 101:5 101:6 999:1 d1:1 d1:2\n")
    msgs = []
    rd = DataReader(str(p), 4, schema=schema, prefetch=False, warn=msgs.append)
    (b,) = list(rd)
    assert rd.stats.undeclared == 1 and rd.stats.truncated == 1
    assert any("1 tokens of slots the schema does not declare" in m for m in msgs)
    assert b.offsets.tolist() == [0, 1, 1, 1]
    assert b.sparse.tolist() == [feasign_id(5, 101)]


# ---------------------------------------------------------------- MultiSlot
def ms_schema(max_len=0):
    return Schema(format="multislot", label="label",
                  fields=("dense_feature", "C1", "unused", "tags", "label"),
                  dense=(DenseGroup(("dense_feature",), dim=3, fill=0.5, norm="none"),),
                  sparse=(SparseGroup(("C1", "tags"), max_len=max_len),))


def ref_multislot(data: bytes, schema: Schema, has_label=True, bucket=0):
    kinds = {schema.label: "label"}
    kinds.update((n, ("dense", at, dim)) for n, (at, dim) in dense_positions(schema).items())
    for s, n in enumerate(schema.sparse_names):
        kinds[n] = ("sparse", s)
    salts = schema.feasign_salts()
    ref = Ref()
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    for i, line in enumerate(lines):
        toks = line.split()
        if not toks:
            continue
        dense, bags_, label = [None] * schema.n_dense, [[] for _ in range(schema.n_sparse)], 0.0
        t, ok = 0, True
        for f in schema.fields:
            c = py_uint(toks[t]) if t < len(toks) else None
            kind = kinds.get(f, "skip")
            if c is None or t + 1 + c > len(toks) or (kind == "label" and c != 1) or \
                    (kind[0] == "dense" and c not in (0, kind[2])):
                ok = False
                break
            vals = toks[t + 1:t + 1 + c]
            t += 1 + c
            if kind == "label":
                x = py_float(vals[0]) if has_label else 0.0
                ok = x in (0.0, 1.0)
                label = x
            elif kind[0] == "dense":
                xs = [py_float(v) for v in vals]
                ok = None not in xs
                dense[kind[1]:kind[1] + len(xs)] = xs
            elif kind[0] == "sparse":
                xs = [py_uint(v) for v in vals]
                ok = None not in xs
                if ok:
                    bags_[kind[1]] = [feasign_id(x, salts[kind[1]], bucket) for x in xs]
            if not ok:
                break
        if not ok or t != len(toks):
            ref.bad.append(i)
            continue
        ref.add(schema, dense, bags_, label, 0)
    return ref


@st.composite
def multislot_text(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    lines = []
    for _ in range(draw(st.integers(1, 10))):
        parts = []
        parts.append([b"3"] + [b"%.4g" % x for x in rng.normal(size=3)] if rng.random() < 0.9
                     else [b"0"])
        for _ in range(3):  # C1, unused, tags
            c = int(rng.integers(0, 4))
            parts.append([b"%d" % c] + [b"%d" % v for v in rng.integers(0, 2 ** 62, c)])
        parts.append([b"1", rng.choice([b"0", b"1"])])
        words = [w for p in parts for w in p]
        r = rng.random()
        if r < 0.05:
            words = words[:-1]  # values past the line
        elif r < 0.1:
            words.append(b"7")  # extra token
        elif r < 0.15:
            words[int(rng.integers(0, len(words)))] = rng.choice([b"x", b"-2", b"1e400"])
        lines.append(b" ".join(words) + b"\n")
    return b"".join(lines)


@FUZZ
@given(st.data())
def test_multislot_matches_reference(tmp_path, data):
    schema = ms_schema(max_len=data.draw(st.sampled_from([0, 1])))
    text = data.draw(multislot_text())
    p = tmp_path / "part.txt"
    p.write_bytes(text)
    check(p, schema, ref_multislot(text, schema))


# ---------------------------------------------------------------- gzip and pipe commands
def criteo_lines(n, seed=0, short=False):
    """Criteo TSV text; ``short``: some lines lose trailing empty fields (as stripped
    files do), some integer columns are written as decimals (as pandas does)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ints = [b"" if rng.random() < 0.2 else b"%d" % rng.integers(0, 300) for _ in range(13)]
        if short and i % 3 == 0:
            ints = [x + b".0" if x else x for x in ints]
        cats = [b"" if rng.random() < 0.2 else b"%08x" % rng.integers(0, 2 ** 32)
                for _ in range(26)]
        f = [b"%d" % (i % 2)] + ints + cats
        if short and i % 4 == 1:
            while f[-1] == b"" and len(f) > 14:
                f.pop()
        out.append(b"\t".join(f) + b"\n")
    return b"".join(out)


def batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.dense, y.dense)
        np.testing.assert_array_equal(x.sparse, y.sparse)
        np.testing.assert_array_equal(x.label, y.label)
        assert (x.offsets is None) == (y.offsets is None)
        if x.offsets is not None:
            np.testing.assert_array_equal(x.offsets, y.offsets)


def test_gzip_reads_as_the_plain_file(tmp_path):
    import gzip
    cases = [(criteo_lines(300, short=True), None),
             ((DATA / "paddle_slot_sample.txt").read_bytes(), load_schema(str(DATA / "paddle_slot.toml")))]
    for k, (text, schema) in enumerate(cases):
        plain, packed = tmp_path / f"p{k}.txt", tmp_path / f"p{k}.txt.gz"
        plain.write_bytes(text)
        packed.write_bytes(gzip.compress(text))
        kw = dict(schema=schema, prefetch=False, chunk_bytes=1000, warn=lambda m: None)
        a, b = DataReader(str(plain), 64, **kw), DataReader(str(packed), 64, **kw)
        batches_equal(list(a), list(b))
        assert a.stats.rows == b.stats.rows > 0 and a.stats.bad_lines == b.stats.bad_lines == 0
        assert a.size() == b.size() == (0, len(text))  # progress sees the text's bytes
        short = sum(ln.count(b"\t") < 39 for ln in text.splitlines()) if schema is None else 0
        assert a.stats.padded == b.stats.padded == short and (schema or short > 10)


GEN = Path(__file__).parent / "dataset_generator.py"


def test_pipe_command_reads_the_generators_multislot_lines(tmp_path):
    import subprocess
    import sys
    files = []
    for k in range(3):
        p = tmp_path / f"part-{k}.txt"
        p.write_bytes(criteo_lines(50 + k, seed=k))
        files.append(str(p))
    schema = load_schema(str(DATA / "multislot_criteo.toml"))
    piped = Schema(**{**schema.__dict__, "pipe_command": f"{sys.executable} {GEN}"})
    kw = dict(prefetch=False, warn=lambda m: None, chunk_bytes=2000)
    got = list(DataReader(files, 32, schema=piped, **kw))
    printed = []  # the generator's output, written to files and read as plain MultiSlot text
    for k, f in enumerate(files):
        out = tmp_path / f"ms-{k}.txt"
        with open(f, "rb") as stdin:
            out.write_bytes(subprocess.run([sys.executable, str(GEN)], stdin=stdin,
                                           capture_output=True, check=True).stdout)
        printed.append(str(out))
    rd = DataReader(printed, 32, schema=schema, **kw)
    batches_equal(got, list(rd))
    assert rd.stats.rows == 153 and rd.stats.bad_lines == 0
    whole = bags.concat([(b.dense, b.sparse, b.label, b.offsets) for b in got])
    ref = ref_multislot(Path(printed[0]).read_bytes(), schema)
    assert whole[2][:50].tolist() == ref.label


@pytest.mark.parametrize("prefetch", [False, True])
def test_failing_pipe_command_names_file_code_and_stderr(tmp_path, prefetch):
    import sys
    p = tmp_path / "part-0.txt"
    p.write_bytes(criteo_lines(5))
    schema = load_schema(str(DATA / "multislot_criteo.toml"))
    bad = Schema(**{**schema.__dict__, "pipe_command": f"{sys.executable} {GEN} --fail"})
    rd = DataReader([str(p)], 4, schema=bad, prefetch=prefetch, warn=lambda m: None)
    with pytest.raises(ValueError, match=r"part-0.txt: --pipe-command .* exited with code 3: "
                                         r"boom: bad input"):
        list(rd)


# ---------------------------------------------------------------- CSV with a header
def csv_schema(delim=",", header=True, max_len=0):
    return Schema(format="csv", label="click", delimiter=delim, header=header,
                  dense=(DenseGroup(("price",), fill=-2.0, norm="log1p"),
                         DenseGroup(("age",), norm="none")),
                  sparse=(SparseGroup(("site_id",)),
                          SparseGroup(("genres",), separator="|", max_len=max_len,
                                      pooling="mean")))


def ref_csv(data: bytes, schema: Schema, has_label=True, bucket=0):
    import csv
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    start = 1 if schema.header else 0
    cols = (next(csv.reader([lines[0].decode().rstrip("\r")], delimiter=schema.delimiter))
            if schema.header else [schema.label, *schema.dense_names, *schema.sparse_names])
    seeds, seps = schema.hash_seeds(), schema.slot_options("separator")
    dense_at = {n: j for j, n in enumerate(schema.dense_names)}
    slot_of = {n: s for s, n in enumerate(schema.sparse_names)}
    ref = Ref()
    for i, line in enumerate(lines[start:], start):
        line = line[:-1] if line.endswith(b"\r") else line
        if not line:
            continue
        try:
            f = next(csv.reader([line.decode("latin-1")], delimiter=schema.delimiter,
                                strict=True))
        except csv.Error:
            ref.bad.append(i)
            continue
        f = [x.encode("latin-1") for x in f]
        if len(f) != len(cols):
            ref.bad.append(i)
            continue
        dense, bags_ = [None] * schema.n_dense, [[] for _ in range(schema.n_sparse)]
        label, ok, used = 0.0, True, set()
        for c, v in zip(cols, f):
            if c in used:
                continue
            used.add(c)
            if c == schema.label and has_label:
                label = py_float(v)
                ok = label in (0.0, 1.0)
            elif c in dense_at and v != b"":
                dense[dense_at[c]] = py_float(v)
                ok = dense[dense_at[c]] is not None
            elif c in slot_of:
                s = slot_of[c]
                pieces = v.split(seps[s].encode()) if seps[s] else [v]
                bags_[s] = [text_id(seeds[s], p, bucket) for p in pieces if p]
            if not ok:
                break
        if not ok:
            ref.bad.append(i)
            continue
        ref.add(schema, dense, bags_, label, 0)
    return ref


def csv_field(rng, delim):
    r = rng.random()
    base = rng.choice([b"", b"a", b"Comedy|Drama", b"x|", b"|y||z", b"a|b|c", b"1.5", b"-3", b"0",
                       b"12e3", b"nan", b"a b", delim.encode() + b"q", b'say "hi"'])
    if r < 0.3 or delim.encode() in base or b'"' in base:
        return b'"' + base.replace(b'"', b'""') + b'"'
    return base


@st.composite
def csv_text(draw, schema):
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    d = schema.delimiter
    cols = ["extra", "genres", "click", "price", "site_id", "age"]
    rng.shuffle(cols)
    lines = [d.join(f'"{c}"' if rng.random() < 0.2 else c for c in cols).encode() + b"\n"] \
        if schema.header else []
    if not schema.header:
        cols = [schema.label, *schema.dense_names, *schema.sparse_names]
    for _ in range(draw(st.integers(0, 10))):
        f = []
        for c in cols:
            if c == "click":
                f.append(rng.choice([b"0", b"1", b'"1"', b"1.0"]) if rng.random() < 0.95 else b"2")
            elif c in ("price", "age"):
                f.append(rng.choice([b"", b"%d" % rng.integers(-9, 9), b"2.5", b" 7 ", b"x"],
                                    p=[.2, .5, .1, .1, .1]))
            else:
                f.append(csv_field(rng, d))
        r = rng.random()
        if r < 0.05:
            f.pop()
        elif r < 0.08:
            f[0] = b'"unclosed'
        elif r < 0.1:
            f[-1] = b'"ab"c'
        lines.append(d.encode().join(f) + rng.choice([b"\n", b"\r\n"]))
    return b"".join(lines)


@FUZZ
@given(st.data())
def test_csv_matches_reference(tmp_path, data):
    schema = csv_schema(delim=data.draw(st.sampled_from([",", "\t", ";"])),
                        header=data.draw(st.booleans()),
                        max_len=data.draw(st.sampled_from([0, 2])))
    text = data.draw(csv_text(schema))
    p = tmp_path / "part.csv"
    p.write_bytes(text)
    check(p, schema, ref_csv(text, schema))


def test_csv_header_missing_a_column_is_one_clear_error(tmp_path):
    p = tmp_path / "a.csv"
    p.write_bytes(b"click,price,age,genres\n1,2,3,a\n")
    with pytest.raises(ValueError, match=r"a.csv: the header has no column \['site_id'\]"):
        list(DataReader(str(p), 4, schema=csv_schema(), prefetch=False))


def test_minmax_without_stats_says_the_fix():
    s = Schema(format="csv", label="click", dense=(DenseGroup(("price",)),),
               sparse=(SparseGroup(("site_id",)),))
    with pytest.raises(ValueError, match=r"needs statistics: give --stats FILE"):
        DataReader([str(DATA / "paddle_slot_sample.txt")], 4, schema=s)


# ---------------------------------------------------------------- Criteo TSV
def test_criteo_short_and_decimal_lines_read_padded_and_strict_rejects_them(tmp_path):
    text = criteo_lines(40, short=True)
    p = tmp_path / "c.txt"
    p.write_bytes(text)
    rd = DataReader(str(p), 100, prefetch=False, warn=lambda m: None)
    (b,) = list(rd)
    assert rd.stats.rows == 40 and rd.stats.bad_lines == 0 and b.offsets is None
    assert rd.stats.padded == sum(ln.count(b"\t") < 39 for ln in text.splitlines()) > 0
    full = [ln + b"\t" * (39 - ln.count(b"\t")) for ln in text.splitlines()]
    plain = [ln.replace(b".0", b"") for ln in full]  # what the decimals and stripped fields mean
    q = tmp_path / "full.txt"
    q.write_bytes(b"\n".join(plain) + b"\n")
    (want,) = list(DataReader(str(q), 100, prefetch=False))
    batches_equal([b], [want])
    first = next(i for i, ln in enumerate(text.splitlines()) if ln.count(b"\t") < 39)
    with pytest.raises(ValueError, match=rf"c.txt:{first + 1}: .*expected 40 tab-separated "
                                         rf"fields, found"):
        list(DataReader(str(p), 100, prefetch=False, strict=True))


def test_criteo_positional_schema_with_other_counts(tmp_path):
    """format = "criteo" with 2 dense and 3 sparse columns: one-hot rows through the same
    kernel, hashed from the names' seeds (C1..C3 keep Criteo's ids)."""
    schema = Schema(format="criteo", label="label",
                    dense=(DenseGroup(("I1", "x"), norm="log1p", fill=-1.0),),
                    sparse=(SparseGroup(("C1", "C2", "city")),))
    text = b"1\t3\t\tab\t\tParis\n0\t-2.5\t7\tcd\tef\n1\tz\t1\ta\tb\tc\n"
    p = tmp_path / "c.txt"
    p.write_bytes(text)
    rd = DataReader(str(p), 10, schema=schema, prefetch=False, warn=lambda m: None)
    (b,) = list(rd)
    assert rd.stats.bad_lines == 1 and rd.stats.padded == 1 and b.offsets is None
    seeds = schema.hash_seeds()
    assert b.sparse.tolist() == [[hash_feature(0, b"ab"), hash_feature(1, b""),
                                  text_id(seeds[2], b"Paris")],
                                 [hash_feature(0, b"cd"), hash_feature(1, b"ef"),
                                  text_id(seeds[2], b"")]]
    want = [[math.log1p(3), -1.0], [-math.log1p(2.5), math.log1p(7)]]
    np.testing.assert_array_equal(b.dense, np.array(want, np.float32))
    np.testing.assert_array_equal(b.label, [1, 0])


# ---------------------------------------------------------------- CSR batching
def rows_of(batches, S):
    out = []
    for b in batches:
        for i in range(len(b)):
            bag = tuple(tuple(b.sparse[b.offsets[i * S + s]:b.offsets[i * S + s + 1]].tolist())
                        for s in range(S))
            out.append((float(b.label[i]), tuple(b.dense[i].tolist()), bag))
    return out


def test_csr_batches_cut_join_and_shuffle_rows_whole(tmp_path):
    schema = slot_schema()
    rng = np.random.default_rng(3)
    lines = []
    for i in range(60):
        toks = [b"click:%d" % (i % 2), b"d1:%d" % i, b"d1:1"]
        toks += [b"101:%d" % v for v in rng.integers(0, 99, rng.integers(0, 4))]
        toks += [b"7:%d" % v for v in rng.integers(0, 99, rng.integers(0, 3))]
        lines.append(b" ".join(toks) + b"\n")
    paths = []
    for k in range(3):
        p = tmp_path / f"p{k}.txt"
        p.write_bytes(b"".join(lines[k * 20:(k + 1) * 20]))
        paths.append(str(p))
    kw = dict(schema=schema, prefetch=False, chunk_bytes=200)
    base = rows_of(list(DataReader(paths, 60, **kw)), 3)
    assert len(base) == 60
    for size, window in ((7, 0), (1, 0), (8, 13), (60, 100)):
        got = list(DataReader(paths, size, shuffle_window=window, shuffle_seed=1, **kw))
        assert all(len(b) == size for b in got[:-1])
        rows = rows_of(got, 3)
        assert (rows == base) if not window else (sorted(rows) == sorted(base) and rows != base)
        for b in got:
            assert b.offsets[0] == 0 and b.offsets[-1] == b.sparse.shape[0]


def test_bag_ops_match_row_by_row():
    rng = np.random.default_rng(0)
    n, S = 9, 3
    lens = rng.integers(0, 3, n * S)
    off = np.zeros(n * S + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    piece = (rng.normal(size=(n, 2)).astype(np.float32), rng.integers(0, 1000, off[-1]),
             np.arange(n, dtype=np.float32), off)

    def bag_rows(p):
        m = p[2].shape[0]
        return [[p[1][p[3][i * S + s]:p[3][i * S + s + 1]].tolist() for s in range(S)]
                for i in range(m)]
    full = bag_rows(piece)
    assert bag_rows(bags.slice_rows(piece, 2, 6)) == full[2:6]
    assert bag_rows(bags.concat([bags.slice_rows(piece, 0, 4), bags.slice_rows(piece, 4, 4),
                                 bags.slice_rows(piece, 4, 9)])) == full
    perm = rng.permutation(n)
    taken = bags.take(piece, perm)
    assert bag_rows(taken) == [full[i] for i in perm]
    np.testing.assert_array_equal(taken[0], piece[0][perm])


# ---------------------------------------------------------------- config and build
def test_schema_and_pipe_command_flags_resolve_the_readers_schema(tmp_path):
    from mpips.job.build import make_schema
    from mpips.config import parse_args
    toml = str(DATA / "multislot_criteo.toml")
    cfg = parse_args(["--schema", toml, "--pipe-command", "python gen.py"])
    s = make_schema(cfg)
    assert s.format == "multislot" and s.pipe_command == "python gen.py"
    assert "pipe_command 'python gen.py'" in s.describe()
    assert make_schema(parse_args([])).is_criteo
    conf = tmp_path / "run.toml"
    conf.write_text(f'schema = "{toml}"\n')
    assert make_schema(parse_args(["--config", str(conf)])).format == "multislot"
    with pytest.raises(ValueError, match="--data-format tsv is for the default Criteo schema"):
        parse_args(["--schema", toml, "--data-format", "tsv"])
    with pytest.raises(ValueError, match="cannot read schema file"):
        parse_args(["--schema", str(tmp_path / "nope.toml")])


def test_binary_parts_with_another_schema_fail_clearly(tmp_path):
    from data_prep.synth import generate
    generate(str(tmp_path), rows=50, parts=1, seed=1)
    from data_prep import criteo as P
    assert P.main(["--input", str(tmp_path / "train"), "--out", str(tmp_path / "out"),
                   "--parts", "1"]) == 0
    with pytest.raises(ValueError, match="binary data parts hold Criteo's"):
        list(DataReader(str(tmp_path / "out" / "train"), 8, schema=slot_schema(),
                        prefetch=False))


def test_documented_csv_schemas_read_their_data_with_no_bad_line(tmp_path):
    import csv
    rng = np.random.default_rng(5)
    avazu = load_schema(str(DATA / "avazu.toml"))
    cols = ["id", "click", *avazu.sparse_names]
    p = tmp_path / "avazu.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i in range(50):
            w.writerow([i, i % 2] + [f"{rng.integers(0, 1 << 32):08x}" for _ in cols[2:]])
    check(p, avazu, ref_csv(p.read_bytes(), avazu))
    ml = load_schema(str(DATA / "movielens.toml"))
    q = tmp_path / "ml.csv"
    genres = ["Comedy", "Drama", "Action", "Sci-Fi"]
    with open(q, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user_id", "movie_id", "rating", "genres", "click", "age", "gender",
                    "occupation"])
        for i in range(40):
            g = "|".join(rng.choice(genres, rng.integers(0, 4), replace=False))
            w.writerow([i % 7, i % 11, 3.5, g, i % 2, "" if i % 5 == 0 else 20 + i, "F", 4])
    rd = check(q, ml, ref_csv(q.read_bytes(), ml))
    assert rd.stats.rows == 40 and rd.stats.bad_lines == 0


# ---------------------------------------------------------------- binary parts of a schema
def test_bag_parts_read_back_as_the_text(tmp_path):
    from data_prep import parts as PP
    from mpips.data.files import resolve_paths
    sample = DATA / "paddle_slot_sample.txt"
    schema = load_schema(str(DATA / "paddle_slot.toml"))
    out = tmp_path / "parts"
    man = PP.prepare(str(sample), str(out), schema, rows_per_part=30)
    assert man["rows"] == 80 and [p["rows"] for p in man["parts"]] == [30, 30, 20]
    assert len(resolve_paths(str(out))) == 3
    kw = dict(schema=schema, prefetch=False)
    batches_equal(list(DataReader(str(out), 16, **kw)), list(DataReader(str(sample), 16, **kw)))
    mixed = list(DataReader([str(out / "part-00001"), str(sample)], 200, **kw))
    assert len(mixed) == 1 and len(mixed[0]) == 110
    with pytest.raises(ValueError, match="parts were written with another schema"):
        list(DataReader(str(out), 16, schema=slot_schema(), prefetch=False))
    # a one-hot (criteo-format) schema's parts come back one-hot
    crit = Schema(format="criteo", dense=(DenseGroup(("I1", "x"), norm="none"),),
                  sparse=(SparseGroup(("C1", "C2", "city")),))
    p = tmp_path / "c.txt"
    p.write_bytes(b"1\t3\t\tab\t\tParis\n0\t-2.5\t7\tcd\tef\n" * 5)
    assert PP.main(["--schema", str(tmp_path / "nope.toml"), "--input", str(p), "--out",
                    str(tmp_path / "x")]) == 1
    PP.prepare(str(p), str(tmp_path / "cp"), crit, rows_per_part=4)
    kw = dict(schema=crit, prefetch=False, warn=lambda m: None)
    got = list(DataReader(str(tmp_path / "cp"), 3, **kw))
    assert got[0].offsets is None and got[0].sparse.shape == (3, 3)
    batches_equal(got, list(DataReader(str(p), 3, **kw)))


def test_mostly_bad_schema_file_fails_naming_reason_and_schema(tmp_path):
    p = tmp_path / "a.csv"
    p.write_bytes(b"click,price,age,site_id,genres\n" + b"1,2,3\n" * 9 + b"1,2,3,x,y\n")
    with pytest.raises(ValueError) as e:
        list(DataReader(str(p), 4, schema=csv_schema(), prefetch=False, warn=lambda m: None,
                        max_bad_fraction=0.1))
    msg = str(e.value)
    assert "9 of 10 lines malformed" in msg and "expected 5 columns as the header, found 3" in msg
    assert "check the file against the schema (schema: format csv" in msg
    assert "a.csv:2: malformed line skipped" in _first_warning(p)


def _first_warning(p):
    msgs = []
    list(DataReader(str(p), 4, schema=csv_schema(), prefetch=False, warn=msgs.append))
    return msgs[0]


# ---------------------------------------------------------------- random bytes, bounds
def _alphabet_bytes(rng_bytes, alphabet):
    return bytes(alphabet[b % len(alphabet)] for b in rng_bytes)


SLOT_ALPHA = b"  \t\n\r::0123456789.-_e" + b"click" + b"d1" + b"user_tag" + b"7"
MS_ALPHA = b"   \n\r0123456789.-e_x"


def _check_layout(r, S):
    assert r.offsets.shape == (r.n_rows * S + 1,) and r.offsets[0] == 0
    assert np.all(np.diff(r.offsets) >= 0) and r.offsets[-1] == r.sparse.shape[0]
    assert np.all(np.isfinite(r.dense)) and r.n_rows + r.n_bad <= r.n_lines


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.binary(max_size=300), st.booleans())
def test_bag_kernels_on_random_bytes(raw, use_alpha):
    from mpips.data.formats import TextFormat
    for order in ("slot:feasign", "feasign:slot"):
        schema = slot_schema(order)
        data = _alphabet_bytes(raw, SLOT_ALPHA) if use_alpha else raw
        r = TextFormat(schema).parse(data)
        _check_layout(r, 3)
        ref = ref_slot(data, schema)
        assert r.n_bad == len(ref.bad) and r.n_rows == len(ref.label)
        assert r.sparse.tolist() == [i for row in ref.bags for b in row for i in b]
    schema = ms_schema()
    data = _alphabet_bytes(raw, MS_ALPHA) if use_alpha else raw
    r = TextFormat(schema).parse(data)
    _check_layout(r, 2)
    ref = ref_multislot(data, schema)
    assert r.n_bad == len(ref.bad) and r.n_rows == len(ref.label)
    for s in (csv_schema(header=False), csv_schema(delim="\t", header=False)):
        _check_layout(TextFormat(s).parse(raw), 2)


BOUNDS_SCRIPT = r"""
import numpy as np
import sys
sys.path.insert(0, "tests")
from test_bag_readers import csv_schema, ms_schema, slot_schema
from mpips.data.formats import TextFormat
rng = np.random.default_rng(0)
fmts = [TextFormat(slot_schema("slot:feasign")), TextFormat(slot_schema("feasign:slot")),
        TextFormat(ms_schema()), TextFormat(csv_schema(header=False))]
alpha = np.frombuffer(b' ,"\t\n\r:|01x', np.uint8)
inputs = [b"", b"\n", b"\r", b'"', b'"a', b'""', b'"a"b', b"a,", b"click:1", b"3 1 2", b"1:"]
for n in range(1, 120):
    inputs.append(bytes(rng.choice(alpha, n)))
    inputs.append(bytes(rng.integers(0, 256, n, dtype=np.uint8)))
for data in inputs:
    for f in fmts:
        f.parse(data)
print("BOUNDS-OK", len(inputs))
"""


def test_bag_kernels_never_read_out_of_bounds(tmp_path):
    import os
    import subprocess
    import sys
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=root)
    res = subprocess.run([sys.executable, "-c", BOUNDS_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "BOUNDS-OK" in res.stdout


def test_pipe_command_not_found_names_it(tmp_path):
    p = tmp_path / "part-0.txt"
    p.write_bytes(b"x\n")
    schema = load_schema(str(DATA / "multislot_criteo.toml"))
    bad = Schema(**{**schema.__dict__, "pipe_command": "mpips_no_such_command_xyz"})
    with pytest.raises(ValueError, match=r"part-0.txt: --pipe-command 'mpips_no_such_command_xyz'"
                                         r" exited with code 127: .*not found"):
        list(DataReader([str(p)], 4, schema=bad, prefetch=False))
