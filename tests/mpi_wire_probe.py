"""Hostile wire input, run as `mpiexec -n 5 python -m tests.mpi_wire_probe SAVE_DIR N_FUZZ`
(tests/test_wire.py).

Ranks 0..2 are real Servers, each with the one worker rank 3: rank 0 async (SGD, no
--save-dir), rank 1 sync (Adagrad, admission count:2, checkpoints into SAVE_DIR), rank 2
ssp with staleness 1 (Adam, admission probability:0.5).  Rank 4 is not a worker and sends
each server one well-formed PULL.

Each server reports to the worker, after every request of the worker, what became of it
(``TAG_OUTCOME``: rejected or not, whether the tables or the phase state changed, the
replies it has sent so far, the requests it still holds, whether it was a duplicate).
The worker numbers its requests 1, 2, 3, ... per server (``Link.send``).  It checks:
1. crafted malformed requests (``bad_messages``, ``hostile_messages``): each is rejected,
   answered with exactly one refusal line (``TAG_ERROR``) naming the worker, the server's
   tables and phase state are bit for bit unchanged (a digest of every row field, the
   admission counts and the dense state), nothing is held; a request sent again with its
   id is dropped as a duplicate, without a reply;
2. a property-based fuzz (hypothesis, derandomized): N_FUZZ random requests (op codes,
   header fields, lengths, flags, steps, payloads with NaN and inf) to random servers.
   Every one is either served (every reply it asks for arrives, nothing stays held, the
   tables stay finite), or rejected with one refusal line and the tables unchanged, or
   (a request id not above the last) dropped as a duplicate with the tables unchanged;
3. the rows read before and after the crafted requests are identical, and the servers
   keep serving (a well-formed pull is answered and a valid push changes the rows).
Each rank prints its failed checks to stderr; the verdicts are gathered to rank 0 and the
exit code is the number of failed checks (0 = pass).
"""
import os
import sys
import time
import zlib

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from mpips import checkpoint as ck
from mpips.comm.protocol import (F_CREATE, F_DENSE, HEADER_BYTES, STATS_DTYPE, STATS_LEN, TAG_CONTROL,
                            TAG_ERROR, TAG_REPLY_DENSE, TAG_REPLY_SPARSE, TAG_REQUEST, Op, encode,
                            message_nbytes)
from mpips.tables.admission import AdmittedTable
from mpips.tables.dense import DenseTable
from mpips.server.loop import Server
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from tests.mpi_verdict import check as verdict_check, verdict

DIM, DENSE = 4, 8
KEYS = np.arange(1, 11, dtype=np.int64)          # rows created by the first valid pull
NEW = np.array([1001, 1002, 1003], np.int64)      # ids only the bad requests mention
SERVERS, WORKER, OUTSIDER = (0, 1, 2), 3, 4
ASYNC, SYNC, SSP = SERVERS
DEADLINE = 20.0                                   # seconds for any wait in this probe
TAG_OUTCOME = 90                                  # probe only: server -> worker, int64[7]
SAVE_MODES = ("full", "base", "delta")
SPECIALS = (np.nan, np.inf, -np.inf, 1e30, -1e16, 1e15, -1e15, 3e38, 1e-45)
UNSET = -(2 ** 62)     # request id of a built message: Link.send gives it the next one
USUAL_OPS = (Op.PULL, Op.PULL, Op.PUSH, Op.PUSH, Op.ADD, Op.STATS, Op.BARRIER, Op.SAVE, Op.SHRINK)


def message(op, keys, values=None, dense=None, step=0, flags=0):
    """A valid request as a uint8 buffer (header fields can be edited afterwards; the
    request id is set when it is sent)."""
    dim = 0 if values is None else values.shape[1]
    buf = np.zeros(message_nbytes(len(keys), dim, 0 if dense is None else len(dense)), np.uint8)
    encode(buf, op, UNSET, 0, keys, values, step, flags, dense)
    return buf


def edit(buf, **fields):
    """Overwrite header fields (op, req_id, table, count, step, dim, flags, dense_len)."""
    names = ("op", "req_id", "table", "count", "step", "dim", "flags", "dense_len")
    hdr = buf[:HEADER_BYTES].view(np.int64)
    for k, v in fields.items():
        hdr[names.index(k)] = v
    return buf


