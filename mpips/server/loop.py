"""The server's MPI event loop: receive, validate, dispatch to the tables, reply.

All maths lives in the tables (usable without MPI); this module only decodes requests,
applies the mode's ordering rules and sends replies.

Ordering rules per mode (steps count from 0 within a phase; a phase ends with BARRIER):
- async / geo: pushes and adds apply on arrival; pulls are answered at once.
- sync (and ssp with staleness 0): pushes of step t are held until every active worker's
  push of step t is in, then applied once from their sum (workers send gradients already
  weighted by their share of the step's examples); the training pulls of step t are held
  until every active worker's pull of step t is in and steps 0..t-1 were applied, then
  answered in worker-rank order (so admission counts are taken in a fixed order).
Dense weights: in async/sync/ssp the workers keep replicas (mpips.worker.dense_sync); the
server's dense slice is only what checkpoints hold (DENSE_PUT before a save, DENSE_GET at
start).  In geo the servers' dense slice is trained by the workers' ADDs.
- ssp: pushes apply on arrival; a pull of step t waits until every active worker has pushed
  at least t - staleness steps.
An idle server sleeps with exponential back-off (``mpips.comm.backoff.IDLE``) instead of
spinning, so that on an oversubscribed node the workers get the cores.

Failure handling (see docs/reliability.md):
- every message is probed (any tag) before it is received: requests (``TAG_REQUEST``)
  up to ``MAX_REQUEST_BYTES``, status requests (``TAG_DUMP``) of one int64; larger ones,
  and messages on any other tag, are discarded unread with a line naming the sender;
- silence is measured while the server listens: time spent on one request (a save, a
  first kernel load) does not count against the workers;
- every request is validated (header by ``decode``, then against this server's tables,
  ids and phase: ``mpips.server.checks``); a malformed one is logged naming the sender, counted, dropped and, when
  the sender is a worker, answered on ``TAG_ERROR`` with that line (the worker fails with
  it) — the tables are untouched and the server keeps serving;
- a request whose id is not above the last one served for its sender is a duplicate (a
  refused request moves nothing): counted, dropped,
  not answered again (the original was);
- a worker that holds others up (missing at a barrier, or a sync step / ssp pull waiting
  for it) and sends nothing for ``timeout`` seconds, or no request at all for
  ``idle_timeout``, fails the job with PeerTimeout;
- while a barrier waits for workers that still make progress, the waiting workers get a
  BARRIER_KEEPALIVE now and then, so that their own timeout measures silence, not length;
- before a rank raises PeerTimeout it asks every rank what it is waiting for
  (``mpips.comm.liveness.Watch``) and prints the answers; ranks that do not answer are named as
  the ones that stopped.
"""
import time

import numpy as np
from mpi4py import MPI

from mpips.comm.backoff import IDLE, Backoff
from mpips.comm.liveness import WATCH, discard, err_line, wait_for
from mpips.tables.ownership import owners
from mpips.comm.protocol import (BARRIER_KEEPALIVE, F_CREATE, F_DENSE, MAX_LINE_BYTES,
                            MAX_REQUEST_BYTES, STATS_DTYPE, TAG_CONTROL, TAG_DUMP, TAG_ERROR,
                            TAG_REPLY_DENSE, TAG_REPLY_SPARSE, TAG_REQUEST, Op, ProtocolError,
                            decode_all)
from mpips.server.checks import RequestChecks
from mpips.tables.dense import pack_state, unpack_state
from mpips.tables import push as push_rules
from mpips.config import stale_power
from mpips.tables.staleness import StalenessTracker, counts_staleness, lr_factors
from mpips.tables.tiered import tier_counters

CHECK_EVERY = 0.05  # seconds between liveness checks of an idle server
MAX_REJECT_LINES = 100  # malformed requests logged one line each; later ones only counted


