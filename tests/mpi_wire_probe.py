"""Hostile wire input, run as `mpiexec -n 3 python -m tests.mpi_wire_probe` (tests/test_wire.py).

rank 0 serves one shard (a real Server, worker ranks [1]); rank 1 is its worker and sends
valid requests around a series of crafted malformed ones; rank 2 is not a worker and
sends one well-formed PULL.  Checked: every bad request is rejected and counted (STATS),
the rows read before and after the bad ones are identical (nothing created, nothing
changed), and the server keeps serving (a valid push afterwards does change its rows).
Each rank prints its failed checks to stderr; the verdicts are gathered to rank 0 and
the exit code is the number of failed checks (0 = pass).
"""
import sys
import time

import numpy as np
from mpi4py import MPI

from mpips.protocol import (F_CREATE, F_DENSE, HEADER_BYTES, STATS_LEN, TAG_CONTROL,
                            TAG_REPLY_SPARSE, TAG_REQUEST, Op, encode, message_nbytes)

DIM, DENSE = 4, 8
KEYS = np.arange(1, 11, dtype=np.int64)          # rows created by the first valid pull
NEW = np.array([1001, 1002, 1003], np.int64)      # ids only the bad requests mention
SERVER, WORKER, OUTSIDER = 0, 1, 2
DEADLINE = 20.0                                   # seconds for any wait in this probe


def message(op, keys, values=None, dense=None, step=0, flags=0):
    """A valid request as a uint8 buffer (header fields can be edited afterwards)."""
    dim = 0 if values is None else values.shape[1]
    buf = np.zeros(message_nbytes(len(keys), dim, 0 if dense is None else len(dense)), np.uint8)
    encode(buf, op, 1, 0, keys, values, step, flags, dense)
    return buf


def edit(buf, **fields):
    """Overwrite header fields (op, req_id, table, count, step, dim, flags, dense_len)."""
    names = ("op", "req_id", "table", "count", "step", "dim", "flags", "dense_len")
    hdr = buf[:HEADER_BYTES].view(np.int64)
    for k, v in fields.items():
        hdr[names.index(k)] = v
    return buf


def bad_messages():
    """(name, bytes) of requests a server must reject."""
    grads = np.full((len(NEW), DIM), 0.5, np.float32)
    push = lambda: message(Op.PUSH, NEW, grads)                          # noqa: E731
    nan = grads.copy()
    nan[1, 2] = np.nan
    out = [
        ("unknown op", edit(push(), op=99)),
        ("op zero", edit(push(), op=0)),
        ("unknown table", edit(push(), table=3)),
        ("count larger than the buffer", edit(push(), count=len(NEW) + 5)),
        ("count smaller than the buffer", edit(push(), count=1)),
        ("absurd count", edit(push(), count=1 << 40)),
        ("negative count", edit(push(), count=-3)),
        ("negative dim", edit(push(), dim=-1)),
        ("absurd dim", edit(message(Op.PUSH, NEW[:0]), dim=1 << 30)),
        ("negative dense length", edit(push(), dense_len=-8)),
        ("truncated header", push()[:HEADER_BYTES - 24]),
        ("truncated body", push()[:-4]),
        ("odd byte count", np.concatenate([push(), np.zeros(3, np.uint8)])),
        ("rows of the wrong width", message(Op.PUSH, NEW, np.ones((3, DIM - 1), np.float32))),
        ("NaN gradient", message(Op.PUSH, NEW, nan)),
        ("inf in a dense slice", message(Op.PUSH, NEW[:0], None,
                                         np.full(DENSE, np.inf, np.float32), flags=F_DENSE)),
        ("dense slice of the wrong length", message(Op.ADD, NEW[:0], None,
                                                    np.ones(DENSE + 1, np.float32))),
        ("pull carrying rows", message(Op.PULL, NEW, grads, flags=F_CREATE)),
        ("barrier with a body", message(Op.BARRIER, NEW)),
        ("save in a run without --save-dir", message(Op.SAVE, NEW[:0])),
    ]
    return out


