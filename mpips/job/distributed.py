"""Distributed run: split roles, serve or train, gather a per-rank profile at the end.

`DistBackend` is the worker side of `mpips.job.loop`'s backend interface for one of W
workers: results are reduced over the worker communicator, and the first worker talks to
the servers for saves and shrinks.
"""
import json
import os
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from mpips import checkpoint as ck
from mpips.job.build import make_reader, make_tables
from mpips.comm.cluster import Cluster, default_servers
from mpips.config import SAVE_MODES
from mpips.data.files import eval_files, worker_files
from mpips.comm.liveness import WATCH, wait_collective
from mpips.tables.ownership import dense_bounds
from mpips.job.progress import make_progress
from mpips.models.zoo import network_record
from mpips.comm.protocol import Op
from mpips.job.report import log_line, model_note, noise_fields, peak_rss_mb, write_metrics
from mpips.job.plan import make_trainer
from mpips.job.resume import resume_line
from mpips.job.loop import admission_of, inner_table, run_epochs, tidy
from mpips.server.loop import Server
from mpips.tables.staleness import counts_staleness, stale_rule, summarize
from mpips.tables.tiered import tier_note, tier_record
from mpips.job import stop
from mpips.job.stop import STOP
from mpips.job.stream import Pass, run_stream
from mpips.job.warmup import cache_misses, report_new, signatures, warm
from mpips.worker.client import PSClient
from mpips.worker.dense_sync import DenseExchange
from mpips.worker.trainer import EpochStats

# One PROFILE row per rank, gathered to the first worker at the end of the job.
PROFILE_DTYPE = np.dtype([
    ("server", np.float64),          # 1 for a server rank, 0 for a worker
    ("compute_s", np.float64),       # worker: forward/backward seconds
    ("wait_s", np.float64),          # worker: seconds waiting for servers
    ("server_busy_s", np.float64),   # server: seconds serving requests
    ("requests", np.float64),        # server: messages served; worker: data messages sent
    ("mb_sent", np.float64),         # MB this rank sent (requests, or replies)
    ("mb_recv", np.float64),         # MB this rank received
    ("peak_rss_mb", np.float64),
    ("rows", np.float64),            # server: rows in its sparse table
    ("cpu_s", np.float64),           # CPU seconds of this rank, all of the run
    ("exit", np.float64),            # the exit code this rank asks for (a stop: mpips.job.stop)
])


def profile_row(**fields):
    """A PROFILE_DTYPE record; fields not given are 0."""
    row = np.zeros(1, PROFILE_DTYPE)
    for name, value in fields.items():
        row[name] = value
    return row


def run_distributed(plan, comm):
    """Entry for every rank of a multi-rank job (a RunPlan)."""
    cfg, schema, model = plan.cfg, plan.schema, plan.model
    cluster = Cluster.create(comm, cfg.servers or default_servers(comm.size))
    if comm.rank == 0:                      # make the embedded dataset once, before reads
        plan = plan.with_data()
    pids = np.empty(comm.size, np.int64)    # in the role map: to match a launcher's PID
    wait_collective(comm.Iallgather(np.array([os.getpid()], np.int64), pids))
    bounds = dense_bounds(model.n_params, cluster.n_servers)
    first_worker = cluster.worker_ranks[0]
    if comm.rank == first_worker:
        log_line(f"mpips: {comm.size} ranks, {cluster.n_servers} servers x {cluster.n_workers} "
                 f"workers, mode {cfg.mode}, {model.n_params} dense parameters"
                 f"{model_note(model)}")
        log_line(plan.batch_line())
        for line in (plan.rule_line(), plan.pull_line(), plan.stale_line()):
            if line:
                log_line(line)
        log_line(schema.describe())
        for line, pid in zip(cluster.role_map(), pids):
            log_line(f"  {line} pid {pid}")
    t0 = time.perf_counter()
    staged(comm, cluster.hosts,         # compilation before any clock starts
           lambda: warm(plan, workers=len(cluster.worker_ranks)))
    jit0 = signatures()
    if comm.rank == first_worker:
        log_line(f"mpips: kernels compiled or loaded from numba's cache on all ranks in "
                 f"{time.perf_counter() - t0:.1f} s (before training; in no rate)")
    if cluster.is_server:
        prof = serve(plan, cluster, bounds)
    else:
        prof = work(plan, cluster, bounds)
    prof["cpu_s"] = time.process_time()
    prof["exit"] = stop.exit_code() if comm.rank == first_worker else 0
    code = report_profile(comm, first_worker, prof)
    report_new(jit0, f"rank {comm.rank}", plan.hooks)
    if comm.rank == first_worker and STOP["stopped"] is not None:
        print(STOP["stopped"].line(f" (all {comm.size} ranks)"), file=sys.stderr, flush=True)
    return code


