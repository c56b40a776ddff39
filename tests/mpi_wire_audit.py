"""The audit's crafted requests (issue 23, D1-D7) against real servers, run as
`mpiexec -n 4 python -m tests.mpi_wire_audit SAVE_DIR` (tests/test_wire.py).

Ranks 0 and 1 are the two servers of one sync job (shard 0 and 1 of 2: each owns the ids
``mpips.tables.ownership.owners`` gives it), rank 0 with Adagrad, rank 1 with Adam (lr 0.1), both
saving into SAVE_DIR.  Ranks 2 (A) and 3 (B) are its two workers, scripted with raw
messages so that each crafted request can be sent exactly as the audit did.  After the
requests of a scenario a worker sends STATS and takes every message the server sent
before the STATS reply (``Wire.collect``): the refusals (``TAG_ERROR``, one line naming
the worker), the replies, and the server's counters.  Each scenario:

D1  wrong sizes and tags: 16 bytes and 64 KiB on the status tag, 12 bytes on a reply tag,
    a request over the size limit, a refusal from a rank that is no server: each
    discarded with one line; the next status request is answered (servers and a worker);
D2  a create-PULL, a PUSH and a mixed PULL for ids the other server owns: refused;
D3  a sync training PULL sent twice with its id (dropped as a duplicate, answered once)
    and once more with a new id (refused);
D5  a PUSH listing one id 20,000 times with |g| = 1e15: refused; a PUSH repeating ids
    within the bound: applied once per id with the summed rows (Adagrad, Adam);
D4  a training PULL for the next step and a FINISH from a worker at the barrier: refused;
    a reading PULL parked there is answered when the barrier releases;
D7  a delta SAVE sent twice with its id (a duplicate) and again with a new id (refused):
    the shard written first stays on disk;
D6  DENSE_PUT with Adam v = -1, beta1_pow = 1, beta2_pow < 0, a NaN, Adagrad accum < 0,
    an inf, and (issue 33) finite but absurd state: m or a weight of 3e38, beta1_pow
    0.99999994 or off the sequence 0.9 ** t, beta powers of different steps, m = 1 where
    v = 0: refused; a valid one comes back bit for bit from DENSE_GET;
D8  (issue 33) a PUSH with a NaN and request id 2^63 - 1: refused, and it does not move
    the sender's counter: the next request (id last + 1) is answered, not dropped;
and a real ``PSClient`` whose servers are listed in the wrong order fails with
``RequestRefused`` carrying the server's line.  After each scenario a valid request is
answered and its rows equal a numpy reference (initial rows from (seed, id); Adagrad and
Adam written out in numpy).  The exit code is the number of failed checks.
"""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpips import checkpoint as ck
from mpips.comm.liveness import WATCH, RequestRefused
from mpips.tables.ownership import owners, plan_keys
from mpips.comm.protocol import (F_CREATE, STATS_DTYPE, STATS_LEN, TAG_CONTROL, TAG_DUMP,
                            TAG_DUMP_REPLY, TAG_ERROR, TAG_REPLY_DENSE, TAG_REPLY_SPARSE,
                            TAG_REQUEST, Op, encode, message_nbytes)
from mpips.tables.dense import DenseTable
from mpips.server.loop import Server
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.worker.client import PSClient
from tests.mpi_verdict import check as verdict_check, verdict

DIM, DENSE, SEED, INIT, LR = 4, 8, 11, 0.5, 0.1
S0, S1, A, B = 0, 1, 2, 3
OPT = {S0: "adagrad", S1: "adam"}
MAX_REQUEST = 1 << 20           # the servers' request size limit in this probe
DEADLINE = 30.0
EMPTY = np.empty(0, np.int64)
_ids = np.arange(1, 400, dtype=np.int64)
OWN = [_ids[owners(_ids, 2) == s] for s in (S0, S1)]    # ids each server owns, ascending
KA = {s: OWN[s][:4] for s in (S0, S1)}                  # A's and B's ids (two shared)
KB = {s: OWN[s][2:6] for s in (S0, S1)}


