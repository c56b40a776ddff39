"""Stream batches from text files of a schema or binary data parts, with prefetch.

Files are read in chunks of ``chunk_bytes`` that end on a newline (never a whole file
in memory; gzip files decompressed as they are read, or a ``pipe_command``'s output, see
``mpips.data.sources``), parsed by numba kernels that release the GIL, and cut into
batches of exactly ``batch_size`` rows that span file boundaries, as if the files were
one stream.  The default Criteo schema keeps its one-hot readers (``mpips.data.criteo``
TSV, ``mpips.data.slot`` for Criteo-shaped slot files, chosen per file by ``fmt``); any
other schema is read by ``mpips.data.formats`` (criteo, csv, slot, multislot text), and
gives CSR batches (``Batch.offsets``) unless its format is one-hot ``criteo``.  Bad lines are skipped, counted in
``reader.stats`` and reported through ``warn`` as ``file:line: ...`` (1-based lines; the
first ``max_warnings`` of each file individually, then one summary line per file);
``strict=True`` raises ``ValueError`` with that message instead.

A file's last line need not end in a newline (real files often end so): it is read as a
line, and when it parses, one line per file notes it (``FileStats.unterminated``).  Under
``strict`` it is refused (``file:line: ... does not end in a newline``): a file cut by a
copy or a writer still at work ends so too, and a line cut inside its last field still
parses, to a wrong id or value.

Binary data parts (directories from ``resolve_paths`` of a ``data_prep.criteo`` output,
see ``mpips.data.binary``) are read memory-mapped in pieces of ``binary.PIECE_ROWS`` rows
and batched in the same stream, so text files and parts can even be mixed.  Their dense
values are normalised at read time with the reader's ``cont_min``/``cont_diff`` when
given, else with the statistics in the split manifest; their ``hash_bucket`` must equal
the reader's.

``shuffle_window=N`` (with ``shuffle_seed``) shuffles rows in memory before batching: the
stream is cut into consecutive windows of at least N rows (at most N plus one chunk or
part piece), each permuted by a generator seeded with ``shuffle_seed`` afresh at every
pass, so every row comes out exactly once and the same seed gives the same order.
"""
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mpips.data import bagparts, bags, binary, criteo, formats, sources
from mpips.data.files import Span, resolve_paths
from mpips.data.parsers import LineParser
from mpips.data.sources import CHUNK_BYTES, MAX_LINE_BYTES, iter_chunks, split_unterminated
from mpips.schema import Schema

PREFETCH_DEPTH = 4  # batches queued ahead by the prefetch thread
PUT_POLL_SECONDS = 0.1  # producer re-checks for close() this often when the queue is full
GET_POLL_SECONDS = 1.0  # consumer re-checks that the producer is alive this often
WAIT_POLL_SECONDS = 0.05  # and calls on_wait this often, when set
EXAMPLES_KEPT = 5  # bad-line examples kept per file in stats


@dataclass
class Batch:
    """One mini-batch (layout shared by every consumer; see docs/data.md)."""

    dense: np.ndarray  # (n, D) float32, normalised
    sparse: np.ndarray  # int64 ids: (n, S) one per slot if offsets is None, else (nnz,) bags
    label: np.ndarray  # (n,) float32, 0/1 (0 without a label column)
    offsets: np.ndarray | None = None  # None, or (n*S + 1,) int64: bag (i, s) is
    #                                    sparse[offsets[i*S + s]:offsets[i*S + s + 1]]

    def __len__(self) -> int:
        return int(self.label.shape[0])


@dataclass
class FileStats:
    rows: int = 0  # rows yielded from this file
    lines: int = 0  # lines read (incl. blank and bad)
    bad: int = 0  # bad lines skipped
    padded: int = 0  # Criteo lines missing trailing fields, read with them empty
    undeclared: int = 0  # tokens of slots the schema does not declare, skipped
    truncated: int = 0  # bags cut to their slot's max_len
    unterminated: int = 0  # 1: the last line has no newline and was read
    examples: list = field(default_factory=list)  # first few "file:line: reason"
    reasons: dict = field(default_factory=dict)  # (reason, detail) -> bad lines listed with it


