"""Where a run continues from: the checkpoint to load and the point in the data after it.

``choose`` picks the checkpoint once (``--resume``: a checkpoint directory, or the newest
one of a root whose whole chain verifies; else a stream's own latest one in
``--save-dir``) and ``pin`` makes ``--resume`` name it, so every later call and every rank
loads that one.  ``checked_meta`` gives its position (a stream: ``stream_at``, the last pass
it holds and, when a signal stopped it inside the next one, that pass and its batches done);
``start_point`` turns a batch run's checkpoint into the epoch and the batches of it already
trained.  The position (``meta``) is checked against the run before it is used: a value out
of range is an error naming it, never a run that silently trains nothing or skips forever.
(Whether the checkpoint fits the run at all is ``mpips.checkpoint.compat``'s question;
``mpips.job.plan`` asks both once.)  ``resume_line`` is the RESUME line.
"""
import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from mpips import checkpoint as ck
from mpips.comm.backoff import COLLECTIVE, Backoff
from mpips.data.binary import part_rows
from mpips.data.sources import is_gzip
from mpips.checkpoint.compat import where

MIN_LINE_BYTES = 2             # no valid text line is shorter: a label and LF (a Criteo line
                               # read padded, a CSV or slot line of empty bags can be that short)


def choose(cfg, warn=None):
    """The checkpoint directory a run continues from, or None (see the module docstring).
    ``--resume auto``: the newest in --save-dir whose chain verifies (newer ones that do not
    are passed over with a line each), or None when it holds none."""
    if cfg.resume == "auto":
        return ck.latest(cfg.save_dir, warn) if os.path.isdir(cfg.save_dir) else None
    if cfg.resume:
        return ck.resolve(cfg.resume, warn)
    if cfg.stream and cfg.save_dir and not cfg.overwrite and os.path.isdir(cfg.save_dir):
        return ck.latest(cfg.save_dir, warn)
    return None


def choose_at_start(cfg, warn=None):
    """:func:`choose`, and when it finds none, :func:`check_unused` (once, before any work)."""
    path = choose(cfg, warn)
    if path is None:
        check_unused(cfg)
    return path


def check_unused(cfg):
    """Refuse a batch run without --resume into a --save-dir that holds checkpoints: its
    fresh model would become the newest there, the one --resume auto, infer and export
    take (unless --overwrite says so)."""
    if cfg.stream or not cfg.save_dir or cfg.overwrite:
        return
    found = ck.list_checkpoints(cfg.save_dir)
    if found:
        raise ValueError(
            f"--save-dir {cfg.save_dir} already holds {len(found)} checkpoint(s) (newest "
            f"{found[-1]['name']}): continue from it with --resume auto, give a new "
            f"--save-dir, or start afresh there with --overwrite")


def pin(cfg, path):
    """``cfg`` with ``--resume`` naming checkpoint directory ``path`` (unchanged if None;
    ``--resume auto`` that found none becomes a fresh start)."""
    if path:
        return dataclasses.replace(cfg, resume=path)
    return dataclasses.replace(cfg, resume="") if cfg.resume == "auto" else cfg


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def checked_meta(path, m, cfg):
    """The position stored in checkpoint ``path`` (manifest ``m``), after checking its types
    and ranges."""
    meta, seq = m["meta"], m["seq"]

    def need(ok, what):
        if not ok:
            raise ck.CheckpointError(f"checkpoint seq {seq} ({path}): its meta {what}; got "
                                     f"{meta!r} (a damaged manifest? resume from another "
                                     "checkpoint)")
    need(isinstance(meta, dict), "is not an object")
    need(meta.get("pass") is None or isinstance(meta["pass"], str), "pass is not a pass name")
    need(_is_int(meta.get("epoch", -1)) and meta.get("epoch", -1) >= -1, "epoch is not >= -1")
    need(_is_int(meta.get("steps", 0)) and meta.get("steps", 0) >= 0, "steps is not >= 0")
    need(isinstance(meta.get("complete", True), bool), "complete is not true/false")
    need(_is_int(meta.get("passes", 0)) and meta.get("passes", 0) >= 0, "passes is not >= 0")
    need(meta.get("in_pass") is None or isinstance(meta["in_pass"], str),
         "in_pass is not a pass name")
    need(meta.get("pass_test") is None or isinstance(meta["pass_test"], dict),
         "pass_test is not an object")
    need(_is_int(meta.get("pass_evicted", 0)) and meta.get("pass_evicted", 0) >= 0,
         "pass_evicted is not >= 0")
    if cfg.stream or not cfg.resume:
        return meta
    epoch, complete = meta.get("epoch", -1), meta.get("complete", True)
    first = epoch + 1 if complete else epoch
    if first >= cfg.epochs:
        where = f"the end of epoch {epoch}" if complete else f"a point in epoch {epoch}"
        raise ck.CheckpointError(
            f"checkpoint seq {seq} ({path}) holds {where}, and --epochs {cfg.epochs} ends "
            f"before epoch {first}: nothing left to train (epochs count from 0; give "
            f"--epochs {first + 1} or more to train on from it)")
    return meta


