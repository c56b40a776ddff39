"""Where a run continues from: the checkpoint to load and the point in the data after it.

``resume_point`` picks the checkpoint (``--resume``, or a stream's own latest one in
``--save-dir``) and the last pass it holds; ``start_point`` turns a batch run's checkpoint
into the epoch and the batches of it already trained.  ``check_kind`` refuses a checkpoint
of the other kind (a batch run's for a stream, a stream's for a batch run) unless
``--resume`` names that checkpoint itself; ``resume_line`` is the RESUME line.
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


def is_stream_checkpoint(manifest):
    """Was this checkpoint saved by a stream run (it records the pass it ends with)?"""
    return "pass" in (manifest.get("meta") or {})


def where(manifest):
    """Where a checkpoint's run stood: 'after pass P', 'after epoch E' or 'epoch E, N
    batches done'."""
    meta = manifest.get("meta") or {}
    if is_stream_checkpoint(manifest):
        return f"after pass {meta['pass']}"
    if meta.get("complete", True):
        return f"after epoch {meta.get('epoch', '?')}"
    return f"epoch {meta.get('epoch', '?')}, {meta.get('steps', '?')} batches done"


def check_kind(cfg, path, manifest):
    """Raise CheckpointError if `path` is of the other kind than this run (stream / batch)
    and was picked implicitly (a stream's own --save-dir, or the newest in a --resume root):
    its tables would be trained on silently.  Naming the checkpoint in --resume allows it
    (a warm start: a stream from its first ready pass, a batch run from epoch 0 on)."""
    stream_ckpt = is_stream_checkpoint(manifest)
    if stream_ckpt == bool(cfg.stream):
        return
    if cfg.resume and os.path.normpath(cfg.resume) == os.path.normpath(path):
        return
    kind = "a stream run's" if stream_ckpt else "a batch (non-stream) run's"
    run = "stream" if cfg.stream else "batch"
    found = (f"--save-dir {cfg.save_dir} holds" if not cfg.resume
             else f"--resume {cfg.resume}: its newest checkpoint is")
    raise ck.CheckpointError(
        f"{found} {path} ({where(manifest)}), {kind} checkpoint, and this is a {run} run; "
        f"give this run {'its own --save-dir' if not cfg.resume else 'a checkpoint of its kind'}"
        f", or start from that one on purpose with --resume {path}")


def resume_line(path, manifest):
    """The log line saying which checkpoint a run continues from."""
    return f"RESUME --> {path} ({where(manifest)})"
