"""Distributed run: split roles, serve or train, gather a per-rank profile at the end."""
import json
import os
import time

import numpy as np

from mpips.cluster import Cluster, default_servers
from mpips.train import (epoch_record, log_line, make_model, make_reader,
                         make_tables, peak_rss_mb, resolve_data, summary_line, write_metrics)

POLL = 1e-3   # seconds between polls of a collective that may take long (data generation)


def wait_collective(req):
    """Complete a non-blocking collective without burning a core."""
    while not req.Test():
        time.sleep(POLL)


def allreduce_sum(comm, arr):
    from mpi4py import MPI
    out = np.empty_like(arr)
    wait_collective(comm.Iallreduce(arr, out, op=MPI.SUM))
    return out


def run_distributed(cfg, comm):
    """Entry for every rank of a multi-rank job."""
    cluster = Cluster.create(comm, cfg.servers or default_servers(comm.size))
    if comm.rank == 0:     # generate the embedded dataset once, before anyone reads it
        resolve_data(cfg, True)
    wait_collective(comm.Ibarrier())
    model = make_model(cfg)
    from mpips.sharding import dense_bounds
    bounds = dense_bounds(model.n_params, cluster.n_servers)
    first_worker = cluster.worker_ranks[0]
    if comm.rank == first_worker:
        log_line(f"mpips: {comm.size} ranks, {cluster.n_servers} servers x {cluster.n_workers} "
                 f"workers, mode {cfg.mode}, {model.n_params} dense parameters")
        for line in cluster.role_map():
            log_line("  " + line)
    if cluster.is_server:
        prof = serve(cfg, cluster, model, bounds)
    else:
        prof = work(cfg, cluster, model, bounds)
    report_profile(comm, first_worker, prof)


def serve(cfg, cluster, model, bounds):
    from mpips import checkpoint as ck
    from mpips.config import SAVE_MODES
    from mpips.server.loop import Server
    i, S = cluster.index, cluster.n_servers
    sparse, dense = make_tables(cfg, model, bounds[i], bounds[i + 1])
    if cfg.resume:
        ck.load_shard_into(ck.resolve(cfg.resume), sparse, dense, i, S, bounds)
    server = Server(cluster.comm, cluster.worker_ranks, sparse, dense, cfg.mode, cfg.staleness,
                    cfg.peer_timeout, cfg.idle_sleep)
    if cfg.save_dir:
        def on_save(seq, mode_index):
            mode = SAVE_MODES[mode_index]
            path = os.path.join(cfg.save_dir, f"ckpt-{seq:06d}-{mode}")
            info = ck.save_shard(path, i, S, sparse, dense, int(bounds[i]), mode)
            return json.dumps(info).encode()
        server.on_save = on_save
    server.run()
    st = server.stats
    return [1, 0, 0, st["busy_s"], st["requests"], st["bytes_in"] / 1e6, peak_rss_mb(),
            len(sparse)]


