"""Own files (issue 35, part 5): one text file shared by workers in byte ranges, against
plain Python line counts.

- every cut point of a file with CRLF lines, blank lines, long lines and a last line
  without LF: the two spans [0, p) and [p, n) give back the file's bytes exactly, the cut
  moved to a line start;
- ``worker_files`` with fewer files than workers: W workers' spans of 1 or 2 files read
  each line once, in order (checked against ``bytes.splitlines``), and gzip files are not
  cut;
- a CSV read in spans (header taken from the file for later spans, quoted newlines, bad
  lines numbered as in the whole file) gives the whole file's rows.
"""
import gzip
import re

import numpy as np
import pytest

from mpips.data import sources
from mpips.data.files import Span, byte_share, eval_files, readers_for, worker_files
from mpips.data.reader import DataReader
from mpips.schema import load_schema


def _text(rng, n):
    """n lines of random length (0 to 300 bytes), some CRLF, some blank."""
    out = []
    for i in range(n):
        body = bytes(rng.integers(97, 123, int(rng.integers(0, 300))).astype(np.uint8))
        out.append(body + (b"\r\n" if i % 3 == 0 else b"\n"))
    return b"".join(out)


def _read_span(path, a, b, size=7):
    with sources.open_span(str(path), a, b) as f:
        out = b""
        while True:
            block = f.read(size)    # small reads: the span's end is honoured mid-read
            if not block:
                return out
            out += block


def _lines(data):
    return data.splitlines(keepends=True)


@pytest.mark.parametrize("tail", [b"", b"last line without LF"])
def test_every_cut_point_splits_on_a_line_start(tmp_path, tail):
    data = _text(np.random.default_rng(1), 40) + tail
    path = tmp_path / "f.txt"
    path.write_bytes(data)
    starts = {0, len(data)} | {i + 1 for i, c in enumerate(data) if c == 10}
    for p in range(len(data) + 1):
        left, right = _read_span(path, 0, p, 1 << 16), _read_span(path, p, len(data), 1 << 16)
        assert left + right == data, p
        assert len(left) in starts and len(left) >= p         # moved forward to a line start
        assert len(_lines(left)) + len(_lines(right)) == len(_lines(data))


@pytest.mark.parametrize("W", [2, 3, 5, 8])
def test_workers_read_each_line_once(tmp_path, W):
    rng = np.random.default_rng(W)
    paths = []
    for k in range(2):
        paths.append(str(tmp_path / f"f{k}.txt"))
        with open(paths[-1], "wb") as f:
            f.write(_text(rng, 200 + 50 * k))
    for files in (paths[:1], paths):
        if len(files) >= W:
            continue
        assert readers_for(files, W) == W
        whole = b"".join(open(p, "rb").read() for p in files)
        read, sizes = [], []
        for w in range(W):
            mine = worker_files(files, W, w)
            assert mine == byte_share(files, W, w) == eval_files(files, W, w)
            for item in mine:
                s = item if isinstance(item, Span) else Span(item, 0, 1 << 40)
                read.append(_read_span(s.path, s.start, s.stop))
            sizes.append(sum(len(r) for r in read[len(read) - len(mine):]))
        assert b"".join(read) == whole
        assert sum(len(_lines(r)) for r in read) == len(_lines(whole))
        assert max(sizes) - min(sizes) < 2 * 2 * 303    # even shares, +- a line at each cut


def test_gzip_and_piped_files_are_not_cut(tmp_path):
    gz = tmp_path / "a.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b"1\t2\n" * 100)
    plain = tmp_path / "b.txt"
    plain.write_bytes(b"1\t2\n" * 100)
    files = [str(gz), str(plain)]
    assert [worker_files(files, 3, w) for w in range(3)] == [[str(gz)], [str(plain)], []]
    assert readers_for(files, 3) == 2
    assert [worker_files([str(plain)], 2, w, split=False) for w in range(2)] == [[str(plain)], []]
    assert readers_for([str(plain)], 2, split=False) == 1


SCHEMA = """format = "csv"
label = "click"
[[dense]]
names = ["price"]
norm = "none"
[[sparse]]
names = ["site", "tags"]
"""


def _csv(rng, n):
    lines = ["click,price,site,tags"]
    for i in range(n):
        tags = '"t1,t2"' if i % 7 == 0 else f"t{i % 5}"
        if i % 50 == 13:
            tags = '"two\nlines"'               # a quoted newline: two bad lines
        end = "\r\n" if i % 4 == 0 else "\n"
        lines.append(f"{int(rng.random() < 0.3)},{rng.uniform(0, 9):.3f},s{i % 11},{tags}{end}")
    return (lines[0] + "\n" + "".join(lines[1:])).encode()


