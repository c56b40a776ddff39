"""Distributed run: split roles, serve or train, gather a per-rank profile at the end."""
import json
import os
import time

import numpy as np

from mpips.cluster import Cluster, default_servers
from mpips.runner import wait_collective
from mpips.train import log_line, make_model, make_tables, peak_rss_mb, resolve_data


def run_distributed(cfg, comm):
    """Entry for every rank of a multi-rank job."""
    cluster = Cluster.create(comm, cfg.servers or default_servers(comm.size))
    if comm.rank == 0 and not cfg.stream:   # make the embedded dataset once, before reads
        resolve_data(cfg)
    pids = np.empty(comm.size, np.int64)    # in the role map: to match a launcher's PID
    wait_collective(comm.Iallgather(np.array([os.getpid()], np.int64), pids))
    model = make_model(cfg)
    from mpips.sharding import dense_bounds
    bounds = dense_bounds(model.n_params, cluster.n_servers)
    first_worker = cluster.worker_ranks[0]
    if comm.rank == first_worker:
        log_line(f"mpips: {comm.size} ranks, {cluster.n_servers} servers x {cluster.n_workers} "
                 f"workers, mode {cfg.mode}, {model.n_params} dense parameters")
        for line, pid in zip(cluster.role_map(), pids):
            log_line(f"  {line} pid {pid}")
    if cluster.is_server:
        prof = serve(cfg, cluster, model, bounds)
    else:
        prof = work(cfg, cluster, model, bounds)
    prof.append(time.process_time())          # CPU seconds of this rank, all of the run
    report_profile(comm, first_worker, prof)


def serve(cfg, cluster, model, bounds):
    from mpips import checkpoint as ck
    from mpips.config import SAVE_MODES
    from mpips.runner import inner_table
    from mpips.server.loop import Server
    from mpips.stream import resume_point
    i, S = cluster.index, cluster.n_servers
    sparse, dense = make_tables(cfg, model, bounds[i], bounds[i + 1])
    path = resume_point(cfg)[0]
    if path:
        ck.load_shard_into(path, inner_table(sparse), dense, i, S, bounds)
    server = Server(cluster.comm, cluster.worker_ranks, sparse, dense, cfg.mode, cfg.staleness,
                    cfg.peer_timeout, cfg.idle_sleep, label=f"server {i}",
                    idle_timeout=cfg.peer_timeout + cfg.stream_timeout)   # workers may poll
    if cfg.save_dir:
        def on_save(seq, mode_index):
            mode = SAVE_MODES[mode_index]
            path = os.path.join(cfg.save_dir, f"ckpt-{seq:06d}-{mode}")
            info = ck.save_shard(path, i, S, inner_table(sparse), dense, int(bounds[i]), mode)
            return json.dumps(info).encode()
        server.on_save = on_save
    server.run()
    st = server.stats
    return [1, 0, 0, st["busy_s"], st["requests"], st["bytes_in"] / 1e6, peak_rss_mb(),
            len(sparse)]


def work(cfg, cluster, model, bounds):
    from mpips.protocol import Op
    from mpips.runner import DistBackend, run_epochs
    from mpips.stream import run_stream
    from mpips.worker.client import PSClient, plan_keys
    from mpips.worker.trainer import GeoTrainer, Trainer
    wi, W, S = cluster.index, cluster.n_workers, cluster.n_servers
    train_files, test_files = ([], []) if cfg.stream else resolve_data(cfg)
    client = PSClient(cluster.comm, cluster.server_ranks, cfg.embedding_dim, bounds,
                      cfg.peer_timeout, label=f"worker {wi}")
    logger = log_line if wi == 0 else None
    if cfg.mode == "geo":
        trainer = GeoTrainer(cfg, model, client, lambda ids: plan_keys(ids, S), log=logger,
                             n_workers=W)
    else:
        trainer = Trainer(cfg, model, client, lambda ids: plan_keys(ids, S), log=logger,
                          overlap=(cfg.mode == "async"))
    slow = os.environ.get("MPIPS_DEBUG_SLOW_WORKER", "")   # "I:SECONDS": a test aid
    if slow and int(slow.split(":")[0]) == wi:
        trainer.step_delay = float(slow.split(":")[1])
    backend = DistBackend(cfg, trainer, client, cluster.role_comm, wi, W)
    if cfg.stream:
        run_stream(cfg, backend, log_line)
    else:
        run_epochs(cfg, backend, train_files, test_files)
    client.control(Op.FINISH)
    return [0, trainer.compute_s, client.wait_s, 0, client.messages, client.bytes_sent / 1e6,
            peak_rss_mb(), 0]


def report_profile(comm, root, prof):
    """Gather one row per rank to `root` and print the per-rank profile there."""
    row = np.array(prof, np.float64)
    table = np.empty((comm.size, len(row)), np.float64) if comm.rank == root else None
    wait_collective(comm.Igather(row, table, root=root))
    if comm.rank != root:
        return
    log_line("PROFILE --> rank role compute_s wait_s server_busy_s requests MB_sent "
             "peak_rss_MB rows cpu_s")
    for r, t in enumerate(table):
        role = "server" if t[0] else "worker"
        log_line(f"PROFILE --> {r} {role} {t[1]:.2f} {t[2]:.2f} {t[3]:.2f} {int(t[4])} "
                 f"{t[5]:.1f} {t[6]:.0f} {int(t[7])} {t[8]:.2f}")