def bad_messages():
    """(name, bytes) of requests the async server (rank 0) must reject."""
    grads = np.full((len(NEW), DIM), 0.5, np.float32)
    push = lambda: message(Op.PUSH, NEW, grads)                          # noqa: E731
    nan = grads.copy()
    nan[1, 2] = np.nan
    return [
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
        ("huge gradient", message(Op.PUSH, NEW, grads * np.float32(1e30))),
        ("inf in a dense slice", message(Op.PUSH, NEW[:0], None,
                                         np.full(DENSE, np.inf, np.float32), flags=F_DENSE)),
        ("dense slice of the wrong length", message(Op.ADD, NEW[:0], None,
                                                    np.ones(DENSE + 1, np.float32))),
        ("pull carrying rows", message(Op.PULL, NEW, grads, flags=F_CREATE)),
        ("barrier with a body", message(Op.BARRIER, NEW)),
        ("save in a run without --save-dir", message(Op.SAVE, NEW[:1])),
    ]


def hostile_messages(server):
    """(name, bytes) of requests that used to get through validation (issue 13, 11-14).

    Sent when the sync server has applied one step (phase step 1) and the ssp server has
    one push from the worker; the directories ckpt-000001-<mode> exist."""
    counts = lambda x: np.full((len(NEW), 1), x, np.float32)             # noqa: E731
    grads = np.full((len(NEW), DIM), 0.5, np.float32)
    pull = lambda c, **kw: message(Op.PULL, NEW, counts(c), flags=F_CREATE, **kw)  # noqa: E731
    common = [
        ("pull with NaN counts", pull(np.nan)),
        ("pull with inf counts", pull(np.inf)),
        ("pull with negative counts", pull(-5)),
        ("pull with fractional counts", pull(0.5)),
        ("pull with absurd counts", pull(1e30)),
        ("shrink with a negative threshold", message(Op.SHRINK, NEW[:0], step=-1)),
        ("shrink with an absurd threshold", message(Op.SHRINK, NEW[:0], step=1 << 62)),
        ("pull for a negative step", message(Op.PULL, KEYS, step=-4)),
        ("request id 0", edit(message(Op.STATS, NEW[:0]), req_id=0)),
        ("negative request id", edit(message(Op.PULL, KEYS), req_id=-7)),
    ]
    if server == SSP:
        return common + [("ssp pull that would wait for itself", message(Op.PULL, KEYS, step=3))]
    seq = np.array([1], np.int64)
    return common + [
        ("save with mode flag 3", message(Op.SAVE, seq, flags=3, step=1)),
        ("save with mode flag -1", message(Op.SAVE, seq, flags=-1, step=1)),
        ("save into a directory nobody made", message(Op.SAVE, seq + 41, flags=0, step=1)),
        ("save for a far-future step", message(Op.SAVE, seq, flags=0, step=1 << 40)),
        ("sync push for a far-future step", message(Op.PUSH, NEW, grads, step=1 << 40)),
        ("sync push for the next step", message(Op.PUSH, NEW, grads, step=2)),
        ("sync push for an applied step", message(Op.PUSH, NEW, grads, step=0)),
        ("sync pull for a far-future step", message(Op.PULL, KEYS, step=1 << 40)),
        ("sync pull two steps ahead", message(Op.PULL, KEYS, step=3)),
    ]


# ------------------------------------------------------------------- server side
def make_server(comm, save_dir):
    mode, staleness, opt, entry = {ASYNC: ("async", 0, "sgd", ""),
                                   SYNC: ("sync", 0, "adagrad", "count:2"),
                                   SSP: ("ssp", 1, "adam", "probability:0.5")}[comm.rank]
    cfg = OptimizerConfig(name=opt, lr=0.1)
    table = SparseTable(DIM, cfg, seed=1 + comm.rank, init_range=0.5)
    sparse = AdmittedTable(table, entry, seed=7) if entry else table
    dense = DenseTable(np.zeros(DENSE, np.float32), cfg)

    class ProbeServer(Server):
        """A Server that tells the worker what became of each of its requests."""
        replies = 0

        def _send(self, arr, dest, tag):
            self.replies += dest == WORKER
            super()._send(arr, dest, tag)

        def _receive(self, msg, status):
            source, rejected, before = status.Get_source(), self.rejected, digest(self)
            dups = self.duplicates
            super()._receive(msg, status)
            if source == WORKER and len(self.finished) < len(self.workers):
                held = len(self.deferred) + len(self.deferred_saves) + len(self.pending)
                out = np.array([self.rejected - rejected, digest(self) != before, self.replies,
                                held, self.version, finite(self), self.duplicates - dups],
                               np.int64)
                self.comm.Send(out, WORKER, TAG_OUTCOME)

    server = ProbeServer(comm, [WORKER], sparse, dense, mode, staleness, timeout=DEADLINE,
                         idle_max=1e-4, label=f"probe server {comm.rank}")
    if comm.rank == SYNC:
        server.on_save, server.save_check = ck.server_save_hooks(save_dir, 0, 1, table, dense, 0)
    return server


