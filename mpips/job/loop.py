"""The worker-side drivers shared by local and distributed runs.

A *backend* does one step of the job — train on files, evaluate on files, save, shrink,
report table statistics — either in one process (`LocalBackend`, tables in-process) or as
one of W workers (`mpips.job.distributed.DistBackend`, results reduced over the worker
communicator, the first worker talking to the servers for saves and shrinks).
`run_epochs` (batch training) and `mpips.job.stream.run_stream` (online training) are written
once against that interface, ``mpips.worker.interfaces.Backend``.
"""
import sys
import time

from mpips import checkpoint as ck
from mpips.job.build import make_reader
from mpips.data import bags
from mpips.data.files import eval_files, readers_for, worker_files
from mpips.data.reader import Batch, DataError
from mpips.job.progress import make_progress
from mpips.job.report import (epoch_record, log_line, noise_fields, noise_line, summary_line,
                           write_metrics)
from mpips.job.stop import STOP, Stopped
from mpips.job.tracking import open_tensorboard
from mpips.models.zoo import network_record
from mpips.tables.admission import AdmittedTable
from mpips.tables.tiered import tier_counters, tier_of, tier_record
from mpips.worker.simulate import Simulator


def should_save(cfg, epoch):
    return bool(cfg.save_dir) and (cfg.save_every == "epoch" or epoch + 1 == cfg.epochs)


def step_saver(cfg, backend, epoch):
    """Trainer hook: save every --save-every N batches (every worker calls the backend's
    save, in step: their dense replicas take part; the first worker saves)."""
    n = cfg.save_steps
    if not (cfg.save_dir and n):
        return None

    def hook(done, phase_steps):
        if done % n == 0:
            backend.save(cfg.save_mode, {"epoch": epoch, "steps": done, "complete": False},
                         phase_steps)
    return hook


def tidy(cfg, lineage):
    """After a save (by the saving worker): --keep N and --overwrite remove the checkpoints
    the root no longer needs (mpips.checkpoint.prune), with one line."""
    if not (cfg.keep or cfg.overwrite):
        return
    removed = ck.prune(cfg.save_dir, cfg.keep, lineage.first if cfg.overwrite else None)
    if removed:
        why = " and ".join(x for x in (f"--keep {cfg.keep}" if cfg.keep else "",
                                       "--overwrite" if cfg.overwrite else "") if x)
        log_line(f"KEEP --> removed {len(removed)} checkpoint(s) ({why}): "
                 f"{', '.join(sorted(removed))}")


def table_hook(cfg, backend, n_workers, then=None):
    """Trainer hook: a TABLE line every --table-every examples (first worker).

    Examples are those trained in the epoch so far: counted (one process; workers whose
    dense steps sum every worker's examples), else this worker's x ``n_workers`` (assuming
    they keep pace); batches skipped by a resume count full.  Seconds count from the hook's
    creation (the epoch's start). ``then`` is another hook to call first (the step saver).
    The bytes are the process's whole table per sparse row: rows with their optimizer
    state and the dense weights with theirs (the SERVER line counts the sparse rows only).
    """
    every = cfg.table_every
    if not (every and backend.is_logger):
        return then
    per_step = sum(backend.batches)             # the global batch
    t0, trainer = time.perf_counter(), backend.trainer
    mark = [0]

    scale = 1 if isinstance(backend, LocalBackend) else n_workers

    def examples(done, phase_steps):
        if trainer.examples_done is None:             # (--simulate-workers)
            return done * per_step
        mine, every_worker = trainer.examples_done
        now = every_worker if every_worker is not None else mine * scale
        return (done - phase_steps) * per_step + now

    def hook(done, phase_steps):
        if then is not None:
            then(done, phase_steps)
        n = examples(done, phase_steps)
        if n < mark[0] + every:
            return
        mark[0] = n // every * every
        st = backend.stats()
        rows = max(st["table_rows"], 1)
        log_line(f"TABLE --> examples: {n} seconds: "
                 f"{time.perf_counter() - t0:.2f} compute_s: {trainer.compute_s:.2f} wait_s: "
                 f"{trainer.ps.wait_s:.2f} table_rows: {st['table_rows']} bytes_per_row: "
                 f"{st['table_bytes'] / rows:.1f} (the whole table over its sparse rows: "
                 f"rows and dense weights, with optimizer state)")
    return hook


