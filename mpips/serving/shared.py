"""One table per node in MPI shared memory: for ``mpips.infer`` ranks and ``mpips.serve
--processes N``.

:func:`node_window` is the mechanism: the node's first rank says how large each array is,
every rank of the node joins one ``MPI.Win.Allocate_shared`` (the memory is the first
rank's), maps it, and gets numpy views carved from it in one layout; the first rank fills
them.  A node then holds the table once, however many processes read it.

:class:`Group` runs ``mpips.serve --processes N``: N ranks started by ``mpiexec`` (the
command re-launches itself under it), one port (SO_REUSEPORT: the kernel spreads the
connections), one table.  The first rank loads (and, with ``--follow``, follows) the
model; each version is moved into a new shared window and announced to the others; every
rank then swaps to it on its own (``Live``: warm, then one reference swap between two
requests), and once all have swapped, the old window is freed, so two tables coexist
only for the seconds of a swap.  The announcements travel as a fixed int64 header and
JSON (no pickle); waiting ranks poll non-blocking collectives with a backoff, so an idle
node spends no CPU on them.
"""
import json
import os
import shutil
import sys
import threading

import numpy as np

from mpips.comm.backoff import COLLECTIVE, Backoff
from mpips.schema import Schema
from mpips.serving.live import Live, Serving
from mpips.serving.model import ServingModel

MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
HEADER = 7                 # kind, rows, slots, params, dim, meta bytes, port


def wait(req):
    """Complete a non-blocking MPI request, sleeping between tests."""
    backoff = Backoff(*COLLECTIVE)
    while not req.Test():
        backoff.sleep()


def table_layout(n, dim, n_slots, n_params):
    return [("keys", np.int64, (n,)), ("values", np.float32, (n, dim)),
            ("slots", np.int32, (n_slots,)), ("params", np.float32, (n_params,))]


def carve(mem, layout):
    """{name: array view} laid out one after the other in the uint8 buffer ``mem``."""
    out, off = {}, 0
    for name, dtype, shape in layout:
        k = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out[name] = mem[off:off + k].view(dtype).reshape(shape)
        off += k
    return out


def node_window(node, layout, leader):
    """(window, views) of ``layout`` in memory shared by communicator ``node``; a
    collective of the node's ranks; only the leader's layout's sizes count (it has the
    memory), the others pass the same layout (their sizes told by the leader)."""
    from mpi4py import MPI
    nbytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for _, d, s in layout)
    win = MPI.Win.Allocate_shared(nbytes if leader else 0, 1, comm=node)
    buf, _ = win.Shared_query(0)
    return win, carve(np.frombuffer(buf, np.uint8, count=nbytes), layout)


# ---------------------------------------------------------------------- serve --processes
def relaunch(n, argv):
    """Re-run this command under mpiexec with n ranks (replaces this process)."""
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = exe if os.path.exists(exe) else shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("--processes needs mpiexec (pip install 'mpips[mpich]')")
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(k, "1")
    sys.stdout.flush()
    os.execve(exe, [exe, "-n", str(n), sys.executable, "-m", "mpips.serve"] + list(argv), env)


class Group:
    """The N ranks of one ``mpips.serve --processes N`` on one node."""

    @classmethod
    def start(cls, args):
        if not any(k in os.environ for k in MPI_ENV):
            relaunch(args.processes, args.argv)
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.size != args.processes:
            raise RuntimeError(f"started with {comm.size} MPI ranks for --processes "
                               f"{args.processes}")
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        if node.size != comm.size:
            raise RuntimeError("--processes: all processes must run on one node")
        return cls(node)

    def __init__(self, node):
        self.node, self.rank, self.size = node, node.rank, node.size
        self.leader = self.rank == 0
        self.win = None              # the window of the version being served
        self._thread = None
        self._next = None            # the window of the version being published

    # ------------------------------------------------------------ messages
    def _bcast(self, arr):
        wait(self.node.Ibcast(arr, root=0))
        return arr

    def _announce(self, kind, model=None, source_time=None, port=0):
        """Leader: header (+ JSON) of the next message; others: receive it."""
        head = np.zeros(HEADER, np.int64)
        meta = b""
        if self.leader:
            if model is not None:
                meta = json.dumps({"model": model.model_cfg, "data": model.data,
                                   "version": model.version, "schema": model.schema.to_dict(),
                                   "source_time": source_time}).encode()
                head[1:5] = [len(model.keys), len(model.slots), len(model.params), model.dim]
            head[0], head[5], head[6] = kind, len(meta), port
        self._bcast(head)
        buf = np.frombuffer(meta, np.uint8).copy() if self.leader else \
            np.empty(int(head[5]), np.uint8)
        if head[5]:
            self._bcast(buf)
        return head, (json.loads(buf.tobytes().decode()) if head[5] else None)

    def _window(self, head, meta, model=None):
        """Collective: a new shared window of the announced sizes, filled by the leader
        from ``model``; the ServingModel over it."""
        n, n_slots, n_params, dim = (int(x) for x in head[1:5])
        win, views = node_window(self.node, table_layout(n, dim, n_slots, n_params),
                                 self.leader)
        if self.leader:
            for name, arr in model.arrays().items():
                views[name][...] = arr
        wait(self.node.Ibarrier())
        if self.leader:
            return win, model.with_arrays(views)
        return win, ServingModel(views["keys"], views["values"], views["params"],
                                 meta["model"], meta["data"], meta["version"],
                                 slots=views["slots"], schema=Schema.from_dict(meta["schema"]))

    def share(self, model, source_time=None):
        """Leader (Live's ``share``): announce ``model`` and move it into a new window."""
        head, meta = self._announce(1, model, source_time)
        self._next, shared = self._window(head, meta, model)
        return shared

    def _swapped(self, win):
        """After this rank published the version of ``win``: free the one before (all
        ranks have swapped once every rank is here: Free is collective)."""
        old, self.win = self.win, win
        if old is not None:
            old.Free()

    # ------------------------------------------------------------ lifecycle
    def live(self, args, log):
        """This rank's Live, its model in shared memory (the leader loads it privately,
        then moves it into the window and drops the private copy)."""
        if self.leader:
            live = Live(args.bundle, args.follow, args.header, log, share=self.share)
            self._swapped(self._next)
            return live
        head, meta = self._announce(0)
        win, model = self._window(head, meta)
        self._swapped(win)
        return Live(model=model, header=args.header, log=log, source_time=meta["source_time"])

    def first_port(self, port):
        """Leader: tell the port it bound; others: learn it."""
        return int(self._bcast(np.array([port], np.int64))[0])

    def started(self):
        wait(self.node.Ibarrier())

    def follow(self, live, publish):
        """The leader's publish step (then the old window goes); the others: a thread
        that takes each version the leader announces."""
        if self.leader:
            def publish_leader(new):
                publish(new)
                self._swapped(self._next)
            return publish_leader

        def run():
            while True:
                head, meta = self._announce(0)
                if head[0] != 1:
                    return
                win, model = self._window(head, meta)
                publish(Serving(model, live.header, meta["source_time"]).warm())
                self._swapped(win)
        self._thread = threading.Thread(target=run, name="mpips-shared", daemon=True)
        self._thread.start()
        return publish

    def stop(self):
        """Collective end: the leader says stop (after its follower has ended), the
        others' listeners return; the last window is freed."""
        if self.leader:
            self._announce(2)
        elif self._thread is not None:
            self._thread.join()
        wait(self.node.Ibarrier())
        self._swapped(None)