def _tables(server):
    sparse = server.sparse
    parts = [getattr(sparse, "table", sparse).export_rows(), server.dense.export_state()]
    if hasattr(sparse, "counts"):
        parts.append(sparse.counts.export_rows())
    return parts


def digest(server):
    """CRC of every table field, the admission counts, the dense state and the phase."""
    h = 0
    for part in _tables(server):
        for name in sorted(part):
            h = zlib.crc32(np.ascontiguousarray(part[name]).tobytes(), h)
    inner = getattr(server.sparse, "table", server.sparse)
    state = (server.version, sorted(server.active), sorted(server.at_barrier),
             sorted(server.pending), sorted(server.clock.items()), len(server.deferred),
             len(server.deferred_saves), server.evicted, getattr(server.sparse, "admitted", 0),
             inner.evicted_keys().tolist(), sorted(server.finished))
    return zlib.crc32(repr(state).encode(), h)


def finite(server):
    return all(np.isfinite(a).all() for part in _tables(server) for a in part.values()
               if a.dtype.kind == "f")


def run_server(comm, failures, save_dir):
    server = make_server(comm, save_dir)
    server.run()
    print(f"wire probe server {comm.rank}: rejected {server.rejected}", flush=True)


# ------------------------------------------------------------------- worker side
class Link:
    """The worker's requests to the servers, with the replies and outcomes they bring."""

    def __init__(self, comm, failures):
        self.comm, self.failures = comm, failures
        self.replies = dict.fromkeys(SERVERS, 0)       # replies received per server
        self.version = dict.fromkeys(SERVERS, 0)       # sync phase step, from outcomes
        self.rejected = dict.fromkeys(SERVERS, 0)
        self.duplicates = dict.fromkeys(SERVERS, 0)
        self.last_id = dict.fromkeys(SERVERS, 0)       # request ids sent, per server

    def send(self, server, buf):
        """Send one request (one built by `message` gets the next request id); return
        (outcome int64[7], [(tag, bytes)] replies before it)."""
        if len(buf) >= HEADER_BYTES:
            hdr = buf[:HEADER_BYTES].view(np.int64)
            if hdr[1] == UNSET:
                hdr[1] = self.last_id[server] + 1
            self.last_id[server] = max(self.last_id[server], int(hdr[1]))
        self.comm.Send([buf, len(buf), MPI.BYTE], server, TAG_REQUEST)
        got, status, t0 = [], MPI.Status(), time.monotonic()
        while True:
            while not self.comm.Iprobe(server, MPI.ANY_TAG, status):
                if time.monotonic() - t0 > DEADLINE:
                    raise TimeoutError(f"no word from server {server}: it stopped serving")
                time.sleep(2e-5)
            tag, n = status.Get_tag(), status.Get_count(MPI.BYTE)
            data = np.empty(n, np.uint8)
            self.comm.Recv([data, n, MPI.BYTE], server, tag)
            if tag == TAG_OUTCOME:
                out = data.view(np.int64)
                self.replies[server] += len(got)
                self.version[server] = int(out[4])
                self.rejected[server] += int(out[0])
                self.duplicates[server] += int(out[6])
                return out, got
            got.append((tag, data))

    def check_outcome(self, server, name, out, got, rejected=None):
        ok = check(self.failures, out[5] == 1, f"{name}: server {server} tables not finite")
        ok &= check(self.failures, out[2] == self.replies[server],
                    f"{name}: server {server} sent {out[2]} replies, {self.replies[server]} arrived")
        ok &= check(self.failures, out[3] == 0, f"{name}: server {server} holds {out[3]} requests")
        tags = [t for t, _ in got]
        if out[0] or out[6]:
            ok &= check(self.failures, out[1] == 0,
                        f"{name}: rejected by server {server} but the tables changed")
        if out[0]:              # one refusal line, naming the worker
            ok &= check(self.failures, tags == [TAG_ERROR] and b"request from rank %d" % WORKER
                        in bytes(got[0][1]), f"{name}: server {server} rejected it, replies {tags}")
        elif out[6]:
            ok &= check(self.failures, not got, f"{name}: a duplicate answered with {tags}")
        else:
            ok &= check(self.failures, TAG_ERROR not in tags, f"{name}: served and refused")
        if rejected is not None:
            ok &= check(self.failures, bool(out[0]) == rejected,
                        f"{name}: server {server} {'accepted' if out[0] == 0 else 'rejected'} it")
        return ok

    def request(self, server, buf, name, rejected=False):
        out, got = self.send(server, buf)
        self.check_outcome(server, name, out, got, rejected)
        return got

    def pull(self, server, keys, create, step=0, counts=None):
        got = self.request(server, message(Op.PULL, keys, counts, step=step,
                                           flags=F_CREATE if create else 0), "valid pull")
        if not check(self.failures, len(got) == 1 and got[0][0] == TAG_REPLY_SPARSE,
                     f"server {server}: pull answered with {[t for t, _ in got]}"):
            return np.zeros((len(keys), DIM), np.float32)
        return got[0][1].view(np.float32).reshape(len(keys), DIM)

    def stats(self, server):
        got = self.request(server, message(Op.STATS, KEYS[:0]), "stats")
        return (got[0][1] if got else np.zeros(8 * STATS_LEN, np.uint8)).view(STATS_DTYPE)[0]


