"""The worker-side drivers shared by local and distributed runs.

A *backend* does one step of the job — train on files, evaluate on files, save, shrink,
report table statistics — either in one process (`LocalBackend`, tables in-process) or as
one of W workers (`DistBackend`, results reduced over the worker communicator, the first
worker talking to the servers for saves and shrinks).  `run_epochs` (batch training) and
`mpips.stream.run_stream` (online training) are written once against that interface.
"""
import json
import os
import time

import numpy as np

from mpips.metrics import BinaryMetrics
from mpips.train import (epoch_record, log_line, make_reader, summary_line, write_metrics)

POLL = 1e-3   # seconds between polls of a collective that may take long


def wait_collective(req, what="an MPI collective"):
    """Complete a non-blocking collective without burning a core.

    Meanwhile answer other ranks' status requests (a failing rank's dump shows `what`).
    """
    from mpips.server.loop import WATCH
    if req.Test():
        return
    WATCH.waiting(f"waiting in {what}")
    while not req.Test():
        WATCH.poll()
        time.sleep(POLL)


def start_point(cfg):
    """(epoch, batches to skip in it) to continue from the --resume checkpoint."""
    if not cfg.resume or cfg.stream:
        return 0, 0
    from mpips import checkpoint as ck
    meta = ck.read_manifest(ck.resolve(cfg.resume))["meta"]
    epoch = int(meta.get("epoch", -1))
    if meta.get("complete", True):
        return epoch + 1, 0
    return epoch, int(meta.get("steps", 0))        # saved mid-epoch after `steps` batches


def should_save(cfg, epoch):
    return bool(cfg.save_dir) and (cfg.save_every == "epoch" or epoch + 1 == cfg.epochs)


def step_saver(cfg, backend, epoch):
    """Trainer hook: save every --save-every N batches (first worker / local run)."""
    n = cfg.save_steps
    if not (cfg.save_dir and n and backend.is_logger):
        return None

    def hook(done, phase_steps):
        if done % n == 0:
            backend.save(cfg.save_mode, {"epoch": epoch, "steps": done, "complete": False},
                         phase_steps)
    return hook


class LocalBackend:
    """One process: `local_workers` file shards read side by side (batch W x B)."""
    is_logger = True

    def __init__(self, cfg, trainer, ps):
        self.cfg, self.trainer, self.ps = cfg, trainer, ps

    def train(self, files, epoch, skip=0):
        from mpips.data.files import split_files
        W = min(self.cfg.local_workers, max(len(files), 1))
        shards = [split_files(files, W, i) for i in range(W)] if files else []
        readers = [make_reader(self.cfg, s, self.cfg.batch_size, log_line) for s in shards]
        st = self.trainer.train_epoch(concat_batches(readers), epoch, self.cfg.max_steps, skip)
        return {"examples": st.examples, "loss_sum": st.loss_sum, "seconds": st.seconds,
                "metrics": st.metrics, "steps": st.steps, "extra": {
                    "workers": 0, "servers": 0, "local_workers": self.cfg.local_workers,
                    "compute_seconds": round(self.trainer.compute_s, 3)}}

    def evaluate(self, files):
        if not files:
            return None
        reader = make_reader(self.cfg, files, self.cfg.batch_size, log_line)
        try:
            return self.trainer.evaluate(reader)
        finally:
            reader.close()

    def save(self, mode, meta, step=0):
        from mpips import checkpoint as ck
        path = ck.save_local(self.cfg.save_dir, inner_table(self.ps.sparse), self.ps.dense, mode,
                             self.cfg.to_json(), meta)
        log_line(f"SAVE --> {path} ({mode}, {len(self.ps.sparse)} rows)")
        return path

    def shrink(self, threshold):
        return self.ps.sparse.shrink(threshold)

    def stats(self):
        t = self.ps.sparse
        return {"table_rows": len(t), "table_bytes": int(t.nbytes + self.ps.dense.nbytes),
                "admitted_total": int(getattr(t, "admitted", 0)),
                "ids_waiting": int(t.waiting()) if hasattr(t, "waiting") else 0}

    def decide(self, fn):
        return fn()

    def emit(self, rec):
        write_metrics(self.cfg.metrics_out, rec)


