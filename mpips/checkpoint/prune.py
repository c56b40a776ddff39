"""Removing checkpoints a root no longer needs: ``--keep N`` and ``--overwrite``.

:func:`prune` keeps the newest ``keep`` committed checkpoints of a root and every element of
their chains (the base and the deltas a kept delta is made of), so a delta is never left
without its base.  Checkpoints older than ``drop_before`` (the first one a ``--overwrite``
run saved) are removed whatever ``keep`` says, unless a kept chain needs them; directories
that are not committed (no valid manifest) are left alone: :func:`mpips.checkpoint.latest`
passes over them with a line, and they may be a save still being written.

A checkpoint is removed newest first, its manifest before its files: an interrupted prune
leaves uncommitted directories (never taken for checkpoints), never a committed delta
whose base is gone.
"""
import os
import shutil

from mpips.checkpoint.manifest import MANIFEST, fsync, list_checkpoints, read_manifest


def needed(root, names):
    """The names of ``names`` and of every element of their chains (directory names)."""
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        parent = read_manifest(os.path.join(root, name)).get("parent")
        if parent:
            todo.append(parent)
    return out


def prune(root, keep=0, drop_before=None):
    """Remove the committed checkpoints of ``root`` that neither the newest ``keep`` (0: all)
    nor their chains need, and with ``drop_before`` (a seq) every one older than it that no
    kept chain needs.  Returns the names removed, newest first."""
    valid = [c for c in list_checkpoints(root) if c["valid"]]
    if not valid:
        return []
    recent = valid[-keep:] if keep else valid
    if drop_before is not None:
        recent = [c for c in recent if c["seq"] >= drop_before] or valid[-1:]
    kept = needed(root, [c["name"] for c in recent])
    gone = [c for c in reversed(valid) if c["name"] not in kept]
    for c in gone:
        os.remove(os.path.join(c["path"], MANIFEST))        # uncommitted from here on
        fsync(c["path"])
        shutil.rmtree(c["path"])
    if gone:
        fsync(root)
    return [c["name"] for c in gone]
