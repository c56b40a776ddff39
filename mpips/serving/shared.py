"""One table per node in shared memory: for ``mpips.infer`` ranks and ``mpips.serve
--processes N``.

:func:`node_window` (``mpips.infer``): the node's first rank says how large each array
is, every rank of the node joins one ``MPI.Win.Allocate_shared`` (the memory is the first
rank's), maps it, and gets numpy views carved from it in one layout; the first rank fills
them.  A node then holds the table once, however many processes read it.

:class:`Pool` runs ``mpips.serve --processes N`` without MPI: the first process (the
master) imports everything, loads the model into shared memory (``memfd``), warms its
kernels, binds the port, and then forks N server processes, which inherit all of that:
the interpreter's, numpy's and numba's pages stay shared copy-on-write (the proportional
set size splits them), the table is shared memory, and the listening socket is one
(each process accepts from it).  The master serves no request: it follows the export
folder, builds each new version into shared memory (a patch: a new small overlay segment
over the same base; a fold or a full bundle: a new base segment) and sends it to every
process over a Unix socket (the file descriptors, and JSON: no pickle); each process maps
it and swaps between two requests.  A segment is freed by the kernel when the last
process drops it.  The master also watches its processes: one that dies is restarted
(forked again from the master, with the version being served), up to ``RESTARTS`` in
``RESTART_WINDOW`` seconds; past that, or when a process dies before it is ready, the
server stops and exits 1.  SIGTERM/SIGINT to the master reach every process (each
finishes its requests in flight); the master exits 0 when all of them did.
"""
import gc
import json
import mmap
import os
import selectors
import signal
import socket
import threading
import time

import numpy as np
from prometheus_client.multiprocess import mark_process_dead

from mpips.schema import Schema
from mpips.serving.live import Live, Serving
from mpips.serving.model import ServingModel
from mpips.serving.table import Table
from mpips.tables.sparse import slots_for

ALIGN = 64                 # every carved array starts on a cache line
RESTARTS, RESTART_WINDOW = 5, 60.0
MAX_MESSAGE = 1 << 20


def table_layout(n, dim, n_slots, n_params):
    return [("keys", np.int64, (n,)), ("values", np.float32, (n, dim)),
            ("slots", np.int32, (n_slots,)), ("params", np.float32, (n_params,))]


def _size(dtype, shape):
    return -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN


def layout_bytes(layout):
    return sum(_size(d, s) for _, d, s in layout)


def carve(mem, layout):
    """{name: array view} laid out one after the other (aligned) in the uint8 buffer ``mem``."""
    out, off = {}, 0
    for name, dtype, shape in layout:
        k = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out[name] = mem[off:off + k].view(dtype).reshape(shape)
        off += _size(dtype, shape)
    return out


def node_window(node, layout, leader):
    """(window, views) of ``layout`` in memory shared by communicator ``node``; a
    collective of the node's ranks; only the leader's layout's sizes count (it has the
    memory), the others pass the same layout (their sizes told by the leader)."""
    from mpi4py import MPI
    nbytes = layout_bytes(layout)
    win = MPI.Win.Allocate_shared(nbytes if leader else 0, 1, comm=node)
    buf, _ = win.Shared_query(0)
    return win, carve(np.frombuffer(buf, np.uint8, count=nbytes), layout)


# ---------------------------------------------------------------------- memfd segments
def base_layout(n, dim):
    return [("keys", np.int64, (n,)), ("values", np.float32, (n, dim)),
            ("slots", np.int32, (slots_for(n),))]


def top_layout(m, dim, n_params):
    return [("ov_keys", np.int64, (m,)), ("ov_values", np.float32, (m, dim)),
            ("ov_slots", np.int32, (slots_for(m),)), ("ov_dead", np.uint8, (m,)),
            ("params", np.float32, (n_params,))]


def segment(layout, fd=None):
    """(fd, views): a new shared memory file (memfd) of ``layout``, or file ``fd`` mapped.
    The mapping lives as long as a view does; the memory, until the last mapping and
    descriptor of it are gone."""
    nbytes = layout_bytes(layout)
    if fd is None:
        fd = os.memfd_create("mpips-table", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(nbytes, ALIGN))
    mm = mmap.mmap(fd, max(nbytes, ALIGN))
    return fd, carve(np.frombuffer(mm, np.uint8, count=nbytes), layout)


def _meta(model, source_time):
    return {"model": model.model_cfg, "data": model.data, "version": model.version,
            "schema": model.schema.to_dict(), "source_time": source_time,
            "n_rows": len(model.table)}