def run_worker(comm, failures, save_dir, n_fuzz):
    link = Link(comm, failures)
    for mode in SAVE_MODES:                      # the worker makes a checkpoint's directory
        os.makedirs(os.path.join(save_dir, f"ckpt-000001-{mode}"), exist_ok=True)
    ones = np.ones((len(KEYS), 1), np.float32)
    before = {s: link.pull(s, KEYS, True, counts=None if s == ASYNC else ones * 2)
              for s in SERVERS}                  # admitted at once (count:2 / p = 0.5: see below)
    grads = np.full((len(KEYS), DIM), 0.25, np.float32)
    for s in (SYNC, SSP):                        # sync: phase step 1; ssp: one push
        link.request(s, message(Op.PUSH, KEYS, grads, step=0), "valid push")
        before[s] = link.pull(s, KEYS, True, step=1, counts=ones)
    for s in SERVERS:
        check(failures, link.stats(s)["rows"] > 0, f"server {s} made no rows")
    waiting = {s: link.stats(s)["waiting"] for s in SERVERS}
    t0 = time.monotonic()
    cases = [(ASYNC, n, b) for n, b in bad_messages()]
    cases += [(s, n, b) for s in (SYNC, SSP) for n, b in hostile_messages(s)]
    for s, name, buf in cases:
        link.request(s, buf, name, rejected=True)
    for s in SERVERS:
        after = link.pull(s, np.concatenate([KEYS, NEW]), create=False, step=link.version[s])
        check(failures, np.array_equal(after[:len(KEYS)], before[s]),
              f"server {s}: rows changed by bad requests")
        check(failures, not after[len(KEYS):].any(), f"server {s}: a bad request created rows")
        check(failures, link.stats(s)["waiting"] == waiting[s],
              f"server {s}: ids waiting for admission changed by bad requests")
    crafted = {s: link.rejected[s] for s in SERVERS}
    duplicate_requests(link)
    t1 = time.monotonic()
    n_done = fuzz(link, n_fuzz, save_dir) if n_fuzz else 0
    t2 = time.monotonic()
    for s in SERVERS:                            # still serving: a valid push moves the rows
        v = link.version[s]                      # (async, SGD lr 0.1: exactly rows - 0.1)
        for _ in range(4):                       # (re)admit the ids (the fuzz may evict)
            cur = link.pull(s, KEYS, create=True, step=v, counts=None if s == ASYNC else ones * 2)
        link.request(s, message(Op.PUSH, KEYS, np.ones((len(KEYS), DIM), np.float32), step=v),
                     "final push")
        moved = link.pull(s, KEYS, create=False, step=link.version[s])
        have = cur.any(axis=1)
        ok = (np.array_equal(moved, (cur.astype(np.float64) - 0.1).astype(np.float32))
              if s == ASYNC else bool((moved[have] != cur[have]).any()))
        check(failures, have.sum() >= len(KEYS) // 2 and ok and np.isfinite(moved).all(),
              f"server {s}: a valid push was lost ({have.sum()} rows admitted)")
        comm.Send(edit(message(Op.FINISH, KEYS[:0]), req_id=link.last_id[s] + 1), s, TAG_REQUEST)
    print(f"wire probe: {len(cases)} crafted bad messages, rejected per server "
          f"{[crafted[s] for s in SERVERS]}; fuzz: {n_done} cases, rejected "
          f"{sum(link.rejected.values()) - sum(crafted.values())} ({t1 - t0:.1f} s crafted, "
          f"{t2 - t1:.1f} s fuzz)", flush=True)


