"""Input file lists: resolve a path spec, split files over workers.

A spec is a file, a directory (all regular files in it, sorted, ignoring names that
start with '.' or '_' such as ``_SUCCESS``), or a glob pattern; several specs may be
given as a list or comma-separated.  The result keeps the order of the specs, each
spec's matches sorted, duplicates removed.

Binary data parts (``mpips.data.binary``) count as files: a split directory (one with an
mpips ``manifest.json``, e.g. ``OUT/train``) expands to its part directories in manifest
order, and a part directory (or a glob such as ``OUT/train/part-000*``) stands for
itself, so ``split_files`` hands whole parts to workers.  A prep root (``OUT``) is an
error that names the split directories to use instead.

With fewer files than workers, plain text files are shared by bytes (``worker_files``):
the files are taken as one run of bytes cut into W equal shares, and worker w reads the
lines that *start* in its share (``Span``; ``mpips.data.sources.open_span`` aligns the
cuts to line starts), so every line is read exactly once, by one worker.  A newline
always ends a line, also inside a CSV quote (the readers never join lines), so the cut
points agree with how the file is parsed.  Gzip files, binary parts and a pipe
command's input are not cut: with any of those, a worker reads whole files.
"""
import errno
import glob
import os
import stat
from dataclasses import dataclass

import numpy as np

from mpips.data import binary


@dataclass(frozen=True)
class Span:
    """The lines of text file ``path`` that start in bytes [start, stop)."""

    path: str
    start: int
    stop: int

    def __str__(self) -> str:
        return f"{self.path}[bytes {self.start}-{self.stop}]"


def _split_spec(spec) -> list[str]:
    items = [spec] if isinstance(spec, (str, os.PathLike, Span)) else list(spec)
    out: list = []
    for item in items:
        if isinstance(item, Span):
            out.append(item)
            continue
        out.extend(p.strip() for p in os.fspath(item).split(",") if p.strip())
    return out


def _visible(name: str) -> bool:
    return not (name.startswith(".") or name.startswith("_"))


def _is_input(path: str) -> bool:
    return os.path.isfile(path) or binary.is_part_dir(path)


def _resolve_one(part: str) -> list[str]:
    if os.path.isdir(part):
        if binary.is_split_dir(part):
            return binary.list_parts(part)
        if binary.is_part_dir(part):
            return [part]
        if binary.is_prep_root(part):
            subs = sorted(n for n in os.listdir(part) if binary.is_split_dir(os.path.join(part, n)))
            raise FileNotFoundError(
                f"input path {part!r} is a data_prep output root; give one of its split "
                f"directories instead: {', '.join(os.path.join(part, n) for n in subs)}")
        names = sorted(n for n in os.listdir(part) if _visible(n))
        return [p for p in (os.path.join(part, n) for n in names) if os.path.isfile(p)]
    if os.path.isfile(part):
        return [part]
    if glob.has_magic(part):
        hits = sorted(glob.glob(part))
        return [p for p in hits if _is_input(p) and _visible(os.path.basename(p))]
    return []


def _kind(path: str) -> str:
    """What a path that exists but is neither a file nor a directory is."""
    mode = os.stat(path).st_mode
    for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


def resolve_paths(spec) -> list[str]:
    """Expand ``spec`` (str, path, or list of them; comma-separated allowed) to files.

    Raises
    ------
    FileNotFoundError
        If the spec is empty, or any part of it matches no regular file.
    """
    parts = _split_spec(spec)
    if not parts:
        raise FileNotFoundError(f"no input files: empty path spec {spec!r}")
    files: list[str] = []
    seen: set[str] = set()
    for part in parts:
        if isinstance(part, Span):
            files.append(part)
            continue
        hits = _resolve_one(part)
        if not hits:
            what = _missing(part)
            if os.path.isdir(part):
                what = "directory has no data files"
            elif os.path.exists(part):
                what = (f"{_kind(part)}, not a regular file: mpips reads each file more than "
                        f"once (its size, then every epoch); write the data to a file, or "
                        f"feed a file through --pipe-command")
            raise FileNotFoundError(f"input path {part!r} (from spec {spec!r}): {what}")
        for h in hits:
            key = os.path.abspath(h)
            if key not in seen:
                seen.add(key)
                files.append(h)
    return files