class LocalBackend:
    """One process: `local_workers` file parts read side by side (batch W x B)."""
    is_logger = True

    def __init__(self, plan, trainer, ps, loaded=None):
        self.cfg, self.trainer, self.ps = plan.cfg, trainer, ps
        self.schema, self.hooks = plan.schema, plan.hooks
        self.W = plan.width     # the workers read as: --simulate-workers or --local-workers W
        self.batches = plan.batches                 # theirs: --global-batch or --batch-size
        trainer.should_stop = self.stop_now
        self.lineage = ck.Lineage(self.cfg.save_dir, loaded) if self.cfg.save_dir else None

    def train(self, files, epoch, skip=0, label=None, lag=None):
        cfg = self.cfg
        split = not self.schema.pipe_command
        W = max(readers_for(files, self.W, split), 1)
        seed = cfg.seed if cfg.shuffle else None
        parts = [worker_files(files, W, i, seed, epoch, split) for i in range(W)] if files else []
        readers = [make_reader(cfg, p, self.batches[i], log_line, (epoch, i),
                               schema=self.schema)
                   for i, p in enumerate(parts)]
        prog = self.trainer.progress = make_progress(
            cfg, readers, label or f"epoch {epoch}", redraw=sys.stdout.isatty(),
            offset_batches=skip, lag=lag, write=log_line,
            every_steps=self.hooks.progress_steps)
        if cfg.simulate_workers:
            st = self._simulate(readers, epoch, skip)
        else:
            groups = (concat_batches(readers) if self.trainer.replica is None    # GEO
                      else zip_batches(readers))
            st = self.trainer.train_epoch(groups, epoch, cfg.max_steps, skip)
        if prog is not None:
            prog.finish(st.examples, st.loss_sum)
        st.extra = {"workers": 0, "servers": 0, "local_workers": self.cfg.local_workers,
                    "compute_seconds": round(self.trainer.compute_s, 3)}
        if cfg.simulate_workers:
            st.extra.update(simulate_workers=cfg.simulate_workers, sim_delay=cfg.sim_delay,
                            sim_sparse=cfg.sim_sparse)
        acc = getattr(self.trainer, "acc", None)     # GEO: none
        st.extra.update(noise_fields(None if acc is None else acc.noise(),
                                     sum(r.batch_size for r in readers)))
        return st

    def _simulate(self, readers, epoch, skip):
        """An epoch of --simulate-workers W (mpips.worker.simulate), from its beginning."""
        if skip:
            for r in readers:
                r.close()
            raise ValueError(f"--simulate-workers starts epochs at their beginning; this "
                             f"resume would skip {skip} batches (resume from a checkpoint "
                             f"saved at an epoch's end)")
        cfg = self.cfg
        if len(readers) < cfg.simulate_workers:
            log_line(f"mpips: warning: {len(readers)} training file(s) for "
                     f"{cfg.simulate_workers} simulated workers: a worker reads whole files, "
                     f"so only {len(readers)} have data (split the data into >= "
                     f"{cfg.simulate_workers} files)")
        sim = Simulator(self.trainer, cfg.sim_delay, cfg.sim_sparse)
        return sim.train_epoch(zip_batches(readers, tagged=True), epoch, cfg.max_steps)

    def evaluate(self, files):
        """Evaluate as `--local-workers` workers would: worker i reads its ``eval_files`` in its
        own batches, and the counts are added in worker order.  A row's prediction depends
        on the batch it is scored in (BLAS rounds by the batch's shape on some CPUs), so
        this keeps --local-workers W's test metrics equal to W workers'."""
        if not files:
            return None
        W = self.W
        total = None
        split = not self.schema.pipe_command
        for i, part in enumerate(eval_files(files, W, i, split) for i in range(W)):
            if not part:
                continue
            reader = make_reader(self.cfg, part, self.batches[i], log_line,
                                 schema=self.schema)
            try:
                m = self.trainer.evaluate(reader)
            finally:
                reader.close()
            total = m if total is None else total.merge(m)
        return total

    def save(self, mode, meta, step=0):
        if self.trainer.progress is not None:      # a mid-epoch save: clear a redrawn line
            self.trainer.progress.clear()
        mode = self.lineage.mode(mode)
        path = ck.save_local(self.cfg.save_dir, inner_table(self.ps.sparse), self.ps.dense, mode,
                             self.cfg.to_json(), meta, admission_of(self.ps.sparse),
                             self.lineage.parent if mode == "delta" else None,
                             self.schema.to_dict(), network_record(self.trainer.model))
        self.lineage.saved(path, mode)
        log_line(f"SAVE --> {path} ({mode}, {len(self.ps.sparse)} rows)")
        tidy(self.cfg, self.lineage)
        return path

    def shrink(self, threshold):
        return self.ps.sparse.shrink(threshold)

    def stats(self):
        t = self.ps.sparse
        out = {"table_rows": len(t), "table_bytes": int(t.nbytes + self.ps.dense.nbytes),
               "admitted_total": int(getattr(t, "admitted", 0)),
               "ids_waiting": int(t.waiting()) if hasattr(t, "waiting") else 0}
        if tier_of(t) is not None:
            out |= tier_record(tier_counters(t))
        if getattr(self.ps, "tracker", None) is not None:     # a simulator's LocalPS
            out["push_staleness"] = self.ps.tracker.summary()
        return out | self.trainer.clip_summary()      # this worker's pushes

    def decide(self, fn):
        return fn()

    def stop_now(self):
        """Has a stop signal come (mpips.job.stop)?"""
        return STOP["flag"]

    def emit(self, rec):
        write_metrics(self.cfg.metrics_out, rec)