def duplicate_requests(link):
    """A request sent again with its id is dropped as a duplicate: the async server applies
    a push once (SGD, lr 0.1: rows - 0.1 x grads exactly), and answers a pull once."""
    keys, grads = KEYS[:3], np.full((3, DIM), 0.5, np.float32)
    rows = link.pull(ASYNC, keys, create=False)
    for buf in (message(Op.PUSH, keys, grads), message(Op.PULL, keys)):
        got = link.request(ASYNC, buf, f"valid {Op(int(buf[:8].view(np.int64)[0])).name}")
        out, again = link.send(ASYNC, buf)              # its id is kept: a duplicate
        link.check_outcome(ASYNC, "the same request again", out, again)
        check(link.failures, out[6] == 1 and not again, f"a duplicate was not dropped: {out}")
    want = (rows.astype(np.float64) - 0.1 * grads.astype(np.float64)).astype(np.float32)
    check(link.failures, np.array_equal(got[0][1].view(np.float32).reshape(3, DIM), want),
          "a duplicated push was not applied exactly once")
    link.request(ASYNC, message(Op.PUSH, keys, -grads), "undo the push")


# ------------------------------------------------------------------------- fuzz
def fuzz(link, n_cases, save_dir):
    """Random requests to random servers; every one served or rejected (Link checks).

    Hypothesis draws the structure (server, op, whether the body is shaped as the op wants,
    which header field to corrupt, how to cut the buffer) and a seed from which numpy draws
    the keys, step, flags and payload (few draws per case keep thousands of cases fast)."""
    done = [0]

    @settings(max_examples=n_cases, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(SERVERS), st.integers(0, 9), st.integers(0, 3), st.integers(0, 2**32),
           st.integers(0, 15), st.integers(0, 15))
    def case(server, pick, shape, seed, corrupt, cut):
        rng = np.random.default_rng(seed)
        buf = random_request(rng, link.version[server], pick, shape < 3)
        if corrupt >= 14:                        # corrupt a header field
            field = ("op", "table", "count", "dim", "dense_len", "req_id")[rng.integers(6)]
            value = rng.integers(-2, 20) if corrupt == 14 else big_int(rng)
            if field == "req_id":                # a duplicate, an id < 1, or one skipping ahead
                last = link.last_id[server]
                value = int(rng.choice([last, last - 3, 0, -1, last + 1 + rng.integers(100)]))
            edit(buf, **{field: value})
        if cut == 14:
            buf = buf[:rng.integers(0, len(buf) + 1)]
        elif cut == 15:
            buf = np.concatenate([buf, rng.integers(0, 256, rng.integers(1, 40)).astype(np.uint8)])
        if is_finish(buf):                       # a well-formed FINISH would end the server
            return
        out, got = link.send(server, buf)
        link.check_outcome(server, f"fuzz case {done[0]}", out, got)
        expect_replies(link, server, buf, out, got)
        done[0] += 1

    case()
    return done[0]


def big_int(rng):
    return int(rng.integers(-2**63, 2**63 - 1, dtype=np.int64, endpoint=True))