def _rows(reader):
    batches = list(reader)
    return (np.concatenate([b.dense for b in batches]), np.concatenate([b.label for b in batches]),
            np.concatenate([b.sparse for b in batches]), reader.stats)


@pytest.mark.parametrize("W", [2, 3, 7])
def test_csv_in_spans_equals_the_whole_file(tmp_path, W):
    (tmp_path / "s.toml").write_text(SCHEMA)
    schema = load_schema(str(tmp_path / "s.toml"))
    path = tmp_path / "d.csv"
    path.write_bytes(_csv(np.random.default_rng(0), 1000))
    kw = dict(schema=schema, prefetch=False, chunk_bytes=4096, warn=lambda m: None)
    whole = DataReader(str(path), 64, **kw)
    dense, label, sparse, st = _rows(whole)
    parts = [_rows(DataReader(worker_files([str(path)], W, w), 64, **kw)) for w in range(W)]
    assert all(len(p[1]) > 0 for p in parts)
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), dense)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), label)
    np.testing.assert_array_equal(np.concatenate([p[2] for p in parts]), sparse)
    assert st.bad_lines == 2 * 20 == sum(p[3].bad_lines for p in parts)
    ex = sorted(x.split(": malformed")[0].replace(f"{path}:", "") for p in parts
                for f in p[3].files.values() for x in f.examples)
    first = [x.split(": malformed")[0].replace(f"{path}:", "")
             for x in next(iter(st.files.values())).examples]
    assert set(first) <= set(ex)              # bad lines numbered as in the whole file
    text = path.read_bytes().split(b"\n")
    for n in ex:                              # each names a line holding half a quote
        assert text[int(n) - 1].count(b'"') % 2 == 1


@pytest.fixture(scope="module")
def one_file(tiny_data, tmp_path_factory):
    """tiny_data's 8 train and 2 test parts each joined into one file."""
    import glob
    out = tmp_path_factory.mktemp("one")
    for name, src in (("train.txt", tiny_data[0]), ("test.txt", tiny_data[1])):
        with open(out / name, "wb") as f:
            for p in sorted(glob.glob(f"{src}/*")):
                f.write(open(p, "rb").read())
    return str(out / "train.txt"), str(out / "test.txt")