class DistBackend:
    """Worker `wi` of W; the first worker logs, saves and shrinks for all."""

    def __init__(self, cfg, trainer, client, wcomm, wi, W):
        self.cfg, self.trainer, self.client = cfg, trainer, client
        self.wcomm, self.wi, self.W = wcomm, wi, W
        self.is_logger = wi == 0
        self.warned = False         # told the user this worker has no files

    def _sum(self, arr):
        from mpi4py import MPI
        out = np.empty_like(arr)
        wait_collective(self.wcomm.Iallreduce(arr, out, op=MPI.SUM),
                        "Iallreduce(sum) of the workers")
        return out

    def _mine(self, files):
        from mpips.data.files import split_files
        return split_files(files, self.W, self.wi) if len(files) >= self.W else files[self.wi::self.W]

    def train(self, files, epoch, skip=0):
        wait_collective(self.wcomm.Ibarrier(), "Ibarrier of the workers (epoch start)")
        c = self.client
        sent0, msgs0 = c.bytes_sent, c.messages
        t0 = time.perf_counter()
        mine = self._mine(files)
        if not mine and not self.warned:
            self.warned = True
            log_line(f"mpips: warning: worker {self.wi} has no training files ({len(files)} "
                     f"file(s) for {self.W} workers); split the data into at least {self.W} "
                     f"files (e.g. python -m data_prep.criteo --parts {self.W})")
        reader = make_reader(self.cfg, mine, self.cfg.batch_size, log_line) if mine else None
        try:
            st = self.trainer.train_epoch(reader or [], epoch, self.cfg.max_steps, skip)
        finally:
            if reader is not None:
                reader.close()
        self.client.barrier()                      # every worker's pushes are applied
        span = time.perf_counter() - t0
        sums = self._sum(np.array([st.examples, st.loss_sum, c.bytes_sent - sent0,
                                   c.messages - msgs0], np.float64))
        span = self._max(span)
        metrics = BinaryMetrics.from_state(self._sum(st.metrics.state()))
        return {"examples": int(sums[0]), "loss_sum": sums[1], "seconds": span,
                "metrics": metrics, "steps": st.steps, "extra": {
                    "workers": self.W, "servers": c.n_servers,
                    "bytes_sent_per_example": round(sums[2] / max(sums[0], 1), 1),
                    "messages_sent": int(sums[3])}}

    def _max(self, value):
        from mpi4py import MPI
        out = np.empty(1, np.float64)
        wait_collective(self.wcomm.Iallreduce(np.array([value], np.float64), out, op=MPI.MAX),
                        "Iallreduce(max) of the workers")
        return float(out[0])

    def evaluate(self, files):
        if not files:
            return None
        mine = files[self.wi::self.W]
        local = BinaryMetrics()
        if mine:
            reader = make_reader(self.cfg, mine, self.cfg.batch_size, log_line)
            try:
                local = self.trainer.evaluate(reader)
            finally:
                reader.close()
        return BinaryMetrics.from_state(self._sum(local.state()))

    def save(self, mode, meta, step=0):
        """Checkpoint now (after a barrier: step 0) or, mid-epoch, at `step` steps done
        (sync mode: exactly that step; async: whatever the servers hold when they save)."""
        if not self.is_logger:
            return None
        from mpips import checkpoint as ck
        from mpips.config import SAVE_MODES
        path = ck.new_checkpoint_dir(self.cfg.save_dir, mode)
        seq = int(os.path.basename(path).split("-")[1])
        infos = [json.loads(b) for b in self.client.save(seq, SAVE_MODES.index(mode), step)]
        ck.write_manifest(path, {"shards": infos, "config": self.cfg.to_json(), "meta": meta})
        log_line(f"SAVE --> {path} ({mode}, {sum(x['rows'] for x in infos)} rows)")
        return path

    def shrink(self, threshold):
        return self.client.shrink(threshold) if self.is_logger else 0

    def stats(self):
        if not self.is_logger:
            return {}
        srv = self.client.stats()
        out = {"table_rows": int(srv[:, 0].sum()), "table_bytes": int(srv[:, 1].sum()),
               "admitted_total": int(srv[:, 5].sum()), "ids_waiting": int(srv[:, 6].sum()),
               "requests_rejected": int(srv[:, 8].sum()), "replies_in_flight": int(srv[:, 9].sum())}
        if self.cfg.mode == "ssp":
            out["ssp_max_lead"] = int(srv[:, 4].max())
        return out

    def decide(self, fn):
        """fn() on the first worker (a Pass or None), the same answer on every worker."""
        from mpips.stream import Pass
        buf = np.zeros(256, np.uint8)
        if self.is_logger:
            p = fn()
            if p is not None:
                raw = p.name.encode()
                buf[:len(raw)] = np.frombuffer(raw, np.uint8)
        wait_collective(self.wcomm.Ibcast(buf, root=0), "Ibcast of the next pass from worker 0")
        name = bytes(buf).rstrip(b"\0").decode()
        if not name:
            return None
        return Pass(name, name[:8], os.path.join(self.cfg.stream, name))

    def emit(self, rec):
        if self.is_logger:
            write_metrics(self.cfg.metrics_out, rec)


def inner_table(table):
    """The SparseTable behind an admission filter (checkpoints hold the table itself)."""
    return getattr(table, "table", table)


def concat_batches(readers):
    """Zip W readers into batches of W x B (the grouping sync mode uses), closing them after."""
    from mpips.data.reader import Batch
    its = [iter(r) for r in readers]
    try:
        while True:
            parts = [b for b in (next(i, None) for i in its) if b is not None]
            if not parts:
                return
            if len(parts) == 1:
                yield parts[0]
            else:
                yield Batch(np.concatenate([p.dense for p in parts]),
                            np.concatenate([p.sparse for p in parts]),
                            np.concatenate([p.label for p in parts]))
    finally:
        for r in readers:
            r.close()


def run_epochs(cfg, backend, train_files, test_files):
    """Batch training: epochs over the files, evaluation and saves after each."""
    records = []
    first, skip = start_point(cfg)
    for epoch in range(first, cfg.epochs):
        backend.trainer.on_step = step_saver(cfg, backend, epoch)
        st = backend.train(train_files, epoch, skip if epoch == first else 0)
        if should_save(cfg, epoch):
            backend.save(cfg.save_mode, {"epoch": epoch, "steps": st["steps"], "complete": True})
        test_m = backend.evaluate(test_files)
        extra = dict(st["extra"], **backend.stats())
        rec = epoch_record(cfg, epoch, st["examples"], st["seconds"], st["loss_sum"],
                           st["metrics"], test_m, extra)
        if backend.is_logger:
            log_line(summary_line(rec))
            backend.emit(rec)
        records.append(rec)
    return records