class Server(RequestChecks):
    """Serves the ids this server owns (a sparse table) and a slice of the dense parameters.

    timeout: seconds a worker that holds others up may stay silent (--peer-timeout);
    idle_timeout: seconds without any request before failing (default: timeout);
    shard: (this server's index, number of servers): the ids it owns
    (``mpips.tables.ownership.owners``); requests for other ids are refused.
    stale_lr: async / ssp: each pushed row's learning rate is damped by its staleness
    (``mpips.tables.staleness``), which these modes always count (sync: 0 by construction).
    """

    def __init__(self, comm, worker_ranks, sparse, dense, mode="async", staleness=0,
                 timeout=120.0, idle_max=IDLE[1], idle_timeout=None, label="server",
                 shard=(0, 1), stale_lr="none", sync_sparse_lr="none"):
        stale_power(stale_lr)               # raises for a rule it is not
        self.comm, self.sparse, self.dense = comm, sparse, dense
        self.shard = (int(shard[0]), int(shard[1]))
        self.workers = list(worker_ranks)
        self.mode = "sync" if (mode == "ssp" and staleness == 0) else mode
        self.staleness, self.timeout, self.idle_max = staleness, timeout, idle_max
        self.idle_timeout = timeout if idle_timeout is None else idle_timeout
        self.tracker = StalenessTracker(sparse) if counts_staleness(mode, staleness) else None
        self.stale_lr = stale_lr
        self.sync_sparse_lr = sync_sparse_lr    # sync: "count" = lr x workers holding a row,
                                                # "each" = a step per worker's push
        self.recv_buf = np.empty(1 << 20, dtype=np.uint8)
        self.max_request = MAX_REQUEST_BYTES    # larger requests are discarded unread
        self.sends = []                 # (request, buffer) until complete
        self.finished = set()
        self.stats = {"requests": 0, "busy_s": 0.0, "bytes_in": 0, "bytes_out": 0}
        self.on_save = None     # callable(seq, mode_index) -> JSON bytes (checkpoint shard)
        self.save_check = None  # callable(seq, mode_index) -> None or why a SAVE is refused
        self.evicted = 0        # rows removed by SHRINK since the start
        self.max_lead = 0       # ssp: largest (pull step - slowest worker's pushes) answered
        self.rejected, self.last_reject = 0, ""
        self.duplicates = 0     # requests dropped because their id was seen before
        self.last_id = {w: 0 for w in self.workers}     # last request id per worker
        self.saved = set()      # checkpoint sequence numbers this server wrote or queued
        now = time.monotonic()
        self.last_request = now
        self.last_seen = {w: now for w in self.workers}     # last request per worker
        self.keepalive_at = now         # last BARRIER_KEEPALIVE round
        self.watch = WATCH.bind(comm, label)
        self._new_phase()
        if self.shard[1] > 1:       # load the ownership kernel now, not in a first request
            owners(np.zeros(1, np.int64), self.shard[1])

    def _new_phase(self):
        self.active = set(self.workers)     # workers that have not reached the barrier
        self.at_barrier = []
        self.version = 0                    # sync: steps applied in this phase
        self.pending = {}                   # sync: step -> {worker: (keys, grads, dense)}
        self.clock = {w: 0 for w in self.workers}   # ssp: pushes received per worker
        self.deferred = []                  # pulls waiting for their step
        self.held = {}                      # sync: step -> {worker: training pull}
        self.deferred_saves = []            # sync: (seq, mode, step, source) until step applied
        if self.tracker is not None:
            self.tracker.reset()            # steps count from 0 again

    # ---- main loop
    def run(self):
        """Serve until every worker sent FINISH."""
        backoff, next_check = Backoff(IDLE[0], self.idle_max), 0.0
        status = MPI.Status()
        self.watch.waiting(self.describe, timed=False)
        while len(self.finished) < len(self.workers):
            msg = self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                self._progress_sends()
                now = time.monotonic()
                if now >= next_check:
                    self._check(now)
                    next_check = now + CHECK_EVERY
                self.watch.poll()
                backoff.sleep()
                continue
            t0, tag = time.monotonic(), status.Get_tag()
            if tag == TAG_REQUEST:
                self._receive(msg, status)
            elif tag == TAG_DUMP:
                self.watch.answer(msg, status)
            else:
                self.watch.ignore(msg, status, "a server takes requests and status requests "
                                  "only")
            if time.monotonic() - t0 > CHECK_EVERY:     # deaf meanwhile (a save, a first
                self._excuse(time.monotonic() - t0)     # kernel load): listen again first
                next_check = time.monotonic() + CHECK_EVERY
            backoff.reset()
        self._drain_sends()

    def _excuse(self, seconds):
        """Silence is measured while this server listens: the `seconds` it just spent on
        one request (unable to receive) do not count against any worker."""
        now = time.monotonic()
        for w in self.last_seen:
            self.last_seen[w] = min(self.last_seen[w] + seconds, now)
        self.last_request = min(self.last_request + seconds, now)

    def _receive(self, msg, status):
        t0 = time.perf_counter()
        nbytes, source = status.Get_count(MPI.BYTE), status.Get_source()
        self.last_request = time.monotonic()
        if source in self.last_seen:
            self.last_seen[source] = self.last_request
        if nbytes > self.max_request:               # not even received
            discard(msg)
            self._reject(ProtocolError(f"request from rank {source}: {nbytes} bytes, over the "
                                       f"largest request ({self.max_request} bytes)"), source)
            return
        if nbytes > len(self.recv_buf):
            self.recv_buf = np.empty(min(max(nbytes, 2 * len(self.recv_buf)), self.max_request),
                                     dtype=np.uint8)
        msg.Recv([self.recv_buf, nbytes, MPI.BYTE])
        try:    # a message of several requests (F_MORE): each served in order, as if alone
            for req in decode_all(self.recv_buf, nbytes, 1, source):
                if self._fresh(req, source):
                    self._validate(req, source)
                    # only a request served moves the sender's counter: a refused one's id
                    # (2^63 - 1, say) blocks nothing after
                    if source in self.last_id:
                        self.last_id[source] = req.req_id
                    self.handle(req, source)
        except ProtocolError as e:      # the rest of its message is dropped: the sender
            self._reject(e, source)     # fails on the refusal
        self.stats["requests"] += 1
        self.stats["bytes_in"] += nbytes
        self.stats["busy_s"] += time.perf_counter() - t0

    def _fresh(self, req, source):
        """False for a duplicate: a request id not above the sender's last one served
        (counted, logged, dropped without a reply: the original was answered)."""
        last = self.last_id.get(source)
        if last is None or req.req_id > last:
            return True
        self.duplicates += 1
        self._line(self.duplicates, f"dropped a duplicate request from rank {source}: "
                   f"{req.op.name} with request id {req.req_id}, not above its last ({last}); "
                   "each request is served once")
        return False

    def _reject(self, err, source):
        """Count and log a refused request; a worker gets the line on TAG_ERROR."""
        self.rejected += 1
        self.last_reject = str(err)
        self._line(self.rejected, f"rejected malformed request, tables unchanged: {err}")
        if source in self.last_seen:
            line = np.frombuffer(str(err).encode()[:MAX_LINE_BYTES], np.uint8).copy()
            self._send(line, source, TAG_ERROR)

    def _line(self, n, text):
        """Log the n-th rejection or duplicate (the first MAX_REJECT_LINES of each kind)."""
        if n <= MAX_REJECT_LINES:
            err_line(f"mpips: rank {self.comm.rank} ({self.watch.label}): {text}")
        if n == MAX_REJECT_LINES:
            err_line(f"mpips: rank {self.comm.rank}: further ones only counted (STATS)")

    # ---- liveness
    def _check(self, now):
        """Fail if a worker holds the others up in silence; keep barrier waiters informed."""
        waiting = bool(self.at_barrier or self.deferred or self.pending or self.held)
        if waiting:
            held = {src for _, src in self.deferred} | set(self.pending.get(self.version, ()))
            held |= {src for got in self.held.values() for src in got}
            silent = [w for w in sorted(self.active - self.finished - held)
                      if now - self.last_seen[w] > self.timeout]
            if silent:
                self.watch.fail(f"server rank {self.comm.rank}: worker rank(s) {silent} sent "
                                f"nothing for {self.timeout:.0f} s (--peer-timeout) while "
                                f"others wait for them ({self._blocked_text()})")
            if self.at_barrier and now - self.keepalive_at > self.timeout / 4:
                if any(self.last_seen[w] > self.keepalive_at for w in self.active):
                    for w in self.at_barrier:
                        self._send(np.array([BARRIER_KEEPALIVE], np.int64), w, TAG_CONTROL)
                self.keepalive_at = now
        if now - self.last_request > self.idle_timeout:
            self.watch.fail(self._timeout_text())

    def _blocked_text(self):
        parts = []
        if self.at_barrier:
            parts.append(f"at the barrier: {sorted(self.at_barrier)}, not arrived: "
                         f"{sorted(self.active - self.finished)}")
        if self.pending:
            have = sorted(self.pending.get(self.version, {}))
            parts.append(f"sync step {self.version} has the pushes of {have}")
        if self.held:
            parts.append("sync PULLs held: " + ", ".join(
                f"step {s} from {sorted(got)}" for s, got in sorted(self.held.items())[:3]))
        if self.deferred:
            parts.append(f"{len(self.deferred)} PULL(s) held, steps "
                         f"{sorted({r.step for r, _ in self.deferred})[:5]}, from "
                         f"{sorted({s for _, s in self.deferred})}")
        return "; ".join(parts) or "nothing held"

    def describe(self):
        """This server's status line for a dump."""
        now = time.monotonic()
        quiet = ", ".join(f"{w}: {now - self.last_seen[w]:.1f} s"
                          for w in self.workers if w not in self.finished)
        text = (f"serving, mode {self.mode}, phase step {self.version}; "
                f"{self._blocked_text()}; silence per worker rank: {quiet or '-'}")
        if self.rejected:
            text += f"; {self.rejected} malformed request(s) rejected, last: {self.last_reject}"
        if self.duplicates:
            text += f"; {self.duplicates} duplicate request(s) dropped"
        if self.watch.ignored:
            text += f"; {self.watch.ignored} message(s) of a wrong size or tag discarded"
        return text

    def _timeout_text(self):
        waiting = sorted(set(self.workers) - self.finished)
        return (f"server rank {self.comm.rank}: worker rank(s) {waiting} sent nothing for "
                f"{self.idle_timeout:.0f} s: no request from any worker (mode {self.mode}, "
                f"step {self.version})")

    # ---- dispatch
    def handle(self, req, source):
        if req.op == Op.PULL:
            if self.mode == "sync" and req.flags & F_CREATE:
                self.held.setdefault(req.step, {})[source] = self._copy(req)
                self._after_progress()
            elif self._pull_ready(req.step):
                self._answer_pull(req, source)
            else:
                self.deferred.append((self._copy(req), source))
        elif req.op == Op.PUSH:
            self._push(req, source)
        elif req.op == Op.ADD:
            if req.count:
                self.sparse.add(req.keys, req.values)
            if req.dense is not None:
                self.dense.add(req.dense)
        elif req.op == Op.BARRIER:
            self.active.discard(source)
            self.at_barrier.append(source)
            self._after_progress()
        elif req.op == Op.FINISH:
            self.finished.add(source)
        elif req.op == Op.SAVE:
            save = (int(req.keys[0]), req.flags, req.step, source)
            self.saved.add(save[0])
            if self.mode == "sync" and req.step > self.version:
                self.deferred_saves.append(save)      # after step `req.step` is applied
            else:
                self._save(*save)
        elif req.op == Op.DENSE_PUT:
            self.dense.import_state(unpack_state(self.dense, req.dense, self.dense.size))
        elif req.op == Op.DENSE_GET:
            self._send(pack_state(self.dense, 0, self.dense.size), source, TAG_REPLY_DENSE)
        elif req.op == Op.SHRINK:
            removed = self.sparse.shrink(req.step)
            self.evicted += removed
            self._send(np.array([removed], np.int64), source, TAG_CONTROL)
        elif req.op == Op.STATS:
            self._progress_sends()
            self._send(self._stats_record().view(np.int64), source, TAG_CONTROL)

    def _stats_record(self):
        """This server's STATS reply, a STATS_DTYPE record."""
        rec = np.zeros(1, STATS_DTYPE)
        rec["rows"] = len(self.sparse)
        rec["bytes"] = self.sparse.nbytes + self.dense.nbytes
        rec["requests"] = self.stats["requests"]
        rec["busy_us"] = int(self.stats["busy_s"] * 1e6)
        rec["ssp_max_lead"] = self.max_lead
        rec["admitted"] = getattr(self.sparse, "admitted", 0)
        rec["waiting"] = self.sparse.waiting() if hasattr(self.sparse, "waiting") else 0
        rec["evicted"] = self.evicted
        rec["rejected"] = self.rejected
        rec["replies_in_flight"] = len(self.sends)
        rec["duplicates"] = self.duplicates
        for name, value in tier_counters(self.sparse).items():
            rec[name] = value
        if self.tracker is not None:
            t = self.tracker
            rec["staleness_hist"] = t.hist
            rec["staleness_sum"], rec["staleness_max"] = t.total, t.max
            rec["staleness_unmatched"] = t.unmatched
        return rec

    @staticmethod
    def _copy(req):
        req.keys = req.keys.copy()
        req.values = None if req.values is None else req.values.copy()
        req.dense = None if req.dense is None else req.dense.copy()
        return req

    def _save(self, seq, mode_index, step, source):
        text = self.on_save(seq, mode_index)
        self._send(np.frombuffer(text, dtype=np.uint8).copy(), source, TAG_CONTROL)

    def _pull_ready(self, step):
        if self.mode == "sync":
            return step <= self.version
        if self.mode == "ssp":
            slowest = min((self.clock[w] for w in self.active), default=step)
            return step - self.staleness <= slowest
        return True

    def _answer_pull(self, req, source):
        if self.mode == "ssp" and self.active:
            slowest = min(self.clock[w] for w in self.active)
            self.max_lead = max(self.max_lead, req.step - slowest)
        out = np.empty((req.count, self.sparse.dim), dtype=np.float32)
        if req.count:
            counts = None if req.values is None else req.values[:, 0]   # for admission
            rows = self.sparse.pull(req.keys, out, create=bool(req.flags & F_CREATE),
                                    counts=counts)
            if req.flags & F_CREATE and self.tracker is not None:
                self.tracker.pulled(source, req.step, req.keys, rows)
        self._send(out, source, TAG_REPLY_SPARSE)
        if req.flags & F_DENSE:
            d = np.empty(self.dense.size, dtype=np.float32)
            self.dense.pull(d)
            self._send(d, source, TAG_REPLY_DENSE)

    def _push(self, req, source):
        if self.mode != "sync":
            if req.count and self.tracker is not None:
                stale = self.tracker.pushed(source, req.step, req.keys)
                self.sparse.push(req.keys, req.values, lr_scale=lr_factors(self.stale_lr, stale))
            elif req.count:
                self.sparse.push(req.keys, req.values)
            self.clock[source] += 1
            if self.mode == "ssp":
                self._after_progress()
            return
        self.pending.setdefault(req.step, {})[source] = self._copy(req)
        self._after_progress()

    def _after_progress(self):
        """Apply complete sync steps, answer pulls that became ready, release a barrier."""
        while self.mode == "sync" and self.version in self.pending \
                and self.active <= set(self.pending[self.version]):
            self._apply_sync(self.pending.pop(self.version))
            self.version += 1
            ready = [x for x in self.deferred_saves if x[2] <= self.version]
            self.deferred_saves = [x for x in self.deferred_saves if x[2] > self.version]
            for save in ready:
                self._save(*save)
        for step in sorted(self.held):
            got = self.held[step]
            if step <= self.version and self.active <= set(got):
                del self.held[step]
                for w in sorted(got):
                    self._answer_pull(got[w], w)
        if self.deferred:
            still = []
            for req, source in self.deferred:
                if self._pull_ready(req.step):
                    self._answer_pull(req, source)
                else:
                    still.append((req, source))
            self.deferred = still
        if len(self.at_barrier) == len(self.workers) and not self.pending:
            for step in sorted(self.held):          # nothing changes any more in this phase:
                for w in sorted(self.held[step]):   # whatever is held is answered now
                    self._answer_pull(self.held[step][w], w)
            for req, source in self.deferred:
                self._answer_pull(req, source)
            for save in self.deferred_saves:
                self._save(*save)
            for w in self.at_barrier:
                self._send(np.array([self.version], np.int64), w, TAG_CONTROL)
            self._new_phase()

    def _apply_sync(self, pushes):
        """Apply this step's pushes, one part per worker in worker-rank order, by the
        --sync-sparse-lr rule (``mpips.tables.push``: summed into one update, or with
        ``each`` one update per worker's push)."""
        keyed = [(pushes[w].keys, pushes[w].values) for w in sorted(pushes) if pushes[w].count]
        for keys, grads, lr_scale in push_rules.merge(self.sync_sparse_lr, keyed):
            self.sparse.push(keys, grads, lr_scale=lr_scale)

    # ---- sends
    def _send(self, arr, dest, tag):
        self.sends.append((self.comm.Isend(arr, dest, tag), arr))
        self.stats["bytes_out"] += arr.nbytes
        self._progress_sends()

    def _progress_sends(self):
        if self.sends:
            self.sends = [(r, a) for r, a in self.sends if not r.Test()]

    def _drain_sends(self):
        self.watch.waiting(f"FINISH: {len(self.sends)} replies not yet taken by the workers")

        def drained():
            self._progress_sends()
            return not self.sends
        wait_for(drained, Backoff(*IDLE), self.timeout,
                 lambda: f"server rank {self.comm.rank}: replies not taken by the workers "
                 f"within {self.timeout:.0f} s (--peer-timeout)")
