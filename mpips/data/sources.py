"""Where a text file's bytes come from: the file, its gzip stream, or a pipe command.

``open_input(path)`` opens a file for reading, decompressing it on the fly when it is gzip
(by its magic bytes, whatever its name): the reader's chunks are the same as the plain
file's.  ``PipeRunner(cmd, files)`` runs ``cmd`` (a shell command, as Paddle's Dataset
``pipe_command``) once per file with the file on its stdin, and ``open(path)`` gives its
stdout as a stream.  Processes are started ``PIPE_AHEAD`` files ahead and drained by a
thread each into a bounded queue, so the generators of the next files run while this one
is parsed.  A command that exits non-zero fails the read with one line naming the file,
the exit code and the last line it wrote to stderr; one that sends nothing for ``timeout``
seconds (``--pipe-timeout``), or closes its output and then does not exit within that
time, fails it the same way.  ``close()`` kills the command's process group.
However mpips ends (an error, ``atexit``, SIGTERM, SIGKILL, ``MPI_Abort``), no command is
left running: every group started is registered with a guard, a small process of its own
that reads the registrations on a pipe and kills the groups still registered when that
pipe reaches its end, which happens when this process is gone, whatever ended it.
``open_span(path, start, stop)`` reads the lines of a plain file that start in bytes
[start, stop) (a worker's share of a file, ``mpips.data.files.Span``); ``iter_chunks``
cuts any of them into chunks of whole lines.
"""
import atexit
import gzip
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import zlib

GZIP_MAGIC = b"\x1f\x8b"
PIPE_AHEAD = 2  # processes started ahead of the file being read
PIPE_BLOCK = 1 << 20  # bytes per read from a command's stdout
PIPE_QUEUE = 16  # blocks buffered per command (so at most ~16 MiB ahead each)
PUT_POLL_SECONDS = 0.1
PIPE_TIMEOUT = 90.0  # a reader's default (a run's: mpips.config.pipe_timeout, below --peer-timeout)
JOIN_SECONDS = 1.0  # wait for a drain thread after its command was killed


class PipeError(ValueError):
    """A pipe command that failed (the message names file, exit code, last stderr line)."""


def is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def text_size(path: str) -> int:
    """Bytes of text ``path`` gives: its size, or a gzip file's uncompressed size (the
    ISIZE trailer, exact below 4 GiB; a rough 4x the file above)."""
    size = os.path.getsize(path)
    if size < 18 or not is_gzip(path):
        return size
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        isize = int.from_bytes(f.read(4), "little")
    return isize if isize >= size else 4 * size


class GzipError(ValueError):
    """A corrupt or truncated gzip file (the message names it)."""


class _Gzip:
    """A gzip file read as it decompresses; an error names the file."""

    def __init__(self, path: str):
        self.path, self.f = path, gzip.open(path, "rb")

    def read(self, n: int = -1) -> bytes:
        try:
            return self.f.read(n)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise GzipError(f"{self.path}: a corrupt or truncated gzip file "
                            f"({type(e).__name__}: {e}); compress it again, or give it "
                            f"uncompressed") from None

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_input(path: str):
    """A binary file object of ``path``'s text (gzip decompressed as it is read)."""
    if is_gzip(path):
        return _Gzip(path)
    return open(path, "rb")


CHUNK_BYTES = 4 << 20  # read size; a chunk is cut at its last newline
MAX_LINE_BYTES = 1 << 20  # a longer "line" is garbage: reported and skipped
SCAN_BLOCK = 1 << 16  # bytes per read when looking for a line start or counting lines


def iter_chunks(path: str, chunk_bytes: int = CHUNK_BYTES, max_line: int | None = None,
                stream=None):
    """Yield ``(data, first_line, too_long)`` for ``path`` (gzip decompressed), or for
    ``stream`` (a binary file object, e.g. a pipe command's stdout) when given.

    ``data`` holds whole lines (ends with LF except possibly at EOF); ``first_line`` is
    the 0-based number of its first line.  ``too_long`` lists 0-based numbers of lines
    longer than ``max_line`` that were dropped before ``data``.
    """
    max_line = MAX_LINE_BYTES if max_line is None else max_line
    line = 0
    rest = b""
    too_long: list[int] = []
    with (stream if stream is not None else open_input(path)) as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                break
            data = rest + block if rest else block
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                if len(rest) > max_line:  # no newline in sight: skip to the next one
                    too_long.append(line)
                    rest = _skip_to_newline(f, chunk_bytes)
                    line += 1
                continue
            yield data[:cut], line, too_long
            too_long = []
            line += data.count(b"\n", 0, cut)
            rest = data[cut:]
    if rest or too_long:
        yield rest, line, too_long