def work(cfg, cluster, model, bounds):
    from mpips.data.files import split_files
    from mpips.metrics import BinaryMetrics
    from mpips.protocol import Op
    from mpips.worker.client import PSClient, plan_keys
    from mpips.worker.trainer import GeoTrainer, Trainer
    wi, W, S = cluster.index, cluster.n_workers, cluster.n_servers
    train_files, test_files = resolve_data(cfg, False)
    mine = split_files(train_files, W, wi)
    client = PSClient(cluster.comm, cluster.server_ranks, cfg.embedding_dim, bounds,
                      cfg.peer_timeout)
    logger = log_line if wi == 0 else None
    if cfg.mode == "geo":
        trainer = GeoTrainer(cfg, model, client, lambda ids: plan_keys(ids, S), log=logger)
    else:
        trainer = Trainer(cfg, model, client, lambda ids: plan_keys(ids, S), log=logger,
                          overlap=(cfg.mode == "async"))
    wcomm = cluster.role_comm
    slow = os.environ.get("MPIPS_DEBUG_SLOW_WORKER", "")   # "I:SECONDS": a test aid
    if slow and int(slow.split(":")[0]) == wi:
        trainer.step_delay = float(slow.split(":")[1])
    for epoch in range(first_epoch(cfg), cfg.epochs):
        wait_collective(wcomm.Ibarrier())
        t0 = time.perf_counter()
        reader = make_reader(cfg, mine, cfg.batch_size, log_line)
        try:
            st = trainer.train_epoch(reader, epoch, cfg.max_steps)
        finally:
            reader.close()
        client.barrier()                      # every worker's pushes are applied
        span = time.perf_counter() - t0
        if wi == 0 and should_save(cfg, epoch):
            save_distributed(cfg, client, {"epoch": epoch, "steps": st.steps})
        sums = allreduce_sum(wcomm, np.array([st.examples, st.loss_sum, client.bytes_sent,
                                              client.messages], np.float64))
        span = allreduce_max(wcomm, span)
        train_m = BinaryMetrics.from_state(allreduce_sum(wcomm, st.metrics.state()))
        test_m = None
        if test_files:
            reader = make_reader(cfg, test_files[wi::W], cfg.batch_size, log_line)
            try:
                local = trainer.evaluate(reader)
            finally:
                reader.close()
            test_m = BinaryMetrics.from_state(allreduce_sum(wcomm, local.state()))
        if wi == 0:
            srv = client.stats()
            rec = epoch_record(cfg, epoch, sums[0], span, sums[1], train_m, test_m,
                               {"workers": W, "servers": S,
                                "bytes_sent_per_example": round(sums[2] / max(sums[0], 1), 1),
                                "messages_sent": int(sums[3]),
                                "server_rows": int(srv[:, 0].sum()),
                                "server_bytes": int(srv[:, 1].sum())})
            if cfg.mode == "ssp":
                rec["ssp_max_lead"] = int(srv[:, 4].max())
            log_line(summary_line(rec))
            write_metrics(cfg.metrics_out, rec)
    client.control(Op.FINISH)
    return [0, trainer.compute_s, client.wait_s, 0, client.messages, client.bytes_sent / 1e6,
            peak_rss_mb(), 0]


def allreduce_max(comm, value):
    from mpi4py import MPI
    out = np.empty(1, np.float64)
    wait_collective(comm.Iallreduce(np.array([value], np.float64), out, op=MPI.MAX))
    return float(out[0])


def report_profile(comm, root, prof):
    """Gather one row per rank to `root` and print the per-rank profile there."""
    row = np.array(prof, np.float64)
    table = np.empty((comm.size, len(row)), np.float64) if comm.rank == root else None
    wait_collective(comm.Igather(row, table, root=root))
    if comm.rank != root:
        return
    log_line("PROFILE --> rank role compute_s wait_s server_busy_s requests MB_sent "
             "peak_rss_MB rows")
    for r, t in enumerate(table):
        role = "server" if t[0] else "worker"
        log_line(f"PROFILE --> {r} {role} {t[1]:.2f} {t[2]:.2f} {t[3]:.2f} {int(t[4])} "
                 f"{t[5]:.1f} {t[6]:.0f} {int(t[7])}")


def first_epoch(cfg):
    """The epoch to start from: after the one recorded in the --resume checkpoint."""
    if not cfg.resume:
        return 0
    from mpips import checkpoint as ck
    return int(ck.read_manifest(ck.resolve(cfg.resume))["meta"].get("epoch", -1)) + 1


def should_save(cfg, epoch):
    return bool(cfg.save_dir) and ((epoch + 1) % cfg.save_every == 0 or epoch + 1 == cfg.epochs)


def save_distributed(cfg, client, meta):
    """First worker, after a barrier: every server writes its shard, then the manifest."""
    from mpips import checkpoint as ck
    from mpips.config import SAVE_MODES
    path = ck.new_checkpoint_dir(cfg.save_dir, cfg.save_mode)
    seq = int(os.path.basename(path).split("-")[1])
    infos = [json.loads(b) for b in client.save(seq, SAVE_MODES.index(cfg.save_mode))]
    ck.write_manifest(path, {"shards": infos, "config": cfg.to_json(), "meta": meta})
    log_line(f"SAVE --> {path} ({cfg.save_mode}, {sum(x['rows'] for x in infos)} rows)")