class Pool:
    """The master of ``mpips.serve --processes N`` (see the module's docstring)."""

    def __init__(self, args, log):
        self.args, self.log = args, log
        self.base = None           # (id, fd, keys array) of the base segment being served
        self.message = None        # (JSON, fds) of the version ``share`` made last
        self.kids = {}             # index -> (pid, master's end of its socket)
        self.ready = set()
        self.restarts = []
        self.stopping = self.failed = False

    def share(self, model, source_time=None):
        """``model`` moved into shared memory (Live's ``share``): its base segment when it
        is a new one, and a new top segment (overlay + dense weights)."""
        t = model.table
        if self.base is None or t.keys is not self.base[2]:
            fd, views = segment(base_layout(len(t.keys), t.dim))
            for k in ("keys", "values", "slots"):
                views[k][...] = getattr(t, k)
            if self.base is not None:
                os.close(self.base[1])
            self.base = ((self.base[0] + 1) if self.base else 1, fd, views["keys"])
            base = views
        else:
            base = {k: getattr(t, k) for k in ("keys", "values", "slots")}
        fd, top = segment(top_layout(len(t.ov_keys), t.dim, len(model.params)))
        for k in ("ov_keys", "ov_values", "ov_slots", "ov_dead", "params"):
            top[k][...] = model.params if k == "params" else getattr(t, k)
        meta = _meta(model, source_time)
        meta.update(base=[self.base[0], len(t.keys), t.dim], top=len(t.ov_keys),
                    n_params=len(model.params))
        if self.message is not None:
            os.close(self.message[1][1])
        self.message = (meta, [self.base[1], fd])
        table = Table.from_arrays({**base, **top}, len(t))
        return model.with_table(table, top["params"])

    # ------------------------------------------------------------ master
    def run(self, serve_child, ready_line):
        """Load, fork the N processes (``serve_child(child, live) -> exit code`` in each),
        log ``ready_line(port, serving)`` when all are ready, follow, supervise; the exit
        code of the server."""
        a = self.args
        from prometheus_client import CollectorRegistry

        from mpips.serving.api import ReloadMetrics
        self.live = Live(a.bundle, a.follow, a.header, self.log, share=self.share,
                         on_reload=ReloadMetrics(CollectorRegistry()).reloaded)
        info = socket.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM,
                                  flags=socket.AI_PASSIVE)[0]
        self.sock = socket.socket(info[0], socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(info[4])
        self.sock.listen(1024)
        self.port = self.sock.getsockname()[1]
        if a.grpc_port is not None:      # held (bound, not listening) so every process
            self.grpc_sock = socket.socket(info[0], socket.SOCK_STREAM)   # binds one port
            self.grpc_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self.grpc_sock.bind((info[4][0], a.grpc_port))
            a.grpc_port = self.grpc_sock.getsockname()[1]
        self.serve_child, self.ready_line = serve_child, ready_line
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        self.wake = (wake_r, wake_w)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        signal.set_wakeup_fd(wake_w.fileno())
        self.sel = selectors.DefaultSelector()
        self.sel.register(wake_r, selectors.EVENT_READ, None)
        try:
            for i in range(a.processes):
                self._spawn(i)
            return self._supervise()
        finally:
            signal.set_wakeup_fd(-1)
            for s, h in old.items():
                signal.signal(s, h)

    def _on_signal(self, signum, frame):
        self.stopping = True

    def _spawn(self, index):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        gc.collect()
        gc.freeze()                  # the objects made so far stay shared with the children
        stops = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)   # the child's handlers come first
        pid = os.fork()
        if pid == 0:                 # the child: serve until told to stop, never return
            code = 1
            try:                     # (its event loop unblocks the signals: serve.server)
                signal.set_wakeup_fd(-1)
                for s in stops:
                    signal.signal(s, signal.SIG_DFL)
                mine.close()
                self.wake[0].close()
                self.wake[1].close()
                for _, conn in self.kids.values():
                    conn.close()
                t = self.live.current.model.table
                child = Child(index, self.sock, theirs,
                              (self.base[0], {k: getattr(t, k) for k in ("keys", "values", "slots")}))
                code = self.serve_child(child, self.live)
            except BaseException as e:  # noqa: BLE001 - reported, then the process ends
                self.log(f"mpips.serve: process {index}: {type(e).__name__}: {e}")
            finally:
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        theirs.close()
        mine.setblocking(False)
        self.kids[index] = (pid, mine)
        self.sel.register(mine, selectors.EVENT_READ, index)

    def _send(self, meta, fds):
        data = json.dumps(meta).encode()
        for index, (pid, conn) in list(self.kids.items()):
            try:
                socket.send_fds(conn, [data], fds)
            except OSError:
                pass                 # a process that is gone: _reap restarts it

    def _supervise(self):
        a, live = self.args, self.live
        announced = False
        next_poll = time.monotonic()
        while not self.stopping:
            timeout = max(0.0, next_poll - time.monotonic()) if live.folder else 1.0
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    try:
                        key.fileobj.recv(4096)        # a signal woke us
                    except BlockingIOError:
                        pass
                elif not self.stopping:
                    self._from_child(key.data, key.fileobj)
            if self.stopping:
                break
            if not announced and len(self.ready) == a.processes:
                announced = True
                self.log(self.ready_line(self.port, live.current))
            if live.folder and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + a.poll_seconds
                self._poll()
        return self._stop()

    def _poll(self):
        live = self.live
        t0 = time.perf_counter()
        refused = live.refused
        box = {}

        def check():                 # at a low priority: the serving processes come first
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except OSError:
                pass
            try:
                box["new"] = live.check()
            except Exception as e:  # noqa: BLE001 - a reload bug must not stop serving
                box["error"] = e
        worker = threading.Thread(target=check, name="mpips-reload")
        worker.start()
        worker.join()                # no thread is left when a process is forked
        if "error" in box:
            e = box["error"]
            self.log(f"mpips.serve: reload failed ({type(e).__name__}: {e}); still serving "
                     f"{live.current.version}")
            return
        new = box["new"]
        seconds = time.perf_counter() - t0
        if new is None:
            if live.refused != refused:
                self._send({"reload": [False, seconds]}, [])
            return
        live.current = new
        meta, fds = self.message
        self._send({**meta, "reload": [True, seconds]}, fds)
        self.log(f"mpips.serve: now serving {new.version} ({len(new.model)} rows, freshness "
                 f"lag {live.freshness_lag():.1f} s)")

    def _from_child(self, index, conn):
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data == b"ready":
            self.ready.add(index)
            return
        if data:
            return
        pid = self.kids.pop(index)[0]        # the process closed its end: it has ended
        self.sel.unregister(conn)
        conn.close()
        _, status = os.waitpid(pid, 0)
        mark_process_dead(pid)               # its gauges go; its counts stay in the sums
        code = os.waitstatus_to_exitcode(status)
        why = f"signal {-code}" if code < 0 else f"exit {code}"
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW] + [now]
        if index not in self.ready or len(self.restarts) > RESTARTS:
            self.log(f"mpips.serve: error: process {index} (pid {pid}) ended ({why}) "
                     + ("before it was ready" if index not in self.ready else
                        f"the {len(self.restarts)}th time in {RESTART_WINDOW:g} s")
                     + "; stopping the server")
            self.failed = self.stopping = True
            return
        self.ready.discard(index)
        self.log(f"mpips.serve: process {index} (pid {pid}) ended ({why}); restarting it")
        self._spawn(index)

    def _stop(self):
        """SIGTERM to every process; wait for them (each finishes its requests); the code."""
        self.sock.close()                # the processes close theirs: no one listens
        for pid, _ in self.kids.values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 30
        failed = self.failed
        for index, (pid, conn) in list(self.kids.items()):
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > end:
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    break
                time.sleep(0.02)          # a process finishing its requests; bounded above
            failed |= os.waitstatus_to_exitcode(status) != 0
            conn.close()
        self.kids.clear()
        return 1 if failed else 0