def message(op, keys=EMPTY, values=None, dense=None, step=0, flags=0):
    dim = 0 if values is None else values.shape[1]
    buf = np.zeros(message_nbytes(len(keys), dim, 0 if dense is None else len(dense)), np.uint8)
    encode(buf, op, 0, 0, keys, values, step, flags, dense)
    return buf


def check(failures, cond, what):
    return verdict_check(failures, cond, what, "wire audit")


def receive(comm, src, tag=MPI.ANY_TAG):
    """The next message from src (any tag): (tag, uint8 bytes)."""
    status, t0 = MPI.Status(), time.monotonic()
    while (msg := comm.Improbe(src, tag, status)) is None:
        if time.monotonic() - t0 > DEADLINE:
            raise TimeoutError(f"no message from rank {src} within {DEADLINE} s")
        time.sleep(1e-4)
    data = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    msg.Recv([data, len(data), MPI.BYTE])
    return status.Get_tag(), data


class Wire:
    """A worker's raw requests: numbered 1, 2, 3, ... like PSClient's."""

    def __init__(self, comm, failures):
        self.comm, self.failures, self.last = comm, failures, 0

    def send(self, dest, buf, tag=TAG_REQUEST, same_id=False):
        if tag == TAG_REQUEST and not same_id:
            self.last += 1
            buf[8:16].view(np.int64)[0] = self.last
        self.comm.Send([buf, len(buf), MPI.BYTE], dest, tag)
        return buf

    def collect(self, server):
        """Send STATS; return ({tag: [bytes, ...]} the server sent before its STATS reply,
        in order per tag, and the STATS record)."""
        self.send(server, message(Op.STATS))
        got = {}
        while True:
            tag, data = receive(self.comm, server)
            if tag == TAG_CONTROL and len(data) == 8 * STATS_LEN:
                return got, data.view(STATS_DTYPE)[0]
            got.setdefault(tag, []).append(data)

    def refused(self, got, server, *reasons):
        """got holds exactly one refusal per reason, in order, each naming this worker."""
        lines = [bytes(x).decode() for x in got.pop(TAG_ERROR, [])]
        me = f"request from rank {self.comm.rank}: "
        ok = len(lines) == len(reasons) and all(me in x and r in x for x, r in zip(lines, reasons))
        return check(self.failures, ok, f"server {server}: refusals {lines}, want {reasons}")


def rows_of(data, n):
    return data.view(np.float32).reshape(n, DIM)


def init_rows(keys):
    """Rows a server makes for new ids: from (seed, id) alone."""
    out = np.empty((len(keys), DIM), np.float32)
    SparseTable(DIM, OptimizerConfig(name="sgd"), SEED, INIT).pull(keys, out, create=True)
    return out


def adagrad_ref(w, g):
    """One Adagrad step from a zero accumulator, in float64 (the kernel's maths)."""
    g = g.astype(np.float64)
    return (w.astype(np.float64) - LR * g / (np.sqrt(g * g) + 1e-8)).astype(np.float32)


def adam_ref(w, g):
    """One lazy-Adam step from zero moments, in float32 as the kernel does it."""
    f = np.float32
    b1, b2, one = f(0.9), f(0.999), f(1)
    b1p, b2p = np.float64(f(0.9)), np.float64(f(0.999))
    c2 = np.sqrt(1.0 - b2p)
    lr_t, eps_t = f(LR * c2 / (1.0 - b1p)), f(1e-8 * c2)
    m = (one - b1) * g
    v = (one - b2) * g * g
    return w - lr_t * m / (np.sqrt(v) + eps_t)


def summed(*parts):
    """{id: summed row} of (keys, rows) parts, in order (float32, as the server adds)."""
    out = {}
    for keys, rows in parts:
        for k, r in zip(keys.tolist(), rows):
            out[k] = out.get(k, np.zeros(DIM, np.float32)) + r
    return out