def pull(comm, keys, create):
    out = np.empty((len(keys), DIM), np.float32)
    req = comm.Irecv(out, SERVER, TAG_REPLY_SPARSE)
    comm.Send(message(Op.PULL, keys, flags=F_CREATE if create else 0), SERVER, TAG_REQUEST)
    wait(req)
    return out


def stats(comm):
    out = np.zeros(STATS_LEN, np.int64)
    req = comm.Irecv(out, SERVER, TAG_CONTROL)
    comm.Send(message(Op.STATS, KEYS[:0]), SERVER, TAG_REQUEST)
    wait(req)
    return out


def wait(req):
    t0 = time.monotonic()
    while not req.Test():
        if time.monotonic() - t0 > DEADLINE:
            raise TimeoutError("no reply from the server: it stopped serving")
        time.sleep(1e-3)


def check(failures, cond, what):
    if not cond:
        failures.append(what)
        print(f"wire probe rank {MPI.COMM_WORLD.rank}: FAILED: {what}", file=sys.stderr,
              flush=True)


def run_worker(comm, failures):
    before = pull(comm, KEYS, create=True)                   # creates 10 rows
    bad = bad_messages()
    for _, buf in bad:
        comm.Send([buf, len(buf), MPI.BYTE], SERVER, TAG_REQUEST)
    after = pull(comm, np.concatenate([KEYS, NEW]), create=False)
    check(failures, np.array_equal(after[:len(KEYS)], before), "rows changed by bad requests")
    check(failures, not after[len(KEYS):].any(), "a bad request created rows")
    t0, expected = time.monotonic(), len(bad) + 1           # + the outsider's request
    st = stats(comm)
    while st[8] < expected and time.monotonic() - t0 < DEADLINE:
        st = stats(comm)
    check(failures, st[8] == expected, f"rejected {st[8]} requests, expected {expected}")
    check(failures, st[0] == len(KEYS), f"table has {st[0]} rows, expected {len(KEYS)}")
    grads = np.ones((len(KEYS), DIM), np.float32)            # the server still serves
    comm.Send(message(Op.PUSH, KEYS, grads), SERVER, TAG_REQUEST)
    moved = pull(comm, KEYS, create=False)
    check(failures, bool((moved < before).all()), "a valid push after the bad ones was lost")
    comm.Send(message(Op.FINISH, KEYS[:0]), SERVER, TAG_REQUEST)


def run_server(comm, failures):
    from mpips.server.dense_table import DenseTable
    from mpips.server.loop import Server
    from mpips.server.optim import OptimizerConfig
    from mpips.server.sparse_table import SparseTable
    opt = OptimizerConfig(name="sgd", lr=0.1)
    server = Server(comm, [WORKER], SparseTable(DIM, opt, seed=1, init_range=0.5),
                    DenseTable(np.zeros(DENSE, np.float32), opt), timeout=DEADLINE)
    server.run()
    check(failures, server.rejected == len(bad_messages()) + 1,
          f"server counted {server.rejected} rejections")


def main():
    comm = MPI.COMM_WORLD
    failures = []
    try:
        if comm.rank == SERVER:
            run_server(comm, failures)
        elif comm.rank == WORKER:
            run_worker(comm, failures)
        else:               # not a worker: a well-formed request from a stranger
            comm.Send(message(Op.PULL, KEYS, flags=F_CREATE), SERVER, TAG_REQUEST)
    except Exception as e:  # noqa: BLE001 - reported through the exit code
        check(failures, False, f"{type(e).__name__}: {e}")
        comm.Abort(len(failures))
    counts = np.zeros(comm.size, np.int64) if comm.rank == 0 else None
    comm.Gather(np.array([len(failures)], np.int64), counts, root=0)
    if comm.rank == 0:
        print(f"wire probe: {len(bad_messages())} bad messages sent; failed checks per rank "
              f"{counts.tolist()}", flush=True)
        return int(counts.sum())
    return 0


if __name__ == "__main__":
    sys.exit(main())
