"""File resolution/splitting and the batching, prefetching DataReader."""
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from data_prep.synth import generate
from mpips.data import reader as R
from mpips.data.criteo import parse_tsv_bytes
from mpips.data.files import resolve_paths, split_files
from mpips.data.reader import Batch, DataReader, detect_format, iter_chunks
from mpips.data.slot import parse_slot_bytes

SAMPLE = str(Path(__file__).parent / "data" / "paddle_slot_sample.txt")


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    generate(str(out), rows=3001, parts=3, seed=5)
    return os.path.join(out, "train")


def collect(rd):
    batches = list(rd)
    return batches, concat(batches)


def concat(batches):
    return Batch(*(np.concatenate(c) for c in zip(*((b.dense, b.sparse, b.label)
                                                        for b in batches))))


def whole(files, **kw):
    parts = [parse_tsv_bytes(open(f, "rb").read(), **kw) for f in files]
    return Batch(*(np.concatenate(c) for c in zip(*((p.dense, p.sparse, p.label)
                                                        for p in parts))))


def assert_same(a: Batch, b: Batch):
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.sparse, b.sparse)
    np.testing.assert_array_equal(a.label, b.label)


# ---------------------------------------------------------------- files
def test_resolve_paths_dir_glob_list(tmp_path):
    for name in ("b.txt", "a.txt", ".hidden", "_SUCCESS", "c.log"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub").mkdir()
    d = str(tmp_path)
    assert resolve_paths(d) == [f"{d}/a.txt", f"{d}/b.txt", f"{d}/c.log"]
    assert resolve_paths(f"{d}/*.txt") == [f"{d}/a.txt", f"{d}/b.txt"]
    assert resolve_paths(f"{d}/c.log,{d}/*.txt") == [f"{d}/c.log", f"{d}/a.txt", f"{d}/b.txt"]
    assert resolve_paths([f"{d}/b.txt", f"{d}/b.txt"]) == [f"{d}/b.txt"]
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_paths(f"{d}/a.txt,{d}/nope*")
    with pytest.raises(FileNotFoundError, match="no data files"):
        resolve_paths(str(tmp_path / "sub"))
    with pytest.raises(FileNotFoundError):
        resolve_paths("")


def test_split_files_blocks():
    files = [f"f{i}" for i in range(11)]
    for w in range(1, 12):
        shards = [split_files(files, w, i) for i in range(w)]
        assert sum(shards, []) == files  # contiguous, in order, no duplicates
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="at least one file"):
        split_files(files[:2], 3, 0)
    with pytest.raises(ValueError):
        split_files(files, 2, 2)


# ---------------------------------------------------------------- reader
def test_batches_span_files_and_match_whole_parse(synth_dir):
    files = resolve_paths(synth_dir)
    ref = whole(files)
    rd = DataReader(synth_dir, 256, prefetch=False, chunk_bytes=10_000)
    batches, got = collect(rd)
    assert [len(b) for b in batches] == [256] * 11 + [3001 - 11 * 256]
    assert_same(got, ref)
    assert rd.stats.rows == 3001 and rd.stats.bad_lines == 0
    assert sum(fs.rows for fs in rd.stats.files.values()) == 3001
    b = batches[0]
    assert b.dense.dtype == np.float32 and b.label.dtype == np.float32
    assert b.sparse.dtype == np.int64
    assert b.dense.shape == (256, 13) and b.sparse.shape == (256, 26)


def test_prefetch_identical_and_drop_last(synth_dir):
    a, ga = collect(DataReader(synth_dir, 100, prefetch=False))
    b, gb = collect(DataReader(synth_dir, 100, prefetch=True, chunk_bytes=3000))
    assert [len(x) for x in a] == [len(x) for x in b]
    assert_same(ga, gb)
    c = list(DataReader(synth_dir, 100, drop_last=True))
    assert len(c) == 30 and all(len(x) == 100 for x in c)


def test_reader_iterates_again_and_stops_early(synth_dir):
    rd = DataReader(synth_dir, 64, chunk_bytes=2000)
    for _ in rd:
        break
    rd.close()
    assert rd._thread is None
    assert threading.active_count() < 50
    n = sum(len(b) for b in rd)  # a fresh full pass after an early stop
    assert n == 3001 and rd.stats.rows == 3001
    with DataReader(synth_dir, 64) as rd2:
        it = iter(rd2)
        next(it)
        it.close()  # dropping the generator closes the thread
        assert rd2._thread is None


def test_bad_lines_warned_and_counted(tmp_path):
    good = open_lines()
    p = tmp_path / "bad.txt"
    body = good[0] + b"x\ty\n" * 15 + good[1] + b"1\t2\n"
    p.write_bytes(body)
    msgs = []
    rd = DataReader(str(p), 10, warn=msgs.append, prefetch=True, max_warnings=10)
    _, got = collect(rd)
    assert len(got) == 2 and rd.stats.bad_lines == 16
    fs = rd.stats.files[str(p)]
    assert fs.bad == 16 and fs.lines == 18 and len(fs.examples) == R.EXAMPLES_KEPT
    assert msgs[0].startswith(f"{p}:2: malformed line skipped: expected 40")
    assert len(msgs) == 11 and "6 more malformed lines" in msgs[-1]