# ------------------------------------------------------------------------- servers
def run_server(comm, save_dir):
    s = comm.rank
    opt = OptimizerConfig(name=OPT[s], lr=LR)
    sparse = SparseTable(DIM, opt, SEED, INIT)
    dense = DenseTable(np.zeros(DENSE, np.float32), opt)
    server = Server(comm, [A, B], sparse, dense, "sync", timeout=DEADLINE, idle_max=1e-4,
                    label=f"audit server {s}", shard=(s, 2))
    server.max_request = MAX_REQUEST
    server.on_save, server.save_check = ck.server_save_hooks(save_dir, s, 2, sparse, dense,
                                                             s * DENSE)
    server.run()
    print(f"wire audit server {s}: rejected {server.rejected} duplicates {server.duplicates} "
          f"ignored {server.watch.ignored}", flush=True)


# ------------------------------------------------------------------------- workers
def d1_sizes_and_tags(me, wire, wcomm, failures):
    comm = wire.comm
    if me == A:
        wire.send(S0, np.zeros(16, np.uint8), TAG_DUMP)
        wire.send(S1, np.zeros(1 << 16, np.uint8), TAG_DUMP)
        wire.send(S0, np.zeros(12, np.uint8), TAG_REPLY_SPARSE)
        wire.send(S0, np.zeros(MAX_REQUEST + 8, np.uint8))
        for s in (S0, S1):
            wire.send(s, np.zeros(8, np.uint8), TAG_DUMP)
            got, st = wire.collect(s)
            line = bytes(got.pop(TAG_DUMP_REPLY, [b""])[0]).decode()
            check(failures, line.startswith(f"rank {s} (audit server {s}): serving, mode sync")
                  and "of a wrong size or tag discarded" in line, f"server {s} status: {line!r}")
            wire.refused(got, s, *(["over the largest request"] if s == S0 else []))
            check(failures, not got and st["rows"] == 0, f"D1: server {s} sent {list(got)}")
        wire.send(B, np.zeros(16, np.uint8), TAG_DUMP)
        wire.send(B, np.frombuffer(b"a refusal from a rank that is no server", np.uint8), TAG_ERROR)
        wire.send(B, np.zeros(8, np.uint8), TAG_DUMP)
        tag, data = receive(comm, B)
        check(failures, tag == TAG_DUMP_REPLY and bytes(data).startswith(b"rank 3 (audit worker B)"),
              f"worker B's status line: {tag} {bytes(data)!r}")
    else:
        t0 = time.monotonic()
        while WATCH.answered_at < t0 or WATCH.ignored < 2:
            WATCH.poll(force=True)
            if time.monotonic() - t0 > DEADLINE:
                raise TimeoutError("worker B: no valid status request")
            time.sleep(1e-4)
        check(failures, WATCH.ignored == 2, f"worker B ignored {WATCH.ignored} messages")
    wcomm.Barrier()


def d2_foreign_ids(me, wire, wcomm, failures):
    if me == A:
        foreign = OWN[S1][:3]
        wire.send(S0, message(Op.PULL, foreign, step=0, flags=F_CREATE))
        wire.send(S0, message(Op.PUSH, foreign, np.ones((3, DIM), np.float32), step=0))
        wire.send(S0, message(Op.PULL, np.concatenate([OWN[S0][:2], OWN[S1][:1]]), step=0,
                              flags=F_CREATE))
        wire.send(S1, message(Op.PULL, OWN[S0][:3], step=0, flags=F_CREATE))
        for s, reasons in ((S0, ["3 of 3 ids", "3 of 3 ids", "1 of 3 ids"]), (S1, ["3 of 3 ids"])):
            got, st = wire.collect(s)
            wire.refused(got, s, *[f"for {r} this server does not own" for r in reasons])
            check(failures, not got and st["rows"] == 0, f"D2: server {s} made rows or replied")
    wcomm.Barrier()