@dataclass
class ReaderStats:
    """Counts for the current (or last finished) pass over the files."""

    rows: int = 0
    bad_lines: int = 0
    padded: int = 0  # lines read with missing trailing fields empty (Criteo TSV)
    undeclared: int = 0  # tokens of undeclared slots skipped
    truncated: int = 0  # bags cut to max_len
    files: dict = field(default_factory=dict)  # path -> FileStats
    text_rows: int = 0  # rows parsed from text files (with text_bytes: rows per byte)
    text_bytes: int = 0  # bytes of text parsed


class DataError(ValueError):
    """Input data that is mostly or wholly unusable."""


def _stderr_warn(msg: str) -> None:
    print(f"mpips.data: {msg}", file=sys.stderr, flush=True)


def detect_format(path: str) -> str:
    """'slot' if the first non-blank line starts with 'click:', else 'tsv'."""
    with sources.open_input(path) as f:
        while True:
            block = f.read(1 << 16)
            if not block:
                return "tsv"
            stripped = block.lstrip(b"\r\n\t ")
            if stripped:
                if len(stripped) < 6:  # 'click:' may straddle two reads
                    stripped += f.read(6)
                return "slot" if stripped.startswith(b"click:") else "tsv"


def _split_header(data: bytes):
    """(first line, the rest) of a chunk of whole lines."""
    cut = data.find(b"\n") + 1 or len(data)
    return data[:cut], data[cut:]


def _line_text(data: bytes, first: int):
    """A function: line number ``first + k`` -> the bytes of line k of ``data`` (no EOL)."""
    ends = []

    def text(line0):
        if not ends:
            ends.append(np.flatnonzero(np.frombuffer(data, np.uint8) == 10))
        nl, k = ends[0], line0 - first
        a = 0 if k == 0 else int(nl[k - 1]) + 1
        b = int(nl[k]) if k < len(nl) else len(data)
        return bytes(data[a:b]).rstrip(b"\r")
    return text


class _Batcher:
    """Cuts parsed pieces (dense, sparse, label, offsets) into batches of exactly ``size`` rows."""

    def __init__(self, size: int):
        self.size = size
        self.pieces: list = []  # [(dense, sparse, label, offsets)]
        self.count = 0

    def add(self, piece):
        if bags.n_rows(piece):
            self.pieces.append(piece)
            self.count += bags.n_rows(piece)
        while self.count >= self.size:
            yield self._take(self.size)

    def flush(self):
        if self.count:
            yield self._take(self.count)

    def _take(self, n: int) -> Batch:
        taken, k = [], 0
        while k < n:  # within one piece: views, no copy
            p = self.pieces.pop(0)
            m = min(n - k, bags.n_rows(p))
            taken.append(bags.slice_rows(p, 0, m))
            if m < bags.n_rows(p):
                self.pieces.insert(0, bags.slice_rows(p, m, bags.n_rows(p)))
            k += m
        self.count -= n
        return Batch(*bags.concat(taken))


class _Shuffler:
    """Collects pieces into windows of >= ``window`` rows and yields each permuted."""

    def __init__(self, window: int, seed):
        self.window, self.rng = window, np.random.default_rng(seed)
        self.pieces: list = []
        self.count = 0

    def add(self, piece):
        if bags.n_rows(piece):
            self.pieces.append(piece)
            self.count += bags.n_rows(piece)
        if self.count >= self.window:
            yield self._mix()

    def flush(self):
        if self.count:
            yield self._mix()

    def _mix(self):
        whole = bags.concat(self.pieces)
        perm = self.rng.permutation(self.count)
        self.pieces, self.count = [], 0
        return bags.take(whole, perm)


