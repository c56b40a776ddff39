"""Worker side of the PS: pull/push with non-blocking MPI.

A batch's keys come planned by ``mpips.tables.ownership.plan_keys`` (deduplicated, grouped by
owning server), so each server's rows are one contiguous slice of the pulled (u, dim)
array: replies land in place, gradients leave from place.  Every call returns a
:class:`Handle`; ``h.wait()`` polls with back-off (an oversubscribed core is left to the
ranks that compute) and fails with the rank's name when a server does not answer within
the peer timeout.
"""
import time

import numpy as np
from mpi4py import MPI

from mpips.comm.backoff import REPLY, Backoff
from mpips.comm.liveness import WATCH, discard, wait_for, wait_requests
from mpips.comm.protocol import (BARRIER_KEEPALIVE, F_CREATE, F_DENSE, F_MORE, MAX_CONFIRM_BYTES,
                            MAX_REQUEST_BYTES, STATS_DTYPE, STATS_LEN, TAG_CONTROL,
                            TAG_REPLY_DENSE, TAG_REPLY_SPARSE, TAG_REQUEST, Op, ProtocolError,
                            encode, message_nbytes)
from mpips.tables.dense import dense_fields, pack_state, packed_size, unpack_state

WORKER_GRACE = 1.0  # s a worker waits beyond --peer-timeout: a server, which knows which
                    # worker holds the others up, gets to report first


class Handle:
    """Outstanding requests of one pull/push; wait() completes them.

    peers[i] is the server rank of reqs[i]; expect[i] the bytes receive i must bring (None
    for a send; default: all sends); op and step describe the wait in a dump.
    """

    def __init__(self, client, reqs, peers, bufs, op="", step=0, expect=None):
        self.client, self.reqs, self.peers, self.bufs = client, reqs, peers, bufs
        self.op, self.step = op, step
        self.expect = expect
        self.done = False

    def pending(self):
        """Server ranks with an incomplete request."""
        return sorted({p for r, p in zip(self.reqs, self.peers) if not r.Test()})

    def describe(self):
        return f"{self.op} step {self.step}: waiting for server rank(s) {self.pending()}"

    def wait(self):
        if not self.done:
            t0 = time.perf_counter()
            statuses = []
            try:
                wait_requests(self.reqs, self.client.timeout, self.describe, statuses=statuses)
            except MPI.Exception as e:      # a reply longer than its receive, or a lost peer
                raise self._failure(e, statuses) from None
            if self.expect:
                self._check_sizes(statuses)
            self.client.free.extend(self.bufs)
            self.client.wait_s += time.perf_counter() - t0
            self.done = True
        return self

    def _failure(self, e, statuses):
        """A ProtocolError naming the server rank(s) whose requests failed, and how: a
        reply that does not fit its receive, or a request MPI could not complete (the
        server is gone)."""
        failed = {}
        for peer, st in zip(self.peers, statuses):
            code = st.Get_error()
            if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
                failed.setdefault(MPI.Get_error_class(code), set()).add(peer)
        first = str(e).splitlines()[0]
        if MPI.ERR_TRUNCATE in failed:
            return ProtocolError(f"{self.op} step {self.step}: a reply from server rank(s) "
                                 f"{sorted(failed[MPI.ERR_TRUNCATE])} does not fit what was "
                                 f"asked ({first})")
        lost = sorted(set().union(*failed.values())) if failed else sorted(set(self.peers))
        why = MPI.Get_error_string(next(iter(failed))) if failed else first
        return ProtocolError(f"{self.op} step {self.step}: MPI could not complete the "
                             f"request(s) of server rank(s) {lost} ({why}): a server that "
                             f"died, or a lost connection")

    def _check_sizes(self, statuses):
        for want, peer, st in zip(self.expect, self.peers, statuses):
            if want is not None and st.Get_count(MPI.BYTE) != want:
                raise ProtocolError(f"{self.op} step {self.step}: server rank {peer} replied "
                                    f"{st.Get_count(MPI.BYTE)} bytes on tag {st.Get_tag()}; "
                                    f"the request asked for {want}")