def pull_step(me, wire, wcomm, failures, s, step, scenario=""):
    """Both workers pull their ids of server s for `step` (A first: held until B's is in);
    returns this worker's rows.  In D3, A's pull is sent again, with its id and without."""
    keys = KA[s] if me == A else KB[s]
    rows = np.zeros((len(keys), DIM), np.float32)
    if me == A:
        buf = wire.send(s, message(Op.PULL, keys, step=step, flags=F_CREATE))
        if scenario == "D3":
            wire.send(s, buf, same_id=True)                     # a duplicate
            wire.send(s, message(Op.PULL, keys, step=step, flags=F_CREATE))
            got, st = wire.collect(s)
            wire.refused(got, s, f"PULL for step {step} twice")
            check(failures, not got and st["duplicates"] == 1,
                  f"D3: a held pull was answered early or the duplicate not counted: {st}")
    wcomm.Barrier()
    if me == B:
        wire.send(s, message(Op.PULL, keys, step=step, flags=F_CREATE))
    wcomm.Barrier()
    got, st = wire.collect(s)
    replies = got.pop(TAG_REPLY_SPARSE, [])
    if check(failures, len(replies) == 1 and not got and st["rejected"] >= 0,
             f"{scenario} step {step}: server {s} answered with {len(replies)} replies {list(got)}"):
        rows = rows_of(replies[0], len(keys))
    return rows


def d5_pushes(me, wire, wcomm, failures, s, big, valid):
    """A's push listing one id 20,000 times with 1e15 is refused; then A's `valid` push
    (ids repeated, sums within the bound) and B's push make the step.  Returns the
    {id: summed gradient} the step applies."""
    if me == A:
        flood = np.full(20000, KA[s][0], np.int64)
        wire.send(s, message(Op.PUSH, flood, np.full((20000, DIM), big, np.float32), step=0))
        wire.send(s, message(Op.PUSH, *valid, step=0))
        got, st = wire.collect(s)
        wire.refused(got, s, f"(id {KA[s][0]} listed 20000 times), beyond 1e+15")
        check(failures, not got, f"D5: server {s} replied {list(got)}")
    wcomm.Barrier()
    gb = np.full((len(KB[s]), DIM), 0.25, np.float32)
    if me == B:
        wire.send(s, message(Op.PUSH, KB[s], gb, step=0))
        got, _ = wire.collect(s)
        check(failures, not got, f"D5: server {s} answered B's push with {list(got)}")
    wcomm.Barrier()
    return summed(valid, (KB[s], gb))


def compare(failures, what, got, want, rtol):
    ok = np.isfinite(got).all() and np.allclose(got, want, rtol=rtol, atol=0)
    return check(failures, ok, f"{what}: rows {got.tolist()} want {want.tolist()}")


def after_step(rows0, grads, ref, keys):
    """Rows of `keys` after one step of the optimizer `ref` with {id: gradient} grads."""
    g = np.stack([grads.get(k, np.zeros(DIM, np.float32)) for k in keys.tolist()])
    return ref(rows0, g)


def d4_held_at_barrier(me, wire, wcomm, failures, rows_a):
    if me == A:
        wire.send(S0, message(Op.BARRIER))
        wire.send(S0, message(Op.PULL, KA[S0], step=2, flags=F_CREATE))
        wire.send(S0, message(Op.PULL, KA[S0], step=2))             # parked to the release
        wire.send(S0, message(Op.FINISH))
        got, _ = wire.collect(S0)
        wire.refused(got, S0, "PULL for step 2 after this worker's BARRIER",
                     "FINISH with 1 of its requests still held")
        check(failures, not got, f"D4: answered before the release: {list(got)}")
    wcomm.Barrier()
    if me == B:
        wire.send(S0, message(Op.BARRIER))
        got, _ = wire.collect(S0)
        acks = got.pop(TAG_CONTROL, [])
        check(failures, len(acks) == 1 and acks[0].view(np.int64)[0] == 1 and not got,
              f"D4: B's barrier reply {acks} {list(got)}")
    wcomm.Barrier()
    if me == A:
        got, _ = wire.collect(S0)
        rows, acks = got.pop(TAG_REPLY_SPARSE, []), got.pop(TAG_CONTROL, [])
        if check(failures, len(rows) == 1 and len(acks) == 1 and not got,
                 f"D4: the parked pull or the release missing: {len(rows)} {len(acks)}"):
            check(failures, acks[0].view(np.int64)[0] == 1, "D4: the barrier reply")
            check(failures, np.array_equal(rows_of(rows[0], len(KA[S0])), rows_a),
                  "D4: the parked pull's rows differ from the phase's last")
    wcomm.Barrier()