def serve(plan, cluster, bounds):
    cfg, model, path = plan.cfg, plan.model, plan.resume
    i, S = cluster.index, cluster.n_servers
    sparse, dense = make_tables(cfg, model, bounds[i], bounds[i + 1], cowclip=plan.cowclip,
                                tag=f"rank{cluster.comm.rank}")
    if path:
        ck.load_shard_into(path, inner_table(sparse), dense, i, S, bounds, admission_of(sparse))
    server = Server(cluster.comm, cluster.worker_ranks, sparse, dense, cfg.mode, cfg.staleness,
                    cfg.peer_timeout, cfg.idle_sleep, label=f"server {i}",
                    idle_timeout=cfg.peer_timeout + cfg.stream_timeout,   # workers may poll
                    shard=(i, S), stale_lr=stale_rule(cfg.stale_lr, len(cluster.worker_ranks)),
                    sync_sparse_lr=cfg.sync_sparse_lr)
    if cfg.save_dir:
        server.on_save, server.save_check = ck.server_save_hooks(
            cfg.save_dir, i, S, inner_table(sparse), dense, bounds[i], admission_of(sparse))
    server.run()
    st = server.stats
    n = len(sparse)
    log_line(f"SERVER --> {i} (rank {cluster.comm.rank}): table rows: {n} bytes: "
             f"{sparse.nbytes} bytes/row: {sparse.nbytes / max(n, 1):.1f} (sparse rows with "
             f"optimizer state; the dense slice not counted) peak_rss_MB: {peak_rss_mb():.0f}"
             f"{tier_note(inner_table(sparse))}")
    return profile_row(server=1, server_busy_s=st["busy_s"], requests=st["requests"],
                       mb_sent=st["bytes_out"] / 1e6, mb_recv=st["bytes_in"] / 1e6,
                       peak_rss_mb=peak_rss_mb(), rows=len(sparse))


def work(plan, cluster, bounds):
    plan = plan.with_data()
    cfg, model = plan.cfg, plan.model
    wi, W, S = cluster.index, cluster.n_workers, cluster.n_servers
    client = PSClient(cluster.comm, cluster.server_ranks, model.row_dim, bounds,
                      cfg.peer_timeout, label=f"worker {wi}")
    replica = dense_sync = None                  # GEO: the trainer keeps its own copy
    if cfg.mode != "geo":
        replica = make_tables(cfg, model, dense_batches=W,    # from the servers at first use
                              cowclip=plan.cowclip)[1]
        dense_sync = DenseExchange(cluster.role_comm, model.n_params,
                                   client.timeout) if W > 1 else None
    trainer = make_trainer(cfg, model, client, S, log=log_line if wi == 0 else None,
                           replica=replica, n_workers=W, dense_sync=dense_sync, client=True,
                           cowclip=plan.cowclip)
    trainer.step_delay = plan.hooks.step_delay(wi)     # test and benchmark aids
    trainer.stretch = plan.hooks.stretch(wi)
    if plan.resume and wi == 0:
        log_line(resume_line(plan.resume, plan.manifest))
    backend = DistBackend(plan, trainer, client, cluster.role_comm, wi, W, plan.resume)
    if cfg.stream:
        run_stream(plan, backend, log_line)
    else:
        run_epochs(plan, backend)
    client.control(Op.FINISH)
    log_line(trainer.times_line(f"worker {wi} (rank {cluster.comm.rank})"))
    wait_s = client.wait_s + (trainer.dense_sync.wait_s if trainer.dense_sync else 0.0)
    return profile_row(compute_s=trainer.compute_s, wait_s=wait_s,
                       requests=client.messages, mb_sent=client.bytes_sent / 1e6,
                       mb_recv=client.bytes_recv / 1e6, peak_rss_mb=peak_rss_mb())