class Child:
    """A forked server process's view of its pool: its index, the listening socket, and
    the master's channel (versions in, ``ready`` out)."""

    def __init__(self, index, sock, conn, base):
        self.index, self.sock, self.conn = index, sock, conn
        self.base = base           # (id, base views) this process maps
        conn.setblocking(False)

    def said_ready(self):
        self.conn.sendall(b"ready")

    def receive(self, live, header):
        """One message of the master: (new Serving or None, reload record or None);
        (None, None) at the master's end (EOF)."""
        try:
            data, fds, _, _ = socket.recv_fds(self.conn, MAX_MESSAGE, 2)
        except (BlockingIOError, InterruptedError):
            return None, "nothing"
        if not data:
            return None, None
        meta = json.loads(data.decode())
        if not fds:
            return None, meta["reload"]
        try:
            bid, n, dim = meta["base"]
            if self.base is None or self.base[0] != bid:
                self.base = (bid, segment(base_layout(n, dim), fds[0])[1])
            top = segment(top_layout(meta["top"], dim, meta["n_params"]), fds[1])[1]
        finally:
            for fd in fds:
                os.close(fd)
        table = Table.from_arrays({**self.base[1], **top}, meta["n_rows"])
        cur = live.current.model
        schema = Schema.from_dict(meta["schema"])
        if meta["model"] == cur.model_cfg and not schema.diff(cur.schema):
            model = cur.with_table(table, top["params"], meta["data"], meta["version"])
        else:
            model = ServingModel(None, None, top["params"], meta["model"], meta["data"],
                                 meta["version"], schema=schema, table=table)
        return Serving(model, header, meta["source_time"]).warm(), meta["reload"]