def d7_save_twice(me, wire, failures, save_dir):
    if me != A:
        return
    for name in ("ckpt-000001-delta", "ckpt-000002-full"):
        os.makedirs(os.path.join(save_dir, name), exist_ok=True)
    save = wire.send(S0, message(Op.SAVE, np.array([1], np.int64), step=0, flags=2))
    wire.send(S0, save, same_id=True)                               # delivered twice
    wire.send(S0, message(Op.SAVE, np.array([1], np.int64), step=0, flags=2))
    got, st = wire.collect(S0)
    wire.refused(got, S0, "SAVE for checkpoint 1 twice")
    infos = [json.loads(bytes(x)) for x in got.pop(TAG_CONTROL, [])]
    shard = os.path.join(save_dir, "ckpt-000001-delta", "shard-00000-of-00002.h5")
    check(failures, len(infos) == 1 and infos[0]["rows"] == 6 and st["duplicates"] == 2
          and os.path.getsize(shard) == infos[0]["bytes"] and not got,
          f"D7: replies {infos} {list(got)}, duplicates {st['duplicates']}")
    wire.send(S0, message(Op.SAVE, np.array([2], np.int64), step=0, flags=0))
    got, st = wire.collect(S0)
    infos = [json.loads(bytes(x)) for x in got.pop(TAG_CONTROL, [])]
    check(failures, len(infos) == 1 and infos[0]["rows"] == 6 and not got,
          f"D7: the next SAVE answered with {infos} {list(got)}")


def d6_dense_state(me, wire, failures):
    if me != A:
        return
    x = np.arange(DENSE, dtype=np.float32)
    good = {S1: np.concatenate([0.5 * x, 0.01 * x, 0.02 * x, [0.9 ** 3, 0.999 ** 3]]),
            S0: np.concatenate([0.5 * x, 0.3 * x])}
    on_seq = "must be beta ** t for a step t >= 1"
    bad = {S1: [(2 * DENSE + 3, -1.0, "'v' must be >= 0"), (3 * DENSE, 1.0, f"'beta1_pow' {on_seq}"),
                (3 * DENSE + 1, -0.5, f"'beta2_pow' {on_seq}"), (DENSE, np.nan, "non-finite"),
                # issue 33: finite but absurd (each made weights inf or moved one by 1.7e5)
                (DENSE + 1, 3e38, "'m' must be <= 1e+15"), (2, 3e38, "'values' must be <= 1e+06"),
                (3 * DENSE, np.float32(0.99999994), f"'beta1_pow' {on_seq}"),
                (DENSE, 1.0, "'m' 1 is out of reach of v 0"),      # v[0] = 0: any m moves
                (3 * DENSE, 0.9 ** 5, "beta powers of different steps"),  # far; beta2 at 3
                (3 * DENSE, 0.9 ** 3 * 1.01, "is not 0.9 ** t for a whole step")],
           S0: [(DENSE + 2, -0.5, "'accum' must be >= 0"), (1, np.inf, "non-finite"),
                (1, -3e38, "'values' must be >= -1e+06")]}
    for s in (S1, S0):
        for i, value, _ in bad[s]:
            state = good[s].astype(np.float32)
            state[i] = value
            wire.send(s, message(Op.DENSE_PUT, dense=state))
        wire.send(s, message(Op.DENSE_PUT, dense=good[s].astype(np.float32)))
        wire.send(s, message(Op.DENSE_GET))
        got, _ = wire.collect(s)
        wire.refused(got, s, *[r for _, _, r in bad[s]])
        back = got.pop(TAG_REPLY_DENSE, [])
        check(failures, len(back) == 1 and not got and np.array_equal(
            back[0].view(np.float32), good[s].astype(np.float32)),
            f"D6: server {s} DENSE_GET after a valid DENSE_PUT: {back} {list(got)}")


def d8_refused_id_moves_nothing(me, wire, failures):
    if me != A:
        return
    push = message(Op.PUSH, KA[S0][:1], np.full((1, DIM), np.nan, np.float32), step=0)
    push[8:16].view(np.int64)[0] = np.iinfo(np.int64).max
    wire.send(S0, push, same_id=True)
    got, st = wire.collect(S0)          # STATS with id last + 1: answered, not a duplicate
    wire.refused(got, S0, "non-finite")
    check(failures, not got, f"D8: after the refused PUSH: {list(got)}")