def inner_table(table):
    """The SparseTable behind an admission filter (checkpoints hold the table itself)."""
    return getattr(table, "table", table)


def admission_of(table):
    """The admission filter in front of a table (its counts are saved too), or None."""
    return table if isinstance(table, AdmittedTable) else None


def zip_batches(readers, tagged=False):
    """Zip W readers into steps: lists of the W workers' batches (fewer at the end, when
    some readers ran out; tagged: of (worker k, batch)), closing the readers after."""
    its = [iter(r) for r in readers]
    try:
        while True:
            parts = [(k, b) if tagged else b
                     for k, b in enumerate(next(i, None) for i in its) if b is not None]
            if not parts:
                return
            yield parts
    finally:
        for r in readers:
            r.close()


def concat_batches(readers):
    """Zip W readers into batches of W x B (the grouping GEO's local run uses), closing them
    after."""
    for parts in zip_batches(readers):
        if len(parts) == 1:
            yield parts[0]
        else:
            yield Batch(*bags.concat([(p.dense, p.sparse, p.label, p.offsets) for p in parts]))


def chain(*hooks):
    """One trainer hook calling the given ones (None: left out) in order, or None."""
    hooks = [h for h in hooks if h is not None]
    if len(hooks) <= 1:
        return hooks[0] if hooks else None

    def hook(done, phase_steps):
        for h in hooks:
            h(done, phase_steps)
    return hook


def stop_here(cfg, backend, epoch, steps, complete, saved=None):
    """Stopped on a signal (mpips.job.stop): save here (unless ``saved``, this point's
    checkpoint, exists) and record where, for the exit line and code."""
    path = saved
    if path is None and cfg.save_dir:
        path = backend.save(cfg.save_mode, {"epoch": epoch, "steps": steps,
                                            "complete": complete})
    STOP["stopped"] = Stopped(STOP["signal"] or "a signal to another rank", epoch, steps,
                              path or cfg.save_dir or None)   # (other workers: the root)


def run_epochs(plan, backend):
    """Batch training of a RunPlan (its files resolved): epochs over the files from its
    start point, evaluation and saves after each.  A stop signal ends it at a step
    boundary, or after an epoch, with a checkpoint there."""
    with open_tensorboard(plan.cfg, backend) as tb:
        return _epochs(plan, backend, tb)


def _epochs(plan, backend, tb):
    cfg, train_files, test_files = plan.cfg, plan.train_files, plan.test_files
    records = []
    n_workers = backend.W
    first, skip = plan.start
    for epoch in range(first, cfg.epochs):
        backend.trainer.on_step = table_hook(
            cfg, backend, n_workers, chain(step_saver(cfg, backend, epoch),
                                           plan.hooks.signaller(epoch) if backend.is_logger
                                           else None))
        skipped = skip if epoch == first else 0
        st = backend.train(train_files, epoch, skipped)
        if st.stopped:
            stop_here(cfg, backend, epoch, skipped + st.steps, False)
            return records
        if not st.examples and not (skip and epoch == first):
            raise DataError(f"the training data yields no valid example ({len(train_files)} "
                            f"file(s): {', '.join(map(str, train_files[:3]))}"
                            f"{' ...' if len(train_files) > 3 else ''}); nothing to train on")
        saved = None
        if should_save(cfg, epoch):
            saved = backend.save(cfg.save_mode, {"epoch": epoch, "steps": st.steps,
                                                 "complete": True})
        test_m = backend.evaluate(test_files)
        st.extra.update(backend.stats())
        rec = epoch_record(cfg, epoch, st, test_m)
        if backend.is_logger:
            log_line(summary_line(rec))
            if line := noise_line(rec, plan.batches[0], bool(cfg.global_batch)):
                log_line(line)
            backend.emit(rec)
            if tb is not None:
                tb.record(rec, st.steps)
        records.append(rec)
        if epoch + 1 < cfg.epochs and backend.stop_now():
            stop_here(cfg, backend, epoch, skipped + st.steps, True, saved)
            return records
    return records