class DataReader:
    """Iterable of ``Batch`` over ``files`` (a path spec or list; see ``resolve_paths``).

    Each ``iter()`` is one pass over all files in order; ``stats`` describes that pass.
    With ``prefetch=True`` a background thread parses ahead (queue of ``PREFETCH_DEPTH``
    batches); its exceptions are raised in the consumer; ``close()`` (also called when
    the iteration ends or the generator is dropped) stops it.
    """

    def __init__(self, files, batch_size: int, *, fmt: str = "auto", strict: bool = False,
                 hash_bucket: int = 0, cont_min=None, cont_diff=None, has_label: bool = True,
                 prefetch: bool = True, drop_last: bool = False, warn=None,
                 chunk_bytes: int = CHUNK_BYTES, max_warnings: int = 10,
                 shuffle_window: int = 0, shuffle_seed=None, max_bad_fraction=None,
                 schema: Schema | None = None, pipe_timeout: float = sources.PIPE_TIMEOUT):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        self.parser = LineParser(schema, fmt=fmt, has_label=has_label, hash_bucket=hash_bucket,
                                 cont_min=cont_min, cont_diff=cont_diff, pad=not strict)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1; got {chunk_bytes}")
        self.files = resolve_paths(files)
        self.batch_size = int(batch_size)
        self.fmt, self.strict, self.hash_bucket = fmt, strict, int(hash_bucket)
        self.schema = self.parser.schema
        self.text = self.parser.text  # the reader of a non-default schema (formats.TextFormat)
        self.norm = self.parser.norm  # the Criteo schema's dense normalisation
        self.explicit_norm = cont_min is not None or cont_diff is not None
        self.has_label, self.prefetch, self.drop_last = has_label, prefetch, drop_last
        self.warn = warn or _stderr_warn
        self.chunk_bytes, self.max_warnings = int(chunk_bytes), int(max_warnings)
        self.shuffle_window, self.shuffle_seed = int(shuffle_window), shuffle_seed
        self.max_bad_fraction = max_bad_fraction    # None: count and skip, never fail
        self.pipe_timeout = float(pipe_timeout)     # seconds a pipe command may send nothing
        self.stats = ReaderStats()
        self._stop = threading.Event()
        self._thread = None
        self._queue = None
        self.current = ""   # the file being read (set by the prefetch thread)
        self.on_wait = None     # on_wait(t0): called while the consumer waits for a batch
                                # since time.monotonic() t0 (a worker answers status requests)

    # ---- parsing (runs in the prefetch thread when prefetch=True) ----
    def _report(self, path: str, fst: FileStats, records, base=None, text=None) -> None:
        """Count and report bad lines ``records``: iterable of (line0, reason, detail);
        ``base()`` gives the line number the line0s count from (a span's first line),
        ``text(line0)`` the line's bytes (to show a bad value)."""
        for line0, reason, detail in records:
            shown = self.strict or len(fst.examples) < EXAMPLES_KEPT or fst.bad < self.max_warnings
            if shown:
                line = line0 + (base() if base is not None else 0)
                words = self.parser.describe(reason, detail, None if text is None else text(line0))
                msg = f"{path}:{line + 1}: malformed line skipped: {words}"
                if self.strict:
                    raise ValueError(msg + " (strict mode; run without --strict to skip such lines)")
                if len(fst.examples) < EXAMPLES_KEPT:
                    fst.examples.append(msg)
                if fst.bad < self.max_warnings:
                    self.warn(msg)
            fst.bad += 1
            fst.reasons[reason, detail] = fst.reasons.get((reason, detail), 0) + 1

    def _open_span(self, span: Span):
        """(stream, line base function, header line or None) to read ``span``: the file's
        header when the span does not start at the file's start."""
        stream = sources.open_span(span.path, span.start, span.stop)
        begin, cache = stream.begin, []

        def base():
            if not cache:
                cache.append(sources.lines_before(span.path, begin))
            return cache[0]
        header = None
        if begin > 0 and self.parser.needs_header:
            with open(span.path, "rb") as f:            # (a span is a plain file)
                header = f.readline(MAX_LINE_BYTES)
        return stream, base, header

    def iter_parsed(self, path, parse=None, stream=None):
        """Yield ``(ParseResult, nbytes)`` per chunk of text file ``path`` (or ``Span``).

        Updates ``stats`` and reports bad lines as the batches do.  ``parse(fmt, data)``
        replaces the default parser (``data_prep.criteo`` uses it for raw values).
        ``stream``: read this file object (a pipe command's stdout) instead of the file.
        """
        name = str(path)
        fst = self.stats.files.setdefault(name, FileStats())
        fmt = base = last = None
        parse = parse or self.parser.parse
        if isinstance(path, Span):
            stream, base, header = self._open_span(path)
            path = path.path
            if header is not None:
                fmt = self.schema.format
                parse = self.parser.with_header(header, path)
        for data, first, too_long in iter_chunks(path, self.chunk_bytes, stream=stream):
            if fmt is None:
                fmt = self.parser.format_of(data)
                if self.parser.needs_header:
                    header, data = _split_header(data)
                    parse = self.parser.with_header(header, path)
                    first += 1
            self._report(path, fst, ((ln, criteo.BAD_LINE_TOO_LONG, MAX_LINE_BYTES)
                                     for ln in too_long), base)
            data, cut = split_unterminated(data)      # only the file's end can lack LF
            if cut and not self.strict:               # read it as a line
                data, cut, last = data + cut + b"\n", b"", first + data.count(b"\n")
            res = parse(fmt, data)
            self._report(path, fst, ((first + int(b[0]), int(b[1]), int(b[2]))
                                     for b in res.bad), base, _line_text(data, first))
            unlisted = res.n_bad - res.bad.shape[0]  # beyond the kernel's record capacity
            fst.bad += unlisted
            fst.lines = first + res.n_lines
            if cut:
                ln = first + data.count(b"\n")
                self._report(path, fst, [(ln, criteo.BAD_NO_NEWLINE, len(cut))], base)
                fst.lines = ln + 1
                self.stats.bad_lines += 1
            fst.rows += res.n_rows
            self._count(fst, res)
            self.stats.rows += res.n_rows
            self.stats.bad_lines += len(too_long) + res.n_bad
            self.stats.text_rows += res.n_rows
            self.stats.text_bytes += len(data)
            if last is not None and not (res.bad[:, 0] == last - first).any():
                fst.unterminated = 1
            yield res, len(data)
        if fst.bad > self.max_warnings:
            self.warn(f"{name}: {fst.bad - self.max_warnings} more malformed lines not shown "
                      f"({fst.bad} in this file)")
        self._summarise(name, fst)
        self._check_bad_share(path, fst, fmt)

    def _count(self, fst: FileStats, res) -> None:
        """Add a chunk's padded lines, undeclared tokens and truncated bags to the stats."""
        for key in ("padded", "undeclared", "truncated"):
            k = getattr(res, key)
            setattr(fst, key, getattr(fst, key) + k)
            setattr(self.stats, key, getattr(self.stats, key) + k)

    def _summarise(self, path: str, fst: FileStats) -> None:
        """One line per file for lines padded, tokens skipped and bags truncated."""
        said = []
        if fst.padded:
            said.append(f"{fst.padded} lines missing trailing fields read with them empty "
                        f"(--strict rejects them)")
        if fst.undeclared:
            said.append(f"{fst.undeclared} tokens of slots the schema does not declare skipped")
        if fst.truncated:
            said.append(f"{fst.truncated} bags cut to their max_len")
        if fst.unterminated:
            said.append(f"the last line (line {fst.lines}) has no newline; read as complete "
                        f"(--strict refuses it, as a file cut short ends so)")
        if said:
            self.warn(f"{path}: " + "; ".join(said))

    def _check_bad_share(self, path, fst, fmt):
        """Fail on a file with no valid line, or whose malformed share passes the limit."""
        limit = self.max_bad_fraction
        if limit is None or not fst.bad or (fst.rows and fst.bad <= limit * (fst.bad + fst.rows)):
            return
        (reason, detail), k = max(fst.reasons.items(), key=lambda x: x[1])
        share = fst.bad / (fst.bad + fst.rows)
        raise DataError(
            f"{path}: {fst.bad} of {fst.bad + fst.rows} lines malformed ({100 * share:.0f}%"
            f"{'' if not fst.rows else f', above --max-bad-fraction {limit:g}'}); most common: "
            f"{self.parser.describe(reason, detail)} ({k} of the "
            f"{sum(fst.reasons.values())} bad lines examined); "
            f"hint: {self._hint(path, fmt, reason, detail)}")

    def _hint(self, path, fmt, reason, detail):
        if self.text is None:
            return criteo.hint(path, fmt, reason, detail, self.has_label)
        if reason == criteo.BAD_LINE_TOO_LONG or criteo.looks_binary(path):
            return "binary data? text files (or .gz) in the schema's format are expected"
        if self.schema.format == "csv" and reason == formats.B.BAD_COLUMNS:
            other = formats.delimiter_for(sources.first_line(path), len(self.text.names),
                                          self.schema.delimiter)
            if other is not None:
                return (f"the lines split into {len(self.text.names)} columns on {other!r}, "
                        f"not on {self.schema.delimiter!r}: set delimiter = "
                        f"{formats.json.dumps(other)} in the schema")
        return f"check the file against the schema ({self.schema.describe()}; docs/data.md)"

    def _iter_part(self, path: str):
        """Yield (dense, sparse, label) pieces of one binary data part, counting rows."""
        fst = self.stats.files.setdefault(path, FileStats())
        for dense, sparse, label, offsets in self._part_pieces(path):
            n = label.shape[0]
            fst.rows += n
            fst.lines += n
            self.stats.rows += n
            yield dense, sparse, label, offsets

    def _part_pieces(self, path: str):
        """(dense, sparse, label, offsets) pieces of a part: Criteo's raw layout (version 1)
        or bags of any schema (version 2, checked against the reader's schema)."""
        man = binary.read_manifest(os.path.dirname(os.path.normpath(path)))
        if bagparts.is_bag_manifest(man):
            yield from bagparts.iter_part(path, man, self.schema, self.hash_bucket)
            return
        if self.text is not None:
            raise DataError(f"{path}: binary data parts hold Criteo's 13 dense and 26 one-hot "
                            f"columns, not this schema's ({self.schema.describe()}); give "
                            f"its text files instead")
        norm = self.norm if self.explicit_norm else None
        for dense, sparse, label in binary.iter_part(path, norm, self.hash_bucket):
            yield dense, sparse, label, None

    def size(self):
        """(rows of the binary parts, bytes of the text files) this reader will read."""
        rows = nbytes = 0
        for path in self.files:
            if isinstance(path, Span):
                nbytes += path.stop - path.start
            elif os.path.isdir(path):
                rows += binary.part_rows(path)
            else:
                nbytes += sources.text_size(path)
        return rows, nbytes

    def _iter_pieces(self):
        """(dense, sparse, label, offsets) pieces of all files in order."""
        pipe = None
        if self.schema.pipe_command:
            if any(isinstance(p, Span) for p in self.files):
                raise ValueError("a pipe command reads whole files, not byte spans")
            pipe = sources.PipeRunner(self.schema.pipe_command,
                                      [p for p in self.files if not os.path.isdir(p)],
                                      timeout=self.pipe_timeout)
        try:
            for path in self.files:
                self.current = str(path)
                if not isinstance(path, Span) and os.path.isdir(path):
                    yield from self._iter_part(path)
                    continue
                stream = pipe.open(path) if pipe is not None else None
                for res, _ in self.iter_parsed(path, stream=stream):
                    yield res.dense, res.sparse, res.label, res.offsets
        finally:
            if pipe is not None:
                pipe.close()

    def _iter_batches(self):
        self.stats = ReaderStats()
        batcher = _Batcher(self.batch_size)
        if self.shuffle_window > 0:
            mixer = _Shuffler(self.shuffle_window, self.shuffle_seed)
            for piece in self._iter_pieces():
                for mixed in mixer.add(piece):
                    yield from batcher.add(mixed)
            for mixed in mixer.flush():
                yield from batcher.add(mixed)
        else:
            for piece in self._iter_pieces():
                yield from batcher.add(piece)
        if not self.drop_last:
            yield from batcher.flush()

    # ---- prefetch thread ----
    def _produce(self, q: queue.Queue, stop: threading.Event) -> None:
        try:
            for item in self._iter_batches():
                if not self._put(q, stop, item):
                    return
            self._put(q, stop, ("end", None))
        except BaseException as exc:  # handed to the consumer, re-raised there
            self._put(q, stop, ("error", exc))

    @staticmethod
    def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=PUT_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _consume(self, q: queue.Queue, thread: threading.Thread):
        poll = GET_POLL_SECONDS if self.on_wait is None else WAIT_POLL_SECONDS
        t0 = None
        while True:
            try:
                item = q.get(timeout=poll)
            except queue.Empty:
                if not thread.is_alive() and q.empty():
                    raise RuntimeError("data prefetch thread stopped without finishing")
                if self.on_wait is not None:
                    t0 = time.monotonic() if t0 is None else t0
                    self.on_wait(t0)
                continue
            t0 = None
            if isinstance(item, Batch):
                yield item
            elif item[0] == "end":
                return
            else:
                raise item[1]

    def __iter__(self):
        if not self.prefetch:
            yield from self._iter_batches()
            return
        self.close()
        stop = threading.Event()
        q: queue.Queue = queue.Queue(maxsize=PREFETCH_DEPTH)
        thread = threading.Thread(target=self._produce, args=(q, stop),
                                  name="mpips-prefetch", daemon=True)
        self._stop, self._queue, self._thread = stop, q, thread
        thread.start()
        try:
            yield from self._consume(q, thread)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the prefetch thread (if any) and drop queued batches."""
        thread, q = self._thread, self._queue
        if thread is None:
            return
        self._stop.set()
        while thread.is_alive():
            try:
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=PUT_POLL_SECONDS)
        self._thread = self._queue = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