def client_refused(me, wire, failures):
    """A PSClient with its servers in the wrong order: both refuse its pull, and the wait
    raises RequestRefused with the server's line."""
    if me != B:
        return
    client = PSClient(wire.comm, [S1, S0], DIM, np.array([0, DENSE, 2 * DENSE]), timeout=DEADLINE,
                      label="audit worker B")
    client.req_id = wire.last
    plan = plan_keys(np.concatenate([OWN[S0][:3], OWN[S1][:3]]), 2)
    h = client.pull(plan, np.zeros((6, DIM), np.float32), step=0, create=False)
    lines, t0 = [], time.monotonic()
    while len(lines) < 2 and time.monotonic() - t0 < DEADLINE:
        try:
            h.wait() if not lines else WATCH.poll(force=True)
        except RequestRefused as e:
            lines.append(str(e))
        time.sleep(1e-4)
    for r, want in zip(h.reqs, h.expect):
        if want is not None:        # the replies it waited for will not come
            r.Cancel()
    MPI.Request.Waitall(h.reqs)
    wire.last = client.req_id
    check(failures, len(lines) == 2 and all(
        "refused a request of this worker: request from rank 3: PULL for 3 of 3 ids this "
        "server does not own" in x for x in lines), f"the client's refusals: {lines}")


def run_worker(comm, wcomm, save_dir, failures):
    me = comm.rank
    wire = Wire(comm, failures)
    if me == B:
        WATCH.bind(comm, "audit worker B")
        WATCH.listen([S0, S1])
    d1_sizes_and_tags(me, wire, wcomm, failures)
    d2_foreign_ids(me, wire, wcomm, failures)
    mine = {s: KA[s] if me == A else KB[s] for s in (S0, S1)}
    init = {s: pull_step(me, wire, wcomm, failures, s, 0, "D3" if s == S0 else "")
            for s in (S0, S1)}
    for s in (S0, S1):
        compare(failures, f"server {s}: step 0 rows", init[s], init_rows(mine[s]), 0)
    a0 = KA[S0]                                       # ids repeated within the bound
    valid = (a0[[0, 1, 0, 2, 3]], np.array([[0.5] * DIM, [-0.25] * DIM, [0.125] * DIM,
                                            [1.0] * DIM, [-2.0] * DIM], np.float32))
    grads = d5_pushes(me, wire, wcomm, failures, S0, 1e15, valid)
    rows1 = pull_step(me, wire, wcomm, failures, S0, 1)
    compare(failures, "D5 Adagrad: step 1 rows", rows1,
            after_step(init[S0], grads, adagrad_ref, mine[S0]), 1e-6)
    d4_held_at_barrier(me, wire, wcomm, failures, rows1)
    d7_save_twice(me, wire, failures, save_dir)
    d6_dense_state(me, wire, failures)
    d8_refused_id_moves_nothing(me, wire, failures)
    a1, top = KA[S1], np.float32(2.0 ** 48)          # 3 x 2^48 = 8.4e14: within 1e15
    valid = (a1[[0, 0, 1, 0]], np.array([[top] * DIM, [top] * DIM, [0.5] * DIM, [top] * DIM],
                                        np.float32))
    grads = d5_pushes(me, wire, wcomm, failures, S1, 1e15, valid)
    want1 = after_step(init[S1], grads, adam_ref, mine[S1])
    compare(failures, "D5 Adam: step 1 rows", pull_step(me, wire, wcomm, failures, S1, 1),
            want1, 1e-5)
    client_refused(me, wire, failures)
    wcomm.Barrier()
    for s in (S0, S1):
        wire.send(s, message(Op.FINISH))


def main():
    comm = MPI.COMM_WORLD
    save_dir = sys.argv[1]
    failures = []
    wcomm = comm.Split(int(comm.rank in (A, B)))

    def body():
        if comm.rank in (S0, S1):
            run_server(comm, save_dir)
        else:
            run_worker(comm, wcomm, save_dir, failures)
    return verdict(comm, failures, "wire audit", body)


if __name__ == "__main__":
    sys.exit(main())