def split_unterminated(data: bytes):
    """(whole lines, last line) of a chunk: the part after its last LF (the end of a file
    that does not end in a newline), or b"" when there is none or it is a lone CR."""
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    if not tail.strip(b"\r"):
        return data, b""
    return data[:cut], tail


def _skip_to_newline(f, chunk_bytes: int) -> bytes:
    """Consume ``f`` up to and including the next LF; return what follows it."""
    while True:
        block = f.read(chunk_bytes)
        if not block:
            return b""
        i = block.find(b"\n")
        if i >= 0:
            return block[i + 1:]


def first_line(path) -> str:
    """The first line of ``path``'s text, decoded, without its line end."""
    with open_input(path) as f:
        return f.readline(MAX_LINE_BYTES).decode("utf-8", "replace").rstrip("\r\n")


def line_start(f, pos: int) -> int:
    """The first line start at or after byte ``pos`` of binary file ``f``: 0, a byte just
    after a LF, or the file's size."""
    if pos <= 0:
        return 0
    f.seek(pos - 1)
    at = pos - 1
    while True:
        block = f.read(SCAN_BLOCK)
        if not block:
            return at
        i = block.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(block)


def lines_before(path: str, pos: int) -> int:
    """Newlines in the first ``pos`` bytes of ``path`` (so the 0-based number of the line
    starting at a line start ``pos``)."""
    n = 0
    with open(path, "rb") as f:
        while pos > 0:
            block = f.read(min(pos, 16 * SCAN_BLOCK))
            if not block:
                break
            n += block.count(b"\n")
            pos -= len(block)
    return n


class SpanFile:
    """A binary reader of the whole lines of ``path`` that start in bytes [start, stop):
    ``begin``/``end`` are those bounds moved to line starts (so spans that meet share no
    line and miss none)."""

    def __init__(self, path: str, start: int, stop: int):
        self.f = open(path, "rb")
        try:
            self.begin = line_start(self.f, start)
            self.end = max(self.begin, line_start(self.f, stop))
            self.f.seek(self.begin)
        except BaseException:
            self.f.close()
            raise
        self.left = self.end - self.begin

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        block = self.f.read(n) if n else b""
        self.left -= len(block)
        return block

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_span(path: str, start: int, stop: int) -> SpanFile:
    return SpanFile(path, start, stop)