def random_request(rng, version, pick, shaped):
    """A request: mostly an op a worker sends (keys, widths and dense as the op wants them
    when `shaped`), sometimes FINISH with a body or any op code; random steps and flags."""
    op = (USUAL_OPS[rng.integers(len(USUAL_OPS))] if pick < 7 else Op.FINISH if pick == 7
          else int(rng.integers(-3, 13)) if pick == 8 else big_int(rng))
    n = int(rng.integers(0, 13))
    pool = np.concatenate([KEYS, NEW])
    keys = np.where(rng.random(n) < 0.8, rng.choice(pool, n), rng.integers(-2**63, 2**63 - 1, n))
    if shaped and op in (Op.SAVE, Op.STATS, Op.BARRIER, Op.SHRINK, Op.FINISH):
        keys = np.array([rng.choice([1, 1, 1, 2, 0, -1])], np.int64)[:int(op == Op.SAVE)]
    if shaped:
        dim = DIM if op in (Op.PUSH, Op.ADD) else int(rng.integers(2)) if op == Op.PULL else 0
        d = int(rng.choice([0, DENSE])) if op in (Op.PUSH, Op.ADD) else 0
    else:
        dim, d = int(rng.choice([0, DIM, 1, DIM - 1])), int(rng.choice([0, 0, DENSE, DENSE - 1]))
    if op == Op.FINISH and not len(keys) and not d:
        keys, dim = np.array([1], np.int64), 0
    values = payload(rng, len(keys) * dim).reshape(len(keys), dim) if dim else None
    if op == Op.PULL and dim == 1 and rng.random() < 0.9:      # occurrence counts
        values = rng.integers(0, 4, (len(keys), 1)).astype(np.float32)
    step = version if rng.random() < 0.7 else int(rng.choice([version + 1, version - 1, 0, 1, 2]))
    flags = int(rng.choice([0, F_CREATE, F_DENSE, F_CREATE | F_DENSE]))
    if op == Op.SAVE:
        flags = int(rng.integers(-1, 4))                        # mode index, 3 and -1 bad
    buf = np.zeros(message_nbytes(len(keys), dim, d), np.uint8)
    encode(buf, Op.PULL, UNSET, 0, keys, values, 0, 0, payload(rng, d) if d else None)
    return edit(buf, op=int(op), step=step if rng.random() < 0.9 else big_int(rng),
                flags=flags if rng.random() < 0.9 else big_int(rng))


def payload(rng, n):
    """n float32: raw random bytes, or small normal values, some set to NaN/inf/huge ones."""
    if rng.random() < 0.1:
        return rng.integers(0, 256, 4 * n).astype(np.uint8).view(np.float32)
    x = rng.normal(0, 1, n).astype(np.float32)
    if n and rng.random() < 0.25:
        x[rng.integers(n)] = rng.choice(SPECIALS)
    return x


def is_finish(buf):
    """Would this buffer be a well-formed FINISH (which ends the server)?"""
    if len(buf) != HEADER_BYTES:
        return False
    hdr = buf.view(np.int64)
    return hdr[0] == Op.FINISH and hdr[2] == 0 and not hdr[3] and not hdr[7]


def expect_replies(link, server, buf, out, got):
    """A served request got the replies its op asks for, of the right sizes."""
    if out[0] or out[6]:        # refused (one TAG_ERROR line) or a duplicate: Link checked
        return
    hdr = buf[:HEADER_BYTES].view(np.int64)
    op, n, flags = int(hdr[0]), int(hdr[3]), int(hdr[6])
    if op == Op.PULL:
        want = [(TAG_REPLY_SPARSE, 4 * n * DIM)] + ([(TAG_REPLY_DENSE, 4 * DENSE)] if flags & F_DENSE
                                                   else [])
    elif op == Op.STATS:
        want = [(TAG_CONTROL, 8 * STATS_LEN)]
    elif op in (Op.SHRINK, Op.BARRIER):
        want = [(TAG_CONTROL, 8)]
    elif op == Op.SAVE:
        want = [(TAG_CONTROL, len(got[0][1]) if got else -1)]
    elif op == Op.DENSE_GET:    # the server's dense slice with its optimizer state (packed)
        want = [(TAG_REPLY_DENSE, len(got[0][1]) if got and len(got[0][1]) >= 4 * DENSE else -1)]
    else:
        want = []
    check(link.failures, [(t, len(b)) for t, b in got] == want,
          f"server {server}: op {op} answered with {[(t, len(b)) for t, b in got]}, want {want}")


def check(failures, cond, what):
    return verdict_check(failures, cond, what, "wire probe")


def main():
    comm = MPI.COMM_WORLD
    save_dir, n_fuzz = sys.argv[1], int(sys.argv[2])
    failures = []

    def body():
        if comm.rank in SERVERS:
            run_server(comm, failures, save_dir)
        elif comm.rank == WORKER:
            run_worker(comm, failures, save_dir, n_fuzz)
        else:               # not a worker: a well-formed request from a stranger
            for s in SERVERS:
                comm.Send(edit(message(Op.PULL, KEYS, flags=F_CREATE), req_id=1), s, TAG_REQUEST)
    return verdict(comm, failures, "wire probe", body)


if __name__ == "__main__":
    sys.exit(main())