@dataclass(frozen=True)
class StreamAt:
    """Where a stream continues: after pass ``last`` (None: before its first), with
    ``passes`` passes trained before; when a signal stopped it inside a pass, ``in_pass``
    names it, ``steps`` of its batches (per worker) are trained, ``test`` holds its
    evaluation's record fields (None: not evaluated yet) and ``evicted`` the rows its shrink
    evicted, when no record of the stopped run reported them.  The stream's first pass ever is
    number 0; ``passes`` numbers the next (its shuffle seed and its TRAIN lines)."""
    last: str = None
    passes: int = 0
    in_pass: str = None
    steps: int = 0
    test: dict = None
    evicted: int = 0


def stream_at(meta):
    """The :class:`StreamAt` of a stream checkpoint's checked meta (None: a fresh start)."""
    if meta is None:
        return StreamAt()
    inside = meta.get("in_pass")
    return StreamAt(last=meta.get("pass"), passes=meta.get("passes", 0), in_pass=inside,
                    steps=meta.get("steps", 0) if inside else 0,
                    test=meta.get("pass_test") if inside else None,
                    evicted=meta.get("pass_evicted", 0) if inside else 0)


def max_batches(files, batch_size):
    """An upper bound on the batches of ``batch_size`` rows a worker reads from ``files``
    in an epoch: binary parts by their rows, text by its bytes / MIN_LINE_BYTES; None for
    gzip files, whose text can be any size."""
    rows = 0
    for path in files:
        if os.path.isdir(path):
            rows += part_rows(path)
        elif is_gzip(path):
            return None, None
        else:
            rows += os.path.getsize(path) // MIN_LINE_BYTES
    return -(-rows // batch_size), rows


def start_point(cfg, path, m, files=None, workers=None, piped=False):
    """(epoch, batches to skip in it) to continue from checkpoint ``path`` (manifest ``m``,
    pinned as --resume).  With the training ``files``, a mid-epoch position is checked
    against the batches they hold (with --global-batch: in the smallest worker's batch of
    the run's ``workers``; not when ``piped``: the data come through a command, whose
    output can be any size)."""
    if not cfg.resume or cfg.stream:
        return 0, 0
    meta = checked_meta(path, m, cfg)
    epoch = meta.get("epoch", -1)
    if meta.get("complete", True):
        return epoch + 1, 0
    steps = meta.get("steps", 0)             # saved mid-epoch after `steps` batches
    batch, flag = cfg.batch_size, "--global-batch" if cfg.global_batch else "--batch-size"
    if cfg.global_batch:
        batch = cfg.global_batch // workers if workers else None   # unknown: not checked
    if files is not None and not piped and batch:     # a command's output can be any size
        most, rows = max_batches(files, batch)
        if most is not None and steps > most:
            raise ck.CheckpointError(
                f"checkpoint seq {m['seq']} ({path}) was saved after "
                f"{steps} batches of epoch {epoch}, but the training data hold at most "
                f"{most} batches of {batch} (<= {rows} rows): resume with the "
                f"--train data and {flag} it was saved with")
    return epoch, steps


def first_rank_decides(comm, fn):
    """``fn()`` (a str or None) on rank 0 of ``comm`` only; every rank returns its result or
    raises its error as a ValueError with the same text (None comm: just ``fn()``).  So one
    rank verifies and chooses a checkpoint, and every rank loads the one it chose."""
    if comm is None or comm.size == 1:
        return fn()
    data = b""
    if comm.rank == 0:
        try:
            out = fn()
            data = b"N" if out is None else b"P" + out.encode()
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised there
            text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            data = b"E" + text.encode()
    size = np.array([len(data)], np.int64)
    _wait(comm.Ibcast(size, root=0))
    buf = np.frombuffer(data, np.uint8).copy() if comm.rank == 0 else \
        np.empty(int(size[0]), np.uint8)
    _wait(comm.Ibcast(buf, root=0))
    kind, text = chr(buf[0]), buf[1:].tobytes().decode()
    if kind == "E":
        raise ValueError(text)
    return None if kind == "N" else text


def _wait(req):
    backoff = Backoff(*COLLECTIVE)       # rank 0 may read a large checkpoint meanwhile
    while not req.Test():
        backoff.sleep()


def resume_line(path, manifest):
    """The log line saying which checkpoint a run continues from."""
    return f"RESUME --> {path} ({where(manifest)})"