# The guard: reads "+PGID" / "-PGID" lines; at the end of its input (this process gone,
# however) it SIGKILLs the groups still registered.  Its own session: a launcher that
# kills this rank's group does not take the guard with it.
_GUARD_CODE = """\
import os, signal, sys
live = set()
for line in sys.stdin:
    (live.add if line[0] == "+" else live.discard)(int(line[1:]))
for group in live:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""
_guard = None
_live: set = set()  # process groups of commands started and not yet reaped
_lock = threading.Lock()


def _register(op: str, group: int) -> None:
    """Tell the guard (started at the first command) that ``group`` started (+) or is
    about to be reaped (-)."""
    global _guard
    with _lock:
        (_live.add if op == "+" else _live.discard)(group)
        lines = f"{op}{group}\n"
        if _guard is None or _guard.poll() is not None:
            _guard = subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD_CODE],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
            lines = "".join(f"+{g}\n" for g in _live)     # all that live, to a new guard
        try:
            _guard.stdin.write(lines.encode())
            _guard.stdin.flush()
        except OSError:  # the guard is gone: the next registration starts another
            pass


def _kill_group(group: int) -> None:
    try:  # the whole group: a shell's children may hold the pipe open
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _kill_live() -> None:
    """At a normal interpreter exit: kill what is still running (the guard would too)."""
    for group in list(_live):
        _kill_group(group)


class _PipeStream:
    """stdout of one command run, read block by block through a draining thread."""

    def __init__(self, cmd: str, path: str, timeout: float = PIPE_TIMEOUT):
        self.cmd, self.path, self.timeout = cmd, path, float(timeout)
        self.err = tempfile.TemporaryFile()
        with open(path, "rb") as stdin:
            self.proc = subprocess.Popen(cmd, shell=True, stdin=stdin, stdout=subprocess.PIPE,
                                         stderr=self.err, start_new_session=True)
        _register("+", self.proc.pid)
        self.q: queue.Queue = queue.Queue(maxsize=PIPE_QUEUE)
        self.stop = threading.Event()
        self.done = False
        self.error = None  # an OSError reading the command's stdout
        self.thread = threading.Thread(target=self._drain, daemon=True, name="mpips-pipe")
        self.thread.start()

    def _drain(self):
        """Move stdout into the queue; always ends with b"" (EOF, or a read error)."""
        fd = self.proc.stdout.fileno()
        try:
            while True:
                block = os.read(fd, PIPE_BLOCK)
                if not block or not self._put(block):
                    break
        except OSError as e:  # reported by read() as the command's failure
            self.error = e
        self._put(b"")

    def _put(self, block: bytes) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(block, timeout=PUT_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def read(self, n: int = -1) -> bytes:
        """The next block of output (any size), b"" at the end; raises PipeError if the
        command failed."""
        if self.done:
            return b""
        try:
            block = self.q.get(timeout=self.timeout)
        except queue.Empty:
            raise PipeError(f"{self.path}: --pipe-command {self.cmd!r} sent nothing for "
                            f"{self.timeout:g} s (--pipe-timeout); stopped it") from None
        if not block:
            self.done = True
            self._check()
        return block

    def _check(self):
        try:
            rc = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise PipeError(f"{self.path}: --pipe-command {self.cmd!r} closed its output but "
                            f"did not exit within {self.timeout:g} s (--pipe-timeout); "
                            f"stopped it") from None
        if self.error is not None:
            raise PipeError(f"{self.path}: reading the output of --pipe-command {self.cmd!r} "
                            f"failed: {self.error}")
        if rc != 0:
            raise PipeError(f"{self.path}: --pipe-command {self.cmd!r} exited with code {rc}"
                            f"{self._last_err()}")

    def _last_err(self) -> str:
        self.err.seek(0)
        lines = [ln.strip() for ln in self.err.read().decode(errors="replace").splitlines()]
        lines = [ln for ln in lines if ln]
        return f": {lines[-1]}" if lines else " (nothing on stderr)"

    def close(self):
        self.stop.set()
        _kill_group(self.proc.pid)
        _register("-", self.proc.pid)  # before the reap: until then no new group has its id
        self.proc.wait()
        self.thread.join(JOIN_SECONDS)  # a process outside the group may hold the pipe
        if not self.thread.is_alive():
            self.proc.stdout.close()
        self.err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PipeRunner:
    """Runs ``cmd`` per file of ``files`` in order, ``ahead`` processes ahead."""

    def __init__(self, cmd: str, files, ahead: int = PIPE_AHEAD, timeout: float = PIPE_TIMEOUT):
        self.cmd, self.files, self.ahead, self.timeout = cmd, list(files), int(ahead), timeout
        self.running: dict = {}  # path -> _PipeStream started, not yet handed out
        self.next = 0  # index in files of the next process to start

    def open(self, path: str) -> _PipeStream:
        """The command's stdout for ``path`` (a stream to use in a ``with``)."""
        stream = self.running.pop(path, None) or _PipeStream(self.cmd, path, self.timeout)
        if path in self.files:
            self.next = max(self.next, self.files.index(path) + 1)
        while self.next < len(self.files) and len(self.running) < self.ahead:
            p = self.files[self.next]
            self.running[p] = _PipeStream(self.cmd, p, self.timeout)
            self.next += 1
        return stream

    def close(self):
        for s in self.running.values():
            s.close()
        self.running.clear()
