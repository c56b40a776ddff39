"""The server process of ``python -m mpips.serve``: model, protocols, HTTP, reload, signals.

``run(args)`` loads the model (``Live``), starts the HTTP server (``HttpServer`` over
``Api``), prints the ready line, follows the export folder when asked, and on
SIGTERM/SIGINT stops accepting, finishes the requests begun and returns 0.  A new
version found by the follower is published in the event loop's thread (warmed there
first, so the first request on it pays nothing), between two requests.
"""
import asyncio
import signal
import threading

from mpips.serving import shared
from mpips.serving.api import Api, Metrics
from mpips.serving.http import HttpServer
from mpips.serving.live import Live, warm


def ready_line(args, port, serving, processes):
    m = serving.model
    return (f"mpips.serve: ready http://{args.host}:{port} model {args.name} version "
            f"{serving.version} rows {len(m)} processes {processes} "
            f"{m.schema.describe()}")


async def _serve(args, live, group, log):
    loop = asyncio.get_running_loop()
    metrics = Metrics(live, group.rank if group else 0)
    live.on_reload = metrics.reloaded
    api = Api(live, args.name, metrics, args.max_instances)
    srv = HttpServer(api, args.host, args.port, max_body=args.max_body_bytes,
                     idle_timeout=args.idle_timeout, reuse_port=group is not None,
                     on_refused=metrics.refused)
    leader = group is None or group.leader
    if leader:                     # the first process picks the port, the others join it
        await srv.start()
    if group is not None:
        port = await loop.run_in_executor(None, group.first_port, srv.port if leader else 0)
        if not leader:
            srv.port = port
            await srv.start()
        await loop.run_in_executor(None, group.started)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def publish(new):
        """Swap to ``new`` in the loop's thread; return once it is the current one."""
        done = threading.Event()

        def swap():
            warm(new.model)                   # this thread's workspace, before the swap
            live.current = new
            metrics.show(new)
            done.set()
        loop.call_soon_threadsafe(swap)
        while not done.wait(0.5):
            if loop.is_closed():
                return

    if group is not None:
        publish = group.follow(live, publish)
    if live.folder is not None and leader:
        live.follow(publish, args.poll_seconds)
    if leader:
        log(ready_line(args, srv.port, live.current, group.size if group else 1))
    await stop.wait()
    await srv.stop()
    live.stop()
    if group is not None:
        await loop.run_in_executor(None, group.stop)
    return 0


def run(args, log=None):
    log = log or (lambda s: print(s, flush=True))
    group = shared.Group.start(args) if args.processes > 1 else None
    if group is None:
        live = Live(args.bundle, args.follow, args.header, log)
    else:
        live = group.live(args, log)
    return asyncio.run(_serve(args, live, group, log))