class PSClient:
    """Pull/push against the servers of `server_ranks` (world ranks in server-id order)."""

    def __init__(self, comm, server_ranks, dim, dense_bounds, timeout=120.0, label="worker"):
        self.comm, self.servers, self.dim = comm, list(server_ranks), dim
        WATCH.bind(comm, label)
        WATCH.listen(self.servers)          # a refused request raises RequestRefused
        self.bounds, self.timeout = dense_bounds, timeout + WORKER_GRACE
        self.free = []            # reusable send buffers (uint8)
        self.req_id = 0
        self.wait_s = 0.0
        self.bytes_sent = 0
        self.bytes_recv = 0       # replies posted for (pull rows, dense slices, control)
        self.messages = 0

    @property
    def n_servers(self):
        return len(self.servers)

    def _buffer(self, nbytes):
        for i, b in enumerate(self.free):
            if len(b) >= nbytes:
                return self.free.pop(i)
        return np.empty(max(nbytes, 1 << 16), dtype=np.uint8)

    def _request(self, s, op, keys, values, step, flags, dense):
        """Encode and Isend one request to server s; return (request, buffer)."""
        return self._send(s, [(op, keys, values, step, flags, dense)])

    def _send(self, s, parts):
        """Encode the requests ``parts`` [(op, keys, values, step, flags, dense)] as one
        message (each but the last flagged ``F_MORE``) and Isend it to server s; return
        (request, buffer)."""
        sizes = [message_nbytes(len(keys), 0 if values is None else values.shape[1],
                                0 if dense is None else len(dense))
                 for _, keys, values, _, _, dense in parts]
        nbytes = sum(sizes)
        if nbytes > MAX_REQUEST_BYTES:
            op, keys = parts[0][0], parts[0][1]
            raise ValueError(f"a {Op(op).name} of {len(keys)} ids is {nbytes} bytes, over the "
                             f"largest request servers take ({MAX_REQUEST_BYTES}); lower "
                             "--batch-size or --embedding-dim, or run more --servers")
        buf = self._buffer(nbytes)
        off = 0
        for i, ((op, keys, values, step, flags, dense), size) in enumerate(zip(parts, sizes)):
            self.req_id += 1
            more = F_MORE if i + 1 < len(parts) else 0
            encode(buf[off:off + size], op, self.req_id, 0, keys, values, step, flags | more,
                   dense)
            off += size
        self.bytes_sent += nbytes
        self.messages += parts[0][0] in (Op.PULL, Op.PUSH, Op.ADD)  # data messages, not control
        return self.comm.Isend([buf, nbytes, MPI.BYTE], self.servers[s], TAG_REQUEST), buf

    def pull(self, plan, out, dense_out=None, step=0, create=True, counts=None, worker=0):
        """Fill out (u, dim) with the rows of plan.keys, and dense_out (P,) if given.

        counts: float32 (u, 1) occurrences of each key in the batch, for admission.
        worker: ignored (the servers know the sender; see ParamStore).
        """
        reqs, peers, bufs, expect = [], [], [], []
        flags = (F_CREATE if create else 0) | (F_DENSE if dense_out is not None else 0)
        for s in range(self.n_servers):
            lo, hi = plan.offsets[s], plan.offsets[s + 1]
            self._irecv(reqs, expect, out[lo:hi], self.servers[s], TAG_REPLY_SPARSE)
            if dense_out is not None:
                d = dense_out[self.bounds[s]:self.bounds[s + 1]]
                self._irecv(reqs, expect, d, self.servers[s], TAG_REPLY_DENSE)
            c = None if counts is None else counts[lo:hi]
            r, b = self._request(s, Op.PULL, plan.keys[lo:hi], c, step, flags, None)
            reqs.append(r)
            expect.append(None)
            bufs.append(b)
            peers += [self.servers[s]] * (len(reqs) - len(peers))
        return Handle(self, reqs, peers, bufs, "PULL", step, expect)

    def _irecv(self, reqs, expect, buf, src, tag):
        """Post a receive of exactly buf.nbytes from server rank src (checked in wait())."""
        reqs.append(self.comm.Irecv(buf, src, tag))
        expect.append(buf.nbytes)
        self.bytes_recv += buf.nbytes

    def push_pull(self, push_plan, grads, pull_plan, out, step, counts=None):
        """push(push_plan, grads, step=step) and pull(pull_plan, out, step=step + 1,
        counts=counts) in one message a server, the push first (a server applies it before
        it answers the pull, as if they came one after the other): one handle for both."""
        reqs, peers, bufs, expect = [], [], [], []
        for s in range(self.n_servers):
            lo, hi = push_plan.offsets[s], push_plan.offsets[s + 1]
            push = (Op.PUSH, push_plan.keys[lo:hi], grads[lo:hi], step, 0, None)
            lo, hi = pull_plan.offsets[s], pull_plan.offsets[s + 1]
            self._irecv(reqs, expect, out[lo:hi], self.servers[s], TAG_REPLY_SPARSE)
            c = None if counts is None else counts[lo:hi]
            r, b = self._send(s, [push, (Op.PULL, pull_plan.keys[lo:hi], c, step + 1,
                                         F_CREATE, None)])
            reqs.append(r)
            expect.append(None)
            bufs.append(b)
            peers += [self.servers[s]] * 2
        return Handle(self, reqs, peers, bufs, "PUSH+PULL", step, expect)

    def push(self, plan, grads, dense_grad=None, step=0, op=Op.PUSH, worker=0, lr_scale=None):
        """Send grads (u, dim) for plan.keys (and dense_grad (P,)); op=ADD sends GEO deltas.
        worker: ignored, as in pull; lr_scale: the servers decide it (sync: by the workers'
        pushes), so a worker never sends one."""
        if lr_scale is not None:
            raise ValueError("PSClient.push: the servers set the rows' lr factors; got lr_scale")
        reqs, bufs = [], []
        flags = F_DENSE if dense_grad is not None else 0
        for s in range(self.n_servers):
            lo, hi = plan.offsets[s], plan.offsets[s + 1]
            d = None if dense_grad is None else dense_grad[self.bounds[s]:self.bounds[s + 1]]
            r, b = self._request(s, op, plan.keys[lo:hi], grads[lo:hi], step, flags, d)
            reqs.append(r)
            bufs.append(b)
        return Handle(self, reqs, self.servers, bufs, Op(op).name, step)

    def dense_put(self, table):
        """Hand every server its slice of the dense replica `table` (a DenseTable of all
        the dense weights) with its optimizer state, for the checkpoint that follows."""
        empty = np.empty(0, np.int64)
        sent = [self._request(s, Op.DENSE_PUT, empty, None, 0, 0,
                              pack_state(table, self.bounds[s], self.bounds[s + 1]))
                for s in range(self.n_servers)]
        Handle(self, [r for r, _ in sent], list(self.servers), [b for _, b in sent],
               "DENSE_PUT").wait()

    def dense_get(self, table):
        """Load the servers' dense slices and their optimizer state into `table` (a
        DenseTable of all the dense weights): a worker's replica at the start."""
        bounds = self.bounds
        bufs = [np.empty(packed_size(table, bounds[s + 1] - bounds[s]), np.float32)
                for s in range(self.n_servers)]
        reqs, expect = [], []
        for b, srv in zip(bufs, self.servers):
            self._irecv(reqs, expect, b, srv, TAG_REPLY_DENSE)
        sent, peers, sbufs = self._send_all(Op.DENSE_GET)
        Handle(self, reqs + sent, self.servers + peers, sbufs, "DENSE_GET",
               expect=expect + [None] * len(sent)).wait()
        parts = [unpack_state(table, b, bounds[s + 1] - bounds[s]) for s, b in enumerate(bufs)]
        state = {}
        for name, per_el in dense_fields(table):    # values, state, the average if kept
            state[name] = (np.concatenate([p[name] for p in parts]) if per_el else
                           parts[0][name])  # per-table state (Adam's beta powers): every
                                            # slice took the same number of steps
        try:
            table.import_state(state)       # checks the optimizer's invariants
        except ValueError as e:
            raise ProtocolError(f"DENSE_GET: the servers' dense state {self.servers}: {e}") from None

    def _send_all(self, op, step=0, flags=0):
        """Send a bodyless op to every server: (requests, their server ranks, buffers)."""
        empty = np.empty(0, np.int64)
        sent = [self._request(s, op, empty, None, step, flags, None)
                for s in range(self.n_servers)]
        return [r for r, _ in sent], list(self.servers), [b for _, b in sent]

    def control(self, op):
        """Send a bodyless op to every server (FINISH)."""
        Handle(self, *self._send_all(op), Op(op).name).wait()

    def barrier(self):
        """Phase boundary: returns once every worker's earlier requests were applied.

        A server answers BARRIER_KEEPALIVE while the missing workers still progress, so
        the wait fails only after --peer-timeout seconds without any word from a server.
        """
        acks = np.zeros((self.n_servers, 1), np.int64)
        recvs = {s: self.comm.Irecv(acks[s], srv, TAG_CONTROL)
                 for s, srv in enumerate(self.servers)}
        Handle(self, *self._send_all(Op.BARRIER), "BARRIER").wait()
        heard = dict.fromkeys(recvs, time.monotonic())
        waiting = lambda: ("BARRIER: waiting for server rank(s) "  # noqa: E731
                           f"{[self.servers[s] for s in sorted(recvs)]} to release it")
        WATCH.waiting(waiting)

        status = MPI.Status()

        def released():
            now = time.monotonic()
            for s, r in list(recvs.items()):
                if not r.Test(status):
                    continue
                self._check_ack(s, status, acks[s, 0])
                self.bytes_recv += acks[s].nbytes
                if acks[s, 0] == BARRIER_KEEPALIVE:     # the other workers still progress
                    recvs[s] = self.comm.Irecv(acks[s], self.servers[s], TAG_CONTROL)
                    heard[s] = now
                else:
                    del recvs[s]
            return not recvs
        wait_for(released, Backoff(*REPLY), self.timeout,
                 lambda: f"no word within {self.timeout:.0f} s: {waiting()}",
                 since=lambda: min(heard[s] for s in recvs))

    def _check_ack(self, s, status, value):
        """A barrier reply is one int64: BARRIER_KEEPALIVE or the phase's step count."""
        n = status.Get_count(MPI.BYTE)
        if n != 8 or value < BARRIER_KEEPALIVE:
            raise ProtocolError(f"BARRIER: server rank {self.servers[s]} replied {n} bytes "
                                f"(value {value}); a barrier reply is one int64 >= -1")

    def _ask(self, op, width, step=0):
        """Send a bodyless op to every server and collect int64[width] replies (S, width)."""
        out = np.zeros((self.n_servers, width), np.int64)
        reqs, expect = [], []
        for s, srv in enumerate(self.servers):
            self._irecv(reqs, expect, out[s], srv, TAG_CONTROL)
        sent, peers, bufs = self._send_all(op, step)
        Handle(self, reqs + sent, self.servers + peers, bufs, Op(op).name, step,
               expect + [None] * len(sent)).wait()
        return out

    def stats(self):
        """One STATS_DTYPE record per server (S,): read fields by name, e.g. ``st["rows"]``."""
        return self._ask(Op.STATS, STATS_LEN).view(STATS_DTYPE).reshape(self.n_servers)

    def shrink(self, threshold):
        """Every server ages and evicts its rows; returns the rows removed in all."""
        return int(self._ask(Op.SHRINK, 1, step=threshold).sum())

    def save(self, seq, mode_index, step=0):
        """Ask every server to write its shard of checkpoint `seq`; return their JSON replies.

        A consistent snapshot: after barrier() (step 0), or mid-phase in sync mode with
        `step` = steps done, which servers apply first.  Each server must confirm within
        --peer-timeout (which must exceed a shard's write time).
        """
        key = np.array([seq], np.int64)
        sent = [self._request(s, Op.SAVE, key, None, step, mode_index, None)
                for s in range(self.n_servers)]
        Handle(self, [r for r, _ in sent], list(self.servers), [b for _, b in sent],
               "SAVE", seq).wait()
        return [self._confirmation(srv, seq) for srv in self.servers]

    def _confirmation(self, srv, seq):
        """The JSON reply of server rank `srv` to SAVE `seq` (a message of unknown size,
        probed before it is received: at most MAX_CONFIRM_BYTES)."""
        status = MPI.Status()
        WATCH.waiting(f"SAVE checkpoint {seq}: waiting for server rank {srv} to confirm")
        msg = [None]

        def arrived():
            msg[0] = self.comm.Improbe(srv, TAG_CONTROL, status)
            return msg[0] is not None
        wait_for(arrived, Backoff(*REPLY), self.timeout, lambda: f"server rank {srv} did not "
                 f"confirm its checkpoint shard within {self.timeout:.0f} s")
        n = status.Get_count(MPI.BYTE)
        if n > MAX_CONFIRM_BYTES:
            discard(msg[0])
            raise ProtocolError(f"SAVE checkpoint {seq}: server rank {srv} confirmed with {n} "
                                f"bytes, over {MAX_CONFIRM_BYTES}")
        buf = np.empty(n, np.uint8)
        msg[0].Recv([buf, n, MPI.BYTE])
        self.bytes_recv += buf.nbytes
        return bytes(buf)