def test_strict_mode_raises_with_file_line(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(open_lines()[0] * 3 + b"1\tx" + b"\t" * 38 + b"\n")
    for prefetch in (False, True):
        rd = DataReader(str(p), 2, strict=True, prefetch=prefetch)
        with pytest.raises(ValueError, match=rf"{p}:4: malformed line skipped: integer field "
                                             r"I1 is not a number: 'x' \(strict mode"):
            list(rd)
        assert rd._thread is None


def test_edge_files(tmp_path):
    lines = open_lines()
    (tmp_path / "a_empty.txt").write_bytes(b"")
    (tmp_path / "b_nonl.txt").write_bytes(lines[0] + lines[1].rstrip(b"\n"))
    (tmp_path / "c_crlf.txt").write_bytes(b"".join(l[:-1] + b"\r\n" for l in lines[:3]))
    rng = np.random.default_rng(0)
    (tmp_path / "d_junk.bin").write_bytes(bytes(rng.integers(0, 256, 300_000, dtype=np.uint8)))
    msgs = []
    rd = DataReader(str(tmp_path), 4, warn=msgs.append, chunk_bytes=4096)
    _, got = collect(rd)
    assert len(got) == 5                      # b_nonl's last line has no newline: read
    (tmp_path / "ref.txt").write_bytes(lines[0] + lines[1])
    assert_same(got, whole([str(tmp_path / "ref.txt"), str(tmp_path / "c_crlf.txt")]))
    assert rd.stats.files[str(tmp_path / "b_nonl.txt")].bad == 0
    assert f"{tmp_path / 'b_nonl.txt'}: the last line (line 2) has no newline" in "".join(msgs)
    assert rd.stats.files[str(tmp_path / "d_junk.bin")].bad > 0
    assert len(msgs) <= 12


@pytest.mark.parametrize("fmt", ["tsv", "slot"])
def test_last_line_without_newline(tmp_path, fmt):
    """Issue 35: a last line without a newline is read (real files often end so; Paddle
    reads them) and noted once; --strict refuses it naming file:line, since a file cut
    inside the last field of its last line ends so too and still parses (to a wrong id).
    A last line that does not parse is a bad line with its own reason."""
    if fmt == "tsv":
        whole_lines = b"".join(open_lines())
    else:
        whole_lines = b"".join(open(SAMPLE, "rb").readlines()[:3])
    last = whole_lines.splitlines(keepends=True)[-1]
    cut = last[:-4]                              # inside the last categorical value / id
    complete = parse_tsv_bytes(last) if fmt == "tsv" else parse_slot_bytes(last)
    wrong = parse_tsv_bytes(cut) if fmt == "tsv" else parse_slot_bytes(cut)
    assert wrong.n_rows == 1 and wrong.sparse[0, -1] != complete.sparse[0, -1]  # the danger
    head = whole_lines[:-len(last)]
    ref = parse_tsv_bytes(head + cut + b"\n") if fmt == "tsv" else \
        parse_slot_bytes(head + cut + b"\n")
    p = tmp_path / "cut.txt"
    p.write_bytes(head + cut)
    n_lines = head.count(b"\n") + 1
    for chunk in (64, 1 << 20):                  # the cut line alone in the last chunk, or not
        msgs = []
        rd = DataReader(str(p), 2, fmt=fmt, warn=msgs.append, chunk_bytes=chunk)
        _, got = collect(rd)
        assert_same(got, Batch(ref.dense, ref.sparse, ref.label))
        assert rd.stats.bad_lines == 0 and rd.stats.files[str(p)].lines == n_lines
        assert msgs == [f"{p}: the last line (line {n_lines}) has no newline; read as "
                        "complete (--strict refuses it, as a file cut short ends so)"]
        with pytest.raises(ValueError, match=rf"{p}:{n_lines}: .*does not end in a newline.*"
                                             r"\(strict mode"):
            list(DataReader(str(p), 2, fmt=fmt, strict=True, chunk_bytes=chunk))
    for ending in (b"", b"\r"):                 # ends in a newline (or a lone CR): all rows
        p.write_bytes(whole_lines + ending)
        msgs = []
        rd = DataReader(str(p), 2, fmt=fmt, strict=True, warn=msgs.append)
        assert collect(rd)[1].sparse.shape[0] == n_lines and rd.stats.bad_lines == 0
        assert msgs == []
    p.write_bytes(cut)                           # a one-line file without newline: read
    msgs = []
    assert collect(DataReader(str(p), 2, fmt=fmt, warn=msgs.append))[1].sparse.shape[0] == 1
    assert len(msgs) == 1
    p.write_bytes(head + b"1\tjunk")             # a last line that does not parse: bad
    msgs = []
    rd = DataReader(str(p), 2, fmt=fmt, warn=msgs.append)
    assert collect(rd)[1].sparse.shape[0] == n_lines - 1 and rd.stats.bad_lines == 1
    assert len(msgs) == 1 and msgs[0].startswith(f"{p}:{n_lines}: malformed line skipped")


def test_too_long_line_is_skipped(tmp_path, monkeypatch):
    lines = open_lines()
    p = tmp_path / "long.txt"
    p.write_bytes(lines[0] + b"z" * 50_000 + b"\n" + lines[1] + b"q" * 30_000)
    chunks = list(iter_chunks(str(p), chunk_bytes=1000, max_line=10_000))
    assert [c[2] for c in chunks if c[2]] == [[1], [3]]
    monkeypatch.setattr(R, "MAX_LINE_BYTES", 10_000)
    monkeypatch.setattr(R.sources, "MAX_LINE_BYTES", 10_000)
    msgs = []
    rd = DataReader(str(p), 8, warn=msgs.append, chunk_bytes=1000)
    _, got = collect(rd)
    assert len(got) == 2 and rd.stats.bad_lines == 2
    assert msgs[0].startswith(f"{p}:2:") and msgs[1].startswith(f"{p}:4:")


def test_slot_format_auto_detect(tmp_path):
    assert detect_format(SAMPLE) == "slot"
    p = tmp_path / "s.txt"
    p.write_bytes(b"\n\n" + open(SAMPLE, "rb").read())
    assert detect_format(str(p)) == "slot"
    ref = parse_slot_bytes(open(SAMPLE, "rb").read())
    _, got = collect(DataReader(str(p), 7, chunk_bytes=5000))
    assert_same(got, Batch(ref.dense, ref.sparse, ref.label))
    _, got2 = collect(DataReader(str(p), 7, fmt="slot", hash_bucket=1000001))
    assert got2.sparse[0, 0] == 737395


def test_no_label_and_options(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"".join(l.split(b"\t", 1)[1] for l in open_lines()))
    _, got = collect(DataReader(str(p), 2, has_label=False, hash_bucket=1000001))
    assert len(got) == 3 and np.all(got.label == 0) and got.sparse.max() < 1000001
    with pytest.raises(ValueError, match="batch_size"):
        DataReader(str(p), 0)
    with pytest.raises(ValueError, match="fmt"):
        DataReader(str(p), 2, fmt="csv")
    with pytest.raises(FileNotFoundError):
        DataReader(str(tmp_path / "missing"), 2)


def test_producer_error_reaches_consumer(synth_dir, monkeypatch):
    def boom(self, fmt, data):
        raise RuntimeError("disk on fire")
    from mpips.data.parsers import LineParser
    monkeypatch.setattr(LineParser, "parse", boom)
    rd = DataReader(synth_dir, 10, prefetch=True)
    with pytest.raises(RuntimeError, match="disk on fire"):
        list(rd)
    assert rd._thread is None


def open_lines():
    ints = [b"1", b"-3", b"", b"7"] + [b"12"] * 9
    return [b"\t".join([b"%d" % (i % 2)] + ints + [b"%08x" % (i * 7 + k) for k in range(26)])
            + b"\n" for i in range(3)]


GOOD = "1\t" + "\t".join(["3"] * 13) + "\t" + "\t".join(["68fd1e64"] * 26) + "\n"


@pytest.mark.parametrize("n_bad,limit,fails", [(15, 0.1, True), (5, 0.1, False), (15, 0.2, False),
                                               (1, 0.0, True), (15, None, False)])
def test_malformed_share_above_the_limit_fails_naming_file_count_and_reason(tmp_path, n_bad, limit,
                                                                           fails):
    p = tmp_path / "part.txt"
    p.write_text(GOOD * (100 - n_bad) + "1\t2\t3\n" * n_bad)
    reader = DataReader(str(p), 32, prefetch=False, warn=lambda m: None, max_bad_fraction=limit)
    if not fails:
        assert sum(len(b) for b in reader) == 100 - n_bad
        return
    with pytest.raises(R.DataError) as e:
        list(reader)
    msg = str(e.value)
    assert str(p) in msg and f"{n_bad} of 100 lines malformed" in msg
    assert "found 3" in msg and "--max-bad-fraction" in msg and "--data-format slot" in msg


def test_no_valid_line_fails_even_at_limit_one_with_a_hint(tmp_path):
    no_label = tmp_path / "nolabel.txt"
    no_label.write_text(GOOD.split("\t", 1)[1] * 20)               # 39 fields
    binary = tmp_path / "random.bin"
    binary.write_bytes(np.random.default_rng(0).integers(0, 256, 50000).astype(np.uint8).tobytes())
    for path, hint in ((no_label, "39-field file without labels"), (binary, "binary or compressed")):
        with pytest.raises(R.DataError, match=hint) as e:
            list(DataReader(str(path), 8, prefetch=False, warn=lambda m: None, max_bad_fraction=1.0))
        assert str(path) in str(e.value) and "(100%)" in str(e.value)