class DistBackend:
    """Worker `wi` of W; the first worker logs, saves and shrinks for all."""

    def __init__(self, plan, trainer, client, wcomm, wi, W, loaded=None):
        cfg = plan.cfg
        self.cfg, self.trainer, self.client = cfg, trainer, client
        self.schema, self.hooks = plan.schema, plan.hooks
        self.wcomm, self.wi, self.W = wcomm, wi, W
        self.batches = plan.batches                 # every worker's: --global-batch or -size
        self.pull_after = plan.pull_order          # None: async with no choice, or not async
        self.is_logger = wi == 0
        self.lineage = ck.Lineage(cfg.save_dir, loaded) if cfg.save_dir and wi == 0 else None
        self.warned = False         # told the user this worker has no files
        self.fetched = False        # the dense replica holds the servers' values
        trainer.should_stop = lambda: STOP["flag"]     # heard by all with the dense exchange

    def _replica_ready(self):
        """At first use, start the dense replica from the servers' dense slices: the seed's
        weights, or a resumed checkpoint's (with optimizer state).  Not earlier: a server
        may still be loading the checkpoint, and this wait counts against --peer-timeout."""
        if self.trainer.replica is not None and not self.fetched:
            self.client.dense_get(self.trainer.replica)
            self.fetched = True

    def _sum(self, arr):
        out = np.empty_like(arr)
        wait_collective(self.wcomm.Iallreduce(arr, out, op=MPI.SUM),
                        "Iallreduce(sum) of the workers")
        return out

    def train(self, files, epoch, skip=0, label=None, lag=None):
        wait_collective(self.wcomm.Ibarrier(), "Ibarrier of the workers (epoch start)")
        c = self.client
        sent0, msgs0 = c.bytes_sent, c.messages
        t0 = time.perf_counter()
        mine = worker_files(files, self.W, self.wi, self.cfg.seed if self.cfg.shuffle else None,
                            epoch, split=not self.schema.pipe_command)
        if not mine and not self.warned:
            self.warned = True
            why = ("a --pipe-command reads whole files" if self.schema.pipe_command else
                   "gzip files and binary parts are not shared by bytes")
            log_line(f"mpips: warning: worker {self.wi} has no training data ({len(files)} "
                     f"file(s) for {self.W} workers, and {why}); give at least {self.W} "
                     f"files, or plain text files")
        reader = make_reader(self.cfg, mine, self.batches[self.wi], log_line,
                             (epoch, self.wi), schema=self.schema) if mine else None
        if reader is not None:
            reader.on_wait = _answering(reader)
        prog = None
        if reader is not None and self.is_logger:
            prog = make_progress(self.cfg, [reader], label or f"epoch {epoch}",
                                 offset_batches=skip, lag=lag, write=log_line,
                                 worker=(self.wi, self.W) if self.W > 1 else None,
                                 every_steps=self.hooks.progress_steps)
        self.trainer.progress = prog
        try:
            self._replica_ready()
            st = self.trainer.train_epoch(reader or [], epoch, self.cfg.max_steps, skip)
        finally:
            if reader is not None:
                reader.close()
        if prog is not None:
            prog.finish(st.examples, st.loss_sum)
        self.client.barrier()                      # every worker's pushes are applied
        span = time.perf_counter() - t0
        mine_rows = np.zeros(self.W)
        mine_rows[self.wi] = st.examples
        sums = self._sum(np.concatenate([[st.examples, st.loss_sum, c.bytes_sent - sent0,
                                          c.messages - msgs0, st.stopped], mine_rows]))
        span = self._max(span)
        metrics = st.metrics.with_state(self._sum(st.metrics.state()))
        extra = {"workers": self.W, "servers": c.n_servers,
                 "bytes_sent_per_example": round(sums[2] / max(sums[0], 1), 1),
                 "messages_sent": int(sums[3]),
                 "worker_examples": [int(x) for x in sums[5:]]}
        if self.pull_after:                        # async: where the next rows were pulled
            extra["pull_after"] = self.pull_after
        acc = getattr(self.trainer, "acc", None)  # GEO: none
        noise = np.zeros((0, 2)) if acc is None else acc.noise()   # my shard's share
        if len(noise):                  # (every worker counted the same steps: same shape)
            noise = self._sum(noise.ravel()).reshape(-1, 2)
        extra.update(noise_fields(noise, sum(self.batches)))
        if self.trainer.replica is not None:
            self._replica_whole()
            extra["dense_crc"] = self._replica_crcs()
        return EpochStats(examples=int(sums[0]), steps=st.steps, loss_sum=sums[1], seconds=span,
                          metrics=metrics, extra=extra, stopped=bool(sums[4]))

    def _replica_whole(self):
        """Every worker's replica holds the whole optimizer state (each worker keeps only
        its shard's current; a collective of all workers)."""
        if self.trainer.dense_sync is not None:
            self.trainer.settle()                   # --dense-lag 1: the step in flight
            self.trainer.dense_sync.gather_state(self.trainer.replica)

    def _replica_crcs(self):
        """CRC-32 of every worker's dense replica (values and optimizer state); they must
        be equal (the replicas are updated by the same sums in the same order)."""
        crc = 0
        for arr in self.trainer.replica.export_state().values():
            crc = zlib.crc32(arr.tobytes(), crc)
        out = np.empty(self.W, np.int64)
        wait_collective(self.wcomm.Iallgather(np.array([crc], np.int64), out),
                        "Iallgather of the workers' dense checksums")
        if len(set(out.tolist())) != 1:
            raise RuntimeError(f"dense replicas differ between workers (CRC-32 per worker: "
                               f"{out.tolist()}); please report this as a bug")
        return out.tolist()

    def _max(self, value):
        out = np.empty(1, np.float64)
        wait_collective(self.wcomm.Iallreduce(np.array([value], np.float64), out, op=MPI.MAX),
                        "Iallreduce(max) of the workers")
        return float(out[0])

    def evaluate(self, files):
        if not files:
            return None
        mine = eval_files(files, self.W, self.wi, not self.schema.pipe_command)
        self._replica_ready()
        averaged = self.cfg.dense_average > 0         # (GEO: the servers' average)
        if averaged and self.trainer.replica is not None:
            self._replica_whole()       # each worker steps its shard's average; every
                                        # worker scores with the whole one
        local = self.trainer.new_metrics()
        if mine:
            reader = make_reader(self.cfg, mine, self.batches[self.wi],
                                 log_line, schema=self.schema)
            reader.on_wait = _answering(reader)
            try:
                local = self.trainer.evaluate(reader)
            finally:
                reader.close()
        out = local.with_state(self._sum(local.state()))
        if averaged:                    # the trained weights' figures beside (a record's _raw)
            raw = local.raw if local.raw is not None else self.trainer.new_metrics()
            out.raw = raw.with_state(self._sum(raw.state()))
        return out

    def save(self, mode, meta, step=0):
        """Checkpoint now (after a barrier: step 0) or, mid-epoch, at `step` steps done
        (sync mode: exactly that step; async: whatever the servers hold when they save).
        Every worker calls it (their replicas' optimizer state is made whole first); the
        first worker saves."""
        if self.trainer.replica is not None:
            self._replica_ready()
            self._replica_whole()
        if not self.is_logger:
            return None
        mode = self.lineage.mode(mode)
        parent = self.lineage.parent if mode == "delta" else None
        path = ck.new_checkpoint_dir(self.cfg.save_dir, mode, parent)
        seq = int(os.path.basename(path).split("-")[1])
        if self.trainer.replica is not None:        # the servers write what the workers hold
            self.client.dense_put(self.trainer.replica)
        infos = [json.loads(b) for b in self.client.save(seq, SAVE_MODES.index(mode), step)]
        ck.write_manifest(path, {"shards": infos, "config": self.cfg.to_json(), "meta": meta,
                                 "parent": parent, "schema": self.schema.to_dict(),
                                 "network": network_record(self.trainer.model)})
        self.lineage.saved(path, mode)
        log_line(f"SAVE --> {path} ({mode}, {sum(x['rows'] for x in infos)} rows)")
        tidy(self.cfg, self.lineage)
        return path

    def shrink(self, threshold):
        """The first worker shrinks; every worker waits for it, so that no pull of the next
        pass is served before the eviction."""
        removed = self.client.shrink(threshold) if self.is_logger else 0
        wait_collective(self.wcomm.Ibarrier(), "Ibarrier of the workers (after a shrink)")
        return removed

    def stats(self):
        if not self.is_logger:
            return {}
        srv = self.client.stats()                   # (S,) STATS_DTYPE records
        out = {"table_rows": int(srv["rows"].sum()), "table_bytes": int(srv["bytes"].sum()),
               "admitted_total": int(srv["admitted"].sum()),
               "ids_waiting": int(srv["waiting"].sum()),
               "requests_rejected": int(srv["rejected"].sum()),
               "requests_duplicate": int(srv["duplicates"].sum()),
               "replies_in_flight": int(srv["replies_in_flight"].sum())}
        if self.cfg.table_memory:
            out |= tier_record(srv)
        if self.cfg.mode == "ssp":
            out["ssp_max_lead"] = int(srv["ssp_max_lead"].max())
        if counts_staleness(self.cfg.mode, self.cfg.staleness):
            out["push_staleness"] = summarize(           # all servers, since the start
                srv["staleness_hist"].sum(axis=0), int(srv["staleness_sum"].sum()),
                int(srv["staleness_max"].max()), int(srv["staleness_unmatched"].sum()))
        return out | self.trainer.clip_summary()      # this worker's pushes

    def decide(self, fn):
        """fn() on the first worker (a Pass or None), the same answer on every worker."""
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

    def stop_now(self):
        """Has a stop signal come to any worker (mpips.job.stop)?  Every worker asks, in
        step (between epochs); all get one answer."""
        return bool(self._sum(np.array([STOP["flag"]], np.float64))[0])

    def emit(self, rec):
        if self.is_logger:
            write_metrics(self.cfg.metrics_out, rec)


