"""The server process of ``python -m mpips.serve``: model, protocols, HTTP, reload, signals.

``run(args)`` loads the model (``Live``), starts the HTTP server (``HttpServer`` over
``Api``), prints the ready line, and on SIGTERM/SIGINT stops accepting, finishes the
requests begun and returns 0.  Following an export folder (``--follow``), and with
``--processes N`` for N > 1, the process is the master of N forked server processes
(``shared.Pool``): the master reads and builds every new version (at a low priority, in
a process of its own, so a reload takes no time from a request, not even the GIL) and
sends it to each process, which swaps to it between two requests.  A single process
serves a fixed ``--bundle`` alone.
"""
import asyncio
import gc
import signal

from mpips.serving import shared
from mpips.serving.api import Api, Metrics
from mpips.serving.http import HttpServer
from mpips.serving.live import Live


def ready_line(args, port, serving, processes):
    m = serving.model
    grpc = "" if args.grpc_port is None else f" grpc {args.host}:{args.grpc_port}"
    return (f"mpips.serve: ready http://{args.host}:{port}{grpc} model {args.name} version "
            f"{serving.version} rows {len(m)} processes {processes} "
            f"{m.schema.describe()}")


async def _serve(args, live, child, log):
    """Serve until SIGTERM/SIGINT (or, for a forked process, the master's end); 0."""
    loop = asyncio.get_running_loop()
    if child is not None:                 # counts summed over the processes (api.Metrics)
        metrics = Metrics(live, child.index, args.metrics_dir)
    else:
        metrics = Metrics(live)
        live.on_reload = metrics.reloaded
    api = Api(live, args.name, metrics, args.max_instances)
    srv = HttpServer(api, args.host, args.port, max_body=args.max_body_bytes,
                     idle_timeout=args.idle_timeout, on_refused=metrics.refused,
                     sock=child.sock if child else None, parser=args.http_parser)
    await srv.start()
    rpc = None
    if args.grpc_port is not None:        # (imported here: hpack only with --grpc-port)
        from mpips.serving.grpc_v2 import GrpcV2
        rpc = GrpcV2(api)
        args.grpc_port = await rpc.start(args.host, args.grpc_port, args.max_body_bytes,
                                         shared_port=child is not None,
                                         idle_timeout=args.idle_timeout)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # (forked)

    if child is not None:
        def on_message():                     # a version (or a reload record) of the master
            new, reload = child.receive(live, args.header)
            if reload is None:
                stop.set()                    # the master is gone
                return
            if new is not None:              # (the master counts the reloads)
                live.current = new
                metrics.show(new)
        loop.add_reader(child.conn.fileno(), on_message)
        child.said_ready()
    else:
        log(ready_line(args, srv.port, live.current, 1))
    await stop.wait()
    if rpc is not None:
        await asyncio.gather(srv.stop(), rpc.stop())
    else:
        await srv.stop()
    if child is not None:
        loop.remove_reader(child.conn.fileno())
    return 0


def run(args, log=None):
    log = log or (lambda s: print(s, flush=True))
    if args.processes > 1 or args.follow:
        return shared.Pool(args, log).run(
            lambda child, live: asyncio.run(_serve(args, live, child, log)),
            lambda port, serving: ready_line(args, port, serving, args.processes))
    live = Live(args.bundle, None, args.header, log)
    gc.collect()
    gc.freeze()            # what is loaded stays out of the collector's full passes (latency)
    return asyncio.run(_serve(args, live, None, log))
