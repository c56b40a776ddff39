"""Which run is which: the identity every ``--metrics-out`` record carries, and TensorBoard.

:func:`identity` gives the fields that tell runs apart (``run_id``, ``run_started``, the
model, mode, workers and servers, batch, lr, the schema's hash and the package's version),
made once per run (:func:`new_run`, at the start of ``mpips.train``).  A resumed run is a
new run: it has its own id, and ``resumed_from`` names the checkpoint it continued from.

:class:`TensorBoard` writes scalars for ``--tensorboard DIR`` through tensorboardX (the
``tensorboard`` extra: ``pip install 'mpips[tensorboard]'``), one sub-folder per run
(``DIR/<run_started>-<run_id>``): the training loss and AUC at every ``--print-every``
step (``train/...``, x = the worker's steps since the run started), and each epoch's or
pass's record (``epoch/...`` or ``pass/...``, x = the epoch or the pass's index): losses,
AUCs, test logloss, examples/s, table rows and the push staleness's mean.
"""
import hashlib
import importlib.metadata
import json
import os
import secrets
import time
from contextlib import contextmanager

from mpips.job.build import make_schema

_RUN = {}


def new_run():
    """Start a new run identity (a fresh id and start time)."""
    _RUN.clear()
    _RUN.update(run_id=secrets.token_hex(6),
                run_started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def version():
    try:
        return importlib.metadata.version("mpips")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def schema_hash(schema):
    """The first 16 hex digits of the SHA-256 of the schema's canonical JSON."""
    text = json.dumps(schema.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def identity(cfg):
    """The fields of every record of this run (see the module docstring)."""
    if not _RUN:
        new_run()
    G = cfg.global_batch
    # with --global-batch G in force, --batch-size is not what a worker takes: name G instead
    out = dict(_RUN, model=cfg.model, mode=cfg.mode, lr=cfg.lr,
               **({"global_batch": G} if G else {"batch_size": cfg.batch_size}),
               schema_hash=schema_hash(make_schema(cfg)), mpips_version=version())
    rule = cfg.large_batch
    if rule not in ("none", "auto"):         # --large-batch: the rule and its base batch
                                             # (auto's outcome: large_batch_k, per epoch)
        out.update(large_batch=rule, large_batch_base=cfg.large_batch_base)
    if cfg.resume and not cfg.stream:
        out["resumed_from"] = os.path.basename(os.path.normpath(cfg.resume))
    return out


class TensorBoard:
    """Scalars of one run into ``root/<run_started>-<run_id>/`` (tensorboardX)."""

    def __init__(self, root, cfg):
        try:
            from tensorboardX import SummaryWriter      # ~0.5 s: only when asked for
        except ImportError:
            raise ValueError("--tensorboard needs tensorboardX: pip install "
                             "'mpips[tensorboard]' (or pip install tensorboardX)") from None
        ident = identity(cfg)
        name = f"{ident['run_started'].replace(':', '')}-{ident['run_id']}"
        self.path = os.path.join(root, name)
        self.writer = SummaryWriter(logdir=self.path)
        self.steps = 0              # this worker's steps in earlier epochs or passes
        self.writer.add_text("run", json.dumps(ident, sort_keys=True), 0)

    def train_point(self, step, loss, auc):
        """At a TRAIN line: step of the current epoch or pass."""
        self.writer.add_scalar("train/loss", loss, self.steps + step)
        self.writer.add_scalar("train/auc", auc, self.steps + step)

    def record(self, rec, steps):
        """After an epoch or pass: its record; ``steps``: this worker's steps in it."""
        self.steps += steps
        kind, x = "pass" if "pass" in rec else "epoch", rec["epoch"]   # (a pass's index)
        for key in ("train_loss", "train_auc", "test_auc", "test_logloss", "examples_per_sec",
                    "table_rows"):
            if isinstance(rec.get(key), (int, float)):
                self.writer.add_scalar(f"{kind}/{key}", rec[key], x)
        for task, fields in (rec.get("tasks") or {}).items():     # several labels
            for key, v in fields.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(f"{kind}/{task}/{key}", v, x)
        stale = rec.get("push_staleness")
        if isinstance(stale, dict) and "mean" in stale:
            self.writer.add_scalar(f"{kind}/push_staleness_mean", stale["mean"], x)
        self.writer.flush()

    def close(self):
        self.writer.close()


@contextmanager
def open_tensorboard(cfg, backend):
    """--tensorboard's writer on the logging worker (its TRAIN lines' points too), or None."""
    tb = TensorBoard(cfg.tensorboard, cfg) if cfg.tensorboard and backend.is_logger else None
    if tb is not None:
        backend.trainer.on_report = tb.train_point
    try:
        yield tb
    finally:
        if tb is not None:
            backend.trainer.on_report = None
            tb.close()
