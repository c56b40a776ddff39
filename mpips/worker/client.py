"""Worker side of the PS: plan a batch's keys per server, pull/push with non-blocking MPI.

``plan_keys`` dedups a batch's ids and orders the unique keys by owning server, so that
each server's rows are one contiguous slice of the pulled (u, dim) array: replies land in
place, gradients leave from place.  Every call returns a :class:`Handle`; ``h.wait()``
polls with back-off (an oversubscribed core is left to the ranks that compute) and fails
with the rank's name when a server does not answer within the peer timeout.
"""
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpips.kernels.embedding import unique_inverse
from mpips.protocol import (F_CREATE, F_DENSE, STATS_LEN, TAG_CONTROL, TAG_REPLY_DENSE, TAG_REPLY_SPARSE,
                            TAG_REQUEST, Op, encode, message_nbytes)
from mpips.server.loop import PeerTimeout
from mpips.sharding import owners

WAIT_MIN = 1e-5     # first poll sleep (s) while waiting for a reply
WAIT_MAX = 2e-4     # longest poll sleep (s)


@dataclass
class KeyPlan:
    """A batch's unique keys grouped by server."""
    keys: np.ndarray      # int64 (u,): unique keys, grouped by server, sorted within a group
    inverse: np.ndarray   # int64 (n,): position in `keys` of each original id
    offsets: np.ndarray   # int64 (S+1,): server s owns keys[offsets[s]:offsets[s+1]]


def plan_keys(ids, n_servers):
    """Dedup ids (any shape, int64) and group the unique keys by owning server."""
    ukeys, inverse = unique_inverse(ids.reshape(-1))
    if n_servers == 1:
        return KeyPlan(ukeys, inverse, np.array([0, len(ukeys)], np.int64))
    own = owners(ukeys, n_servers)
    order = np.argsort(own, kind="stable")
    rank_of = np.empty_like(order)
    rank_of[order] = np.arange(len(order))
    counts = np.bincount(own, minlength=n_servers)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return KeyPlan(ukeys[order], rank_of[inverse], offsets)


def wait_requests(reqs, timeout, what):
    """Wait for all MPI requests, sleeping between polls; PeerTimeout names `what`."""
    if not reqs or MPI.Request.Testall(reqs):
        return
    delay, t0 = WAIT_MIN, time.monotonic()
    while not MPI.Request.Testall(reqs):
        if time.monotonic() - t0 > timeout:
            raise PeerTimeout(f"no answer from {what} within {timeout:.0f} s (--peer-timeout)")
        time.sleep(delay)
        delay = min(2 * delay, WAIT_MAX)


class Handle:
    """Outstanding requests of one pull/push; wait() completes them."""

    def __init__(self, client, reqs, servers, bufs):
        self.client, self.reqs, self.servers, self.bufs = client, reqs, servers, bufs
        self.done = False

    def wait(self):
        if not self.done:
            t0 = time.perf_counter()
            what = "server rank(s) " + ",".join(str(s) for s in sorted(set(self.servers)))
            wait_requests(self.reqs, self.client.timeout, what)
            self.client.free.extend(self.bufs)
            self.client.wait_s += time.perf_counter() - t0
            self.done = True
        return self