def _missing(part):
    """Why ``part`` names nothing to read: a symbolic link loop, a broken link, or nothing."""
    try:
        os.stat(part)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return ("a symbolic link loop (a link that leads, through links, back to itself): "
                    "point it at the data file")
        if os.path.islink(part):
            return (f"a broken symbolic link (to {os.readlink(part)!r}, which does not "
                    f"exist): point it at the data file")
    return "no such file, directory or glob match"


def split_files(files: list[str], n_workers: int, index: int) -> list[str]:
    """Worker ``index``'s contiguous block of ``files`` (Paddle's get_file_shard).

    Block sizes differ by at most one; the first ``len(files) % n_workers`` workers get
    the larger blocks.  Every file goes to exactly one worker.
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1; got {n_workers}")
    if not 0 <= index < n_workers:
        raise ValueError(f"worker index {index} out of range for {n_workers} workers")
    n = len(files)
    if n < n_workers:
        raise ValueError(
            f"{n} input file(s) for {n_workers} workers: every worker needs at least one "
            f"file (split the data into >= {n_workers} files, e.g. with "
            f"`split -n l/{n_workers}`, or run fewer workers)")
    base, extra = divmod(n, n_workers)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return list(files[start:stop])


def splittable(path) -> bool:
    """Can ``path`` be shared by byte ranges: a plain (not gzip) regular file."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(2) != b"\x1f\x8b"


def byte_share(files: list[str], n_workers: int, index: int) -> list:
    """Worker ``index``'s share of the bytes of ``files`` taken end to end: whole files
    (paths) and ``Span``s of the files its share cuts (see the module docstring)."""
    sizes = [os.path.getsize(p) for p in files]
    total = sum(sizes)
    lo, hi = index * total // n_workers, (index + 1) * total // n_workers
    out: list = []
    base = 0
    for path, size in zip(files, sizes):
        a, b = max(lo, base) - base, min(hi, base + size) - base
        if a < b:
            out.append(path if (a, b) == (0, size) else Span(path, a, b))
        base += size
    return out


def worker_files(files: list[str], n_workers: int, index: int, shuffle_seed=None,
                 epoch: int = 0, split: bool = True) -> list:
    """Worker ``index``'s files for one epoch.

    In file order (``shuffle_seed`` None): ``split_files``; when there are fewer files
    than workers, ``byte_share`` if every file is ``splittable`` (and ``split``: False for
    a pipe command's input), else one file in ``n_workers`` (``files[index::n_workers]``,
    so some workers have none).  With a seed, the list is first permuted by a generator
    seeded with ``(shuffle_seed, epoch)`` — the same permutation on every worker, so the
    blocks still partition the files, and a new one each epoch.
    """
    if shuffle_seed is not None and len(files) > 1:
        order = np.random.default_rng([int(shuffle_seed), int(epoch)]).permutation(len(files))
        files = [files[i] for i in order]
    if len(files) >= n_workers:
        return split_files(files, n_workers, index)
    if split and files and all(splittable(p) for p in files):
        return byte_share(files, n_workers, index)
    return list(files[index::n_workers])


def eval_files(files: list[str], n_workers: int, index: int, split: bool = True) -> list:
    """Worker ``index``'s test files: one in ``n_workers`` (``files[index::n_workers]``), or
    its ``byte_share`` when there are fewer files than workers and they can be shared."""
    if len(files) < n_workers and split and files and all(splittable(p) for p in files):
        return byte_share(files, n_workers, index)
    return list(files[index::n_workers])


def readers_for(files: list[str], n_workers: int, split: bool = True) -> int:
    """How many of ``n_workers`` get data from ``files`` (``worker_files``): all when there
    are enough files or they can be shared by bytes, else one per file."""
    if len(files) >= n_workers or (split and files and all(splittable(p) for p in files)):
        return n_workers
    return len(files)
