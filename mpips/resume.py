"""Where a run continues from: the checkpoint to load and the point in the data after it.

``resume_point`` picks the checkpoint (``--resume``, or a stream's own latest one in
``--save-dir``) and the last pass it holds; ``start_point`` turns a batch run's checkpoint
into the epoch and the batches of it already trained.
"""
import os

from mpips import checkpoint as ck


def resume_point(cfg):
    """(checkpoint path or None, last pass name or None) a run continues from.

    `--resume` names it; a stream also resumes by itself from the latest checkpoint in
    `--save-dir` (restarted with the same command).
    """
    path = None
    if cfg.resume:
        path = ck.resolve(cfg.resume)
    elif cfg.stream and cfg.save_dir and os.path.isdir(cfg.save_dir):
        path = ck.latest(cfg.save_dir)
    if path is None:
        return None, None
    return path, ck.read_manifest(path)["meta"].get("pass")


def start_point(cfg):
    """(epoch, batches to skip in it) to continue from the --resume checkpoint."""
    if not cfg.resume or cfg.stream:
        return 0, 0
    meta = ck.read_manifest(ck.resolve(cfg.resume))["meta"]
    epoch = int(meta.get("epoch", -1))
    if meta.get("complete", True):
        return epoch + 1, 0
    return epoch, int(meta.get("steps", 0))        # saved mid-epoch after `steps` batches