class PSClient:
    """Pull/push against the servers of `server_ranks` (world ranks in shard order)."""

    def __init__(self, comm, server_ranks, dim, dense_bounds, timeout=120.0):
        self.comm, self.servers, self.dim = comm, list(server_ranks), dim
        self.bounds, self.timeout = dense_bounds, timeout
        self.free = []            # reusable send buffers (uint8)
        self.req_id = 0
        self.wait_s = 0.0
        self.bytes_sent = 0
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
        n_dense = 0 if dense is None else len(dense)
        nbytes = message_nbytes(len(keys), 0 if values is None else values.shape[1], n_dense)
        buf = self._buffer(nbytes)
        self.req_id += 1
        encode(buf, op, self.req_id, 0, keys, values, step, flags, dense)
        self.bytes_sent += nbytes
        self.messages += op in (Op.PULL, Op.PUSH, Op.ADD)   # data requests, not control
        return self.comm.Isend([buf, nbytes, MPI.BYTE], self.servers[s], TAG_REQUEST), buf

    def pull(self, plan, out, dense_out=None, step=0, create=True, counts=None):
        """Fill out (u, dim) with the rows of plan.keys, and dense_out (P,) if given.

        counts: float32 (u, 1) occurrences of each key in the batch, for admission.
        """
        reqs, bufs = [], []
        flags = (F_CREATE if create else 0) | (F_DENSE if dense_out is not None else 0)
        for s in range(self.n_servers):
            lo, hi = plan.offsets[s], plan.offsets[s + 1]
            reqs.append(self.comm.Irecv(out[lo:hi], self.servers[s], TAG_REPLY_SPARSE))
            if dense_out is not None:
                d = dense_out[self.bounds[s]:self.bounds[s + 1]]
                reqs.append(self.comm.Irecv(d, self.servers[s], TAG_REPLY_DENSE))
            c = None if counts is None else counts[lo:hi]
            r, b = self._request(s, Op.PULL, plan.keys[lo:hi], c, step, flags, None)
            reqs.append(r)
            bufs.append(b)
        return Handle(self, reqs, self.servers, bufs)

    def push(self, plan, grads, dense_grad=None, step=0, op=Op.PUSH):
        """Send grads (u, dim) for plan.keys (and dense_grad (P,)); op=ADD sends GEO deltas."""
        reqs, bufs = [], []
        flags = F_DENSE if dense_grad is not None else 0
        for s in range(self.n_servers):
            lo, hi = plan.offsets[s], plan.offsets[s + 1]
            d = None if dense_grad is None else dense_grad[self.bounds[s]:self.bounds[s + 1]]
            r, b = self._request(s, op, plan.keys[lo:hi], grads[lo:hi], step, flags, d)
            reqs.append(r)
            bufs.append(b)
        return Handle(self, reqs, self.servers, bufs)

    def control(self, op):
        """Send a bodyless op to every server (FINISH)."""
        empty = np.empty(0, np.int64)
        out = [self._request(s, op, empty, None, 0, 0, None) for s in range(self.n_servers)]
        Handle(self, [r for r, _ in out], self.servers, [b for _, b in out]).wait()

    def barrier(self):
        """Phase boundary: returns once every worker's earlier requests were applied."""
        acks = [np.zeros(1, np.int64) for _ in self.servers]
        reqs = [self.comm.Irecv(a, srv, TAG_CONTROL) for a, srv in zip(acks, self.servers)]
        empty = np.empty(0, np.int64)
        sent = [self._request(s, Op.BARRIER, empty, None, 0, 0, None)
                for s in range(self.n_servers)]
        Handle(self, reqs + [r for r, _ in sent], self.servers, [b for _, b in sent]).wait()

    def _ask(self, op, width, step=0):
        """Send a bodyless op to every server and collect int64[width] replies (S, width)."""
        out = np.zeros((self.n_servers, width), np.int64)
        reqs = [self.comm.Irecv(out[s], srv, TAG_CONTROL) for s, srv in enumerate(self.servers)]
        empty = np.empty(0, np.int64)
        sent = [self._request(s, op, empty, None, step, 0, None) for s in range(self.n_servers)]
        Handle(self, reqs + [r for r, _ in sent], self.servers, [b for _, b in sent]).wait()
        return out

    def stats(self):
        """Per server int64 (S, STATS_LEN), the fields listed at Op.STATS."""
        return self._ask(Op.STATS, STATS_LEN)

    def shrink(self, threshold):
        """Every server ages and evicts its rows; returns the rows removed in all."""
        return int(self._ask(Op.SHRINK, 1, step=threshold).sum())

    def save(self, seq, mode_index):
        """Ask every server to write its shard of checkpoint `seq`; return their JSON replies.

        Call after barrier() so that the shards are one consistent snapshot.
        """
        empty = np.empty(0, np.int64)
        sent = [self._request(s, Op.SAVE, empty, None, seq, mode_index, None)
                for s in range(self.n_servers)]
        Handle(self, [r for r, _ in sent], self.servers, [b for _, b in sent]).wait()
        out = []
        for srv in self.servers:
            status = MPI.Status()
            t0 = time.monotonic()
            while not self.comm.Iprobe(srv, TAG_CONTROL, status):
                if time.monotonic() - t0 > self.timeout:
                    raise PeerTimeout(f"server rank {srv} did not confirm its checkpoint shard "
                                      f"within {self.timeout:.0f} s")
                time.sleep(WAIT_MAX)
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            self.comm.Recv(buf, srv, TAG_CONTROL)
            out.append(bytes(buf))
        return out
