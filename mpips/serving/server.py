"""The server process of ``python -m mpips.serve``: model, protocols, HTTP, reload, signals.

``run(args)`` loads the model (``Live``), starts the HTTP server (``HttpServer`` over
``Api``), prints the ready line, follows the export folder when asked, and on
SIGTERM/SIGINT stops accepting, finishes the requests begun and returns 0.  A new
version found by the follower is published in the event loop's thread (warmed there
first, so the first request on it pays nothing), between two requests.  With
``--processes N`` the process is the master of N forked server processes
(``shared.Pool``): each runs ``_serve`` on the inherited socket and takes the versions the
master sends.
"""
import asyncio
import gc
import signal
import sys
import threading

from mpips.serving import shared
from mpips.serving.api import Api, Metrics
from mpips.serving.http import HttpServer
from mpips.serving.live import Live, warm

# The event loop waits at most this long for the GIL while the follower thread holds it
# (reading a patch, building the next version): Python's default is 5 ms.
SWITCH_SECONDS = 0.0005


def ready_line(args, port, serving, processes):
    m = serving.model
    return (f"mpips.serve: ready http://{args.host}:{port} model {args.name} version "
            f"{serving.version} rows {len(m)} processes {processes} "
            f"{m.schema.describe()}")


async def _serve(args, live, child, log):
    """Serve until SIGTERM/SIGINT (or, for a forked process, the master's end); 0."""
    loop = asyncio.get_running_loop()
    metrics = Metrics(live, child.index if child else 0)
    live.on_reload = metrics.reloaded
    api = Api(live, args.name, metrics, args.max_instances)
    srv = HttpServer(api, args.host, args.port, max_body=args.max_body_bytes,
                     idle_timeout=args.idle_timeout, on_refused=metrics.refused,
                     sock=child.sock if child else None)
    await srv.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # (forked)

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

    if child is not None:
        def on_message():                     # a version (or a reload record) of the master
            new, reload = child.receive(live, args.header)
            if reload is None:
                stop.set()                    # the master is gone
                return
            if new is not None:
                live.current = new
                metrics.show(new)
            if isinstance(reload, list):
                metrics.reloaded(reload[0], reload[1], live.current)
        loop.add_reader(child.conn.fileno(), on_message)
        child.said_ready()
    else:
        if live.folder is not None:
            live.follow(publish, args.poll_seconds)
        log(ready_line(args, srv.port, live.current, 1))
    await stop.wait()
    await srv.stop()
    if child is not None:
        loop.remove_reader(child.conn.fileno())
    live.stop()
    return 0


def run(args, log=None):
    log = log or (lambda s: print(s, flush=True))
    if args.processes > 1:
        return shared.Pool(args, log).run(
            lambda child, live: asyncio.run(_serve(args, live, child, log)),
            lambda port, serving: ready_line(args, port, serving, args.processes))
    live = Live(args.bundle, args.follow, args.header, log)
    gc.collect()
    gc.freeze()            # what is loaded stays out of the collector's full passes (latency)
    sys.setswitchinterval(SWITCH_SECONDS)
    return asyncio.run(_serve(args, live, None, log))