def _answering(reader):
    """A reader's on_wait: while this worker waits for its next batch (a slow disk, a
    --pipe-command), it answers status requests, saying what it waits for, so that a
    dump shows the file instead of NO ANSWER."""
    def on_wait(t0):
        pipe = " (its --pipe-command)" if reader.schema.pipe_command else ""
        WATCH.waiting(f"reading data: waiting for the next batch of {reader.current}{pipe} "
                      f"[for {time.monotonic() - t0:.1f} s]", timed=False)
        WATCH.poll()
    return on_wait


def staged(comm, hosts, fn):
    """fn() on every rank of `comm`, rank 0 first; returns this rank's seconds in fn.

    If rank 0 had to compile (numba's cache was cold), the first rank of each other host
    (`hosts`: host name per rank) goes next, then the rest, which load what is cached;
    with a warm cache all the others at once.  Ranks waiting for a stage sleep between
    polls (they leave the core to the compiling rank)."""
    seconds = fn() if comm.rank == 0 else 0.0
    cold = np.array([comm.rank == 0 and cache_misses() > 0], np.int64)
    wait_collective(comm.Ibcast(cold, root=0), "Ibcast after the kernel warm-up of rank 0")
    leader = hosts.index(hosts[comm.rank]) == comm.rank
    stages = [leader, not leader] if cold[0] else [True]
    for run_now in stages:
        if run_now and comm.rank != 0:
            seconds = fn()
        wait_collective(comm.Ibarrier(), "Ibarrier after a kernel warm-up stage")
    return seconds


def report_profile(comm, root, prof):
    """Gather each rank's PROFILE_DTYPE record to every rank and print the per-rank profile
    on `root`; returns the job's exit code (the largest any rank asks for)."""
    n = len(PROFILE_DTYPE.names)
    table = np.zeros(comm.size, PROFILE_DTYPE)
    wait_collective(comm.Iallgather(prof.view(np.float64),
                                    table.view(np.float64).reshape(comm.size, n)))
    code = int(table["exit"].max())
    if comm.rank != root:
        return code
    log_line("PROFILE --> rank role compute_s wait_s server_busy_s requests MB_sent MB_recv "
             "peak_rss_MB rows cpu_s")
    for r, t in enumerate(table):
        role = "server" if t["server"] else "worker"
        log_line(f"PROFILE --> {r} {role} {t['compute_s']:.2f} {t['wait_s']:.2f} "
                 f"{t['server_busy_s']:.2f} {int(t['requests'])} {t['mb_sent']:.1f} "
                 f"{t['mb_recv']:.1f} {t['peak_rss_mb']:.0f} {int(t['rows'])} {t['cpu_s']:.2f}")
    return code