def test_one_file_two_workers_sync_equals_local_and_resumes(one_file, tmp_path):
    """One file, 2 workers: each trains on half its lines (+-1), sync == --local
    --local-workers 2 bit for bit, and a mid-epoch resume of the split file continues
    exactly (the same parameters as the uninterrupted run)."""
    from tests.test_dense_replica import assert_identical
    from tests.test_resume import mid_checkpoint
    from tests.test_modes import train
    common = ("--batch-size", "100", "--lr", "0.003", "--save-every", "30")
    dist = train(one_file, tmp_path, "sync", "--mode", "sync", *common, n=4)
    local = train(one_file, tmp_path, "local", "--local", "--local-workers", "2", *common)
    assert_identical(tmp_path / "sync", tmp_path / "local")
    assert dist[0]["train_examples"] == local[0]["train_examples"] == 16000
    data = open(one_file[0], "rb").read()           # worker 0: the lines starting in the
    first_half = data.count(b"\n", 0, len(data) // 2 - 1) + 1      # first half of the bytes
    assert dist[0]["worker_examples"] == [first_half, 16000 - first_half]
    assert dist[0]["test_examples"] == 4000 and dist[0]["test_auc"] == local[0]["test_auc"]
    mid = mid_checkpoint(tmp_path / "sync", 0, 30)
    rec = train(one_file, tmp_path, "resumed", "--mode", "sync", *common, "--resume", mid, n=4)
    assert rec[0]["train_examples"] == 16000 - 2 * 30 * 100
    assert_identical(tmp_path / "sync", tmp_path / "resumed")


# ------------------------------------------------------------------ null tokens, messages
NA_SCHEMA = """format = "csv"
label = "click"
{extra}
[[dense]]
names = ["price", "age"]
norm = "none"
fill = -1.5
[[sparse]]
names = ["site"]
"""


def _reader(tmp_path, text, extra="", **kw):
    (tmp_path / "s.toml").write_text(NA_SCHEMA.format(extra=extra))
    (tmp_path / "d.csv").write_text(text)
    msgs = []
    rd = DataReader(str(tmp_path / "d.csv"), 100, schema=load_schema(str(tmp_path / "s.toml")),
                    prefetch=False, warn=msgs.append, **kw)
    return rd, msgs


def _expected(cells, na):
    """The dense values a plain Python reading gives: float() if finite, the fill for a
    null token (spaces stripped), None (a bad line) otherwise."""
    out = []
    for c in cells:
        c = c.strip()
        if c in na:
            out.append(-1.5)
            continue
        try:
            v = float(c)
        except ValueError:
            return None
        if v != v or v in (float("inf"), float("-inf")):
            return None
        out.append(v)
    return out


@pytest.mark.parametrize("extra,na", [("", ("", "NA", "null", "NaN")),
                                      ('na_values = ["-", "?"]', ("-", "?"))])
def test_null_tokens_take_the_fill(tmp_path, extra, na):
    cells = ["1.5", "", "NA", "null", "NaN", " NA ", "-", "?", "abc", "nan", "inf", "2e3", "na"]
    lines, want = ["click,price,age,site"], []
    for i, a in enumerate(cells):
        b = cells[(i * 5 + 3) % len(cells)]
        lines.append(f"{i % 2},{a},{b},s{i}")
        want.append(_expected([a, b], na))
    rd, msgs = _reader(tmp_path, "\n".join(lines) + "\n", extra, max_warnings=100)
    got = np.concatenate([b.dense for b in rd])
    good = [w for w in want if w is not None]
    np.testing.assert_array_equal(got, np.array(good, np.float32))
    assert rd.stats.bad_lines == len(want) - len(good) > 0
    assert len(msgs) == rd.stats.bad_lines            # each names the bad value
    for m in msgs:
        line = int(m.split(":")[1])
        price, age = lines[line - 1].split(",")[1:3]
        bad = price if _expected([price], na) is None else age
        name = "price" if bad is price else "age"
        assert m.endswith(f"bad value of {name!r}: {bad!r}"), m


def test_bad_values_are_shown_criteo_and_slot(tmp_path):
    from tests.test_reader import open_lines, SAMPLE
    f = open_lines()[0].split(b"\t")
    f[5] = b"12x"
    p = tmp_path / "c.txt"
    p.write_bytes(b"\t".join(f))
    msgs = []
    list(DataReader(str(p), 4, warn=msgs.append, prefetch=False))
    assert msgs[0].endswith("integer field I5 is not a number: '12x'"), msgs
    line = open(SAMPLE, "rb").readline().replace(b"dense_feature:0", b"dense_feature:zz", 1)
    p.write_bytes(line)
    msgs = []
    list(DataReader(str(p), 4, fmt="slot", warn=msgs.append, prefetch=False))
    assert msgs[0].endswith(f"bad value in token 2: {line.split()[1].decode()!r}"), msgs
    (tmp_path / "m.toml").write_text('format = "multislot"\nfields = ["click", "price", "site"]\n'
                                     'label = "click"\n[[dense]]\nnames = ["price"]\n'
                                     'norm = "none"\n[[sparse]]\nnames = ["site"]\n')
    p.write_bytes(b"1 1 1 2.5 2 7 9\n1 0 1 x5 1 7\n")
    msgs = []
    rd = DataReader(str(p), 4, schema=load_schema(str(tmp_path / "m.toml")), prefetch=False,
                    warn=msgs.append)
    assert sum(len(b) for b in rd) == 1
    assert msgs == [f"{p}:2: malformed line skipped: bad value of 'price': 'x5'"], msgs


def test_missing_column_and_wrong_delimiter_messages(tmp_path):
    rd, _ = _reader(tmp_path, "click,prce,age,site\n1,2,3,s\n")
    with pytest.raises(ValueError, match=r"no column \['price'\] that the schema names "
                                         r"\('price': did you mean 'prce'\?\)"):
        list(rd)
    rd, _ = _reader(tmp_path, "click\tprice\tage\tsite\n1\t2\t3\ts\n")
    with pytest.raises(ValueError, match=re.escape(
            "does not split into the schema's columns on delimiter ',', but does on '\\t': "
            'set delimiter = "\\t" in the schema')):
        list(rd)
    rd, _ = _reader(tmp_path, "1;2;3;s\n0;4;5;t\n", "header = false", max_bad_fraction=0.1)
    with pytest.raises(ValueError, match=r"hint: the lines split into 4 columns on ';', not "
                                         r"on ',': set delimiter = \";\" in the schema"):
        list(rd)


def test_na_values_only_for_csv(tmp_path):
    from mpips.schema import SchemaError
    p = tmp_path / "s.toml"
    p.write_text(NA_SCHEMA.format(extra='na_values = "NA"'))
    with pytest.raises(SchemaError, match="na_values must be a list of strings"):
        load_schema(str(p))
    p.write_text(NA_SCHEMA.format(extra='na_values = ["-"]').replace('"csv"', '"slot"'))
    with pytest.raises(SchemaError, match="na_values is read by the csv format only"):
        load_schema(str(p))
