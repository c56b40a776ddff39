"""`python -m mpips.serve`: online prediction over HTTP (docs/serving.md).

    python -m mpips.serve --bundle model.h5 --port 8500 --name ctr
    python -m mpips.serve --follow exports/ --processes 2

Speaks the Open Inference Protocol (KServe V2), TF-Serving's REST ``:predict`` and raw
lines, with Prometheus ``/metrics``; ``--follow`` applies the stream's new bundles and
patches in the background and swaps them in atomically.  Prints one ``mpips.serve:
ready`` line (URL, model, version, rows, schema) when it answers, and exits 0 on
SIGTERM/SIGINT after finishing the requests in flight.  ``--processes N`` serves one port
from N processes forked after the model is loaded, holding the table once, in shared
memory (``mpips.serving.shared``); ``/metrics`` then sums over them.  ``--grpc-port P``
also serves KServe V2 over gRPC.  Needs the ``serve`` extra (prometheus-client, httptools,
hpack, protobuf).
"""
import argparse
import os
import shutil
import sys
import tempfile
import traceback

PROG = "python -m mpips.serve"


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description="Serve a mpips model over HTTP "
                                "(and gRPC).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", help="a full bundle (python -m mpips.export)")
    src.add_argument("--follow", metavar="EXPORT_DIR", help="a stream's --export-dir: serve "
                     "its newest state and take new bundles and patches as they land")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1)")
    p.add_argument("--port", type=int, default=8500, help="port (0 = a free one; default 8500)")
    p.add_argument("--grpc-port", type=int, default=None, help="also serve KServe V2 over "
                   "gRPC on this port (0 = a free one, named in the ready line)")
    p.add_argument("--name", default="ctr", help="the model's name in the URLs (default ctr)")
    p.add_argument("--processes", type=int, default=1, help="server processes on the port, "
                   "sharing one table (default 1)")
    p.add_argument("--header", default=None, help="CSV schemas with a header: the column "
                   "names line of the raw lines clients send")
    p.add_argument("--max-instances", type=int, default=10000, help="instances (or lines) "
                   "per request (default 10000)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request body limit "
                   "(default 16 MiB)")
    p.add_argument("--poll-seconds", type=float, default=0.25, help="--follow: how often the "
                   "export index is checked (default 0.25)")
    p.add_argument("--http-parser", default="llhttp", choices=("llhttp", "builtin"),
                   help="the HTTP request parser: llhttp (httptools; default) or the "
                   "builtin one")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="close a connection idle "
                   "or stalled this long (seconds; default 30)")
    return p


def check_args(args):
    """One line naming the first bad flag, or ''."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535; got {args.port}"
    if args.grpc_port is not None and not 0 <= args.grpc_port <= 65535:
        return f"--grpc-port must be in 0..65535; got {args.grpc_port}"
    if args.grpc_port and args.grpc_port == args.port:
        return f"--grpc-port must differ from --port ({args.port})"
    if args.processes < 1:
        return f"--processes must be >= 1; got {args.processes}"
    for flag in ("max_instances", "max_body_bytes"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be >= 1"
    if args.poll_seconds <= 0 or args.idle_timeout <= 0:
        return "--poll-seconds and --idle-timeout must be > 0"
    if not args.name or any(c in args.name for c in "/:? \t"):
        return f"--name must be a non-empty name without / : ? or spaces; got {args.name!r}"
    return ""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    bad = check_args(args)
    if bad:
        print(f"mpips.serve: error: {bad}", file=sys.stderr)
        return 2
    metrics_dir, master = None, os.getpid()
    for k in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        os.environ.pop(k, None)             # (this server's own, below, or none)
    if args.processes > 1 or args.follow:   # forked processes (mpips.serving.shared): one
        # BLAS/OpenMP thread each, set before numpy loads (no BLAS thread pool across a fork)
        for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(k, "1")
        # and metrics summed over them: prometheus-client's multiprocess mode, chosen
        # before it is imported, in a directory of this server's (removed at the end)
        metrics_dir = tempfile.mkdtemp(prefix="mpips-serve-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    args.metrics_dir = metrics_dir          # (mpips.serving.server reads it from here)
    try:
        return _run(args)
    finally:
        if metrics_dir is not None and os.getpid() == master:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _run(args):
    try:
        from mpips.serving import server
        if args.grpc_port is not None:
            from mpips.serving import grpc_v2  # noqa: F401 - protobuf and hpack, before a fork
    except ImportError as e:
        print(f"mpips.serve: error: {e}; install the serve extra: pip install 'mpips[serve]'",
              file=sys.stderr)
        return 2
    try:
        return server.run(args)
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # noqa: BLE001 - the boundary of the program
        print(f"mpips.serve: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("MPIPS_TRACEBACK"):
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
