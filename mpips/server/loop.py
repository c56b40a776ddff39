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
An idle server sleeps with exponential back-off (``mpips.backoff.IDLE``) instead of
spinning, so that on an oversubscribed node the workers get the cores.

Failure handling (see docs/reliability.md):
- every request is validated (header by ``decode``, then against this server's tables and
  phase); a malformed one is logged naming the sender, counted, and dropped — the tables
  are untouched and the server keeps serving;
- a worker that holds others up (missing at a barrier, or a sync step / ssp pull waiting
  for it) and sends nothing for ``timeout`` seconds, or no request at all for
  ``idle_timeout``, fails the job with PeerTimeout;
- while a barrier waits for workers that still make progress, the waiting workers get a
  BARRIER_KEEPALIVE now and then, so that their own timeout measures silence, not length;
- before a rank raises PeerTimeout it asks every rank what it is waiting for
  (``mpips.liveness.Watch``) and prints the answers; ranks that do not answer are named as
  the ones that stopped.
"""
import time

import numpy as np
from mpi4py import MPI

from mpips.backoff import IDLE, Backoff
from mpips.config import SAVE_MODES
from mpips.kernels.embedding import sum_duplicates
from mpips.server.dense_table import pack_state, packed_size, unpack_state
from mpips.liveness import WATCH, err_line, wait_for
from mpips.protocol import (BARRIER_KEEPALIVE, F_CREATE, F_DENSE, STATS_DTYPE, TAG_CONTROL,
                            TAG_REPLY_DENSE, TAG_REPLY_SPARSE, TAG_REQUEST, Op, ProtocolError,
                            decode)

CHECK_EVERY = 0.05  # seconds between liveness checks of an idle server
MAX_REJECT_LINES = 100  # malformed requests logged one line each; later ones only counted
MAX_SHRINK_THRESHOLD = np.iinfo(np.uint16).max - 1   # rows age in a uint16 counter
MAX_COUNT = 2.0 ** 24   # largest occurrence count per id in one pull (float32 integers)
MAX_ABS = 1e15          # largest |gradient| or |delta| accepted: squares stay finite in float32
CONTROL_OPS = (Op.FINISH, Op.STATS, Op.BARRIER, Op.SAVE, Op.SHRINK, Op.DENSE_GET)


class Server:
    """Serves the ids this server owns (a sparse table) and a slice of the dense parameters.

    timeout: seconds a worker that holds others up may stay silent (--peer-timeout);
    idle_timeout: seconds without any request before failing (default: timeout).
    """

    def __init__(self, comm, worker_ranks, sparse, dense, mode="async", staleness=0,
                 timeout=120.0, idle_max=IDLE[1], idle_timeout=None, label="server"):
        self.comm, self.sparse, self.dense = comm, sparse, dense
        self.workers = list(worker_ranks)
        self.mode = "sync" if (mode == "ssp" and staleness == 0) else mode
        self.staleness, self.timeout, self.idle_max = staleness, timeout, idle_max
        self.idle_timeout = timeout if idle_timeout is None else idle_timeout
        self.recv_buf = np.empty(1 << 20, dtype=np.uint8)
        self.sends = []                 # (request, buffer) until complete
        self.finished = set()
        self.stats = {"requests": 0, "busy_s": 0.0, "bytes_in": 0, "bytes_out": 0}
        self.on_save = None     # callable(seq, mode_index) -> JSON bytes (checkpoint shard)
        self.save_check = None  # callable(seq, mode_index) -> None or why a SAVE is refused
        self.evicted = 0        # rows removed by SHRINK since the start
        self.max_lead = 0       # ssp: largest (pull step - slowest worker's pushes) answered
        self.rejected, self.last_reject = 0, ""
        now = time.monotonic()
        self.last_request = now
        self.last_seen = {w: now for w in self.workers}     # last request per worker
        self.keepalive_at = now         # last BARRIER_KEEPALIVE round
        self.watch = WATCH.bind(comm, label)
        self._new_phase()

    def _new_phase(self):
        self.active = set(self.workers)     # workers that have not reached the barrier
        self.at_barrier = []
        self.version = 0                    # sync: steps applied in this phase
        self.pending = {}                   # sync: step -> {worker: (keys, grads, dense)}
        self.clock = {w: 0 for w in self.workers}   # ssp: pushes received per worker
        self.deferred = []                  # pulls waiting for their step
        self.held = {}                      # sync: step -> {worker: training pull}
        self.deferred_saves = []            # sync: (seq, mode, step, source) until step applied

    # ---- main loop
    def run(self):
        """Serve until every worker sent FINISH."""
        backoff, next_check = Backoff(IDLE[0], self.idle_max), 0.0
        status = MPI.Status()
        self.watch.waiting(self.describe, timed=False)
        while len(self.finished) < len(self.workers):
            msg = self.comm.Improbe(MPI.ANY_SOURCE, TAG_REQUEST, status)
            if msg is None:
                self._progress_sends()
                now = time.monotonic()
                if now >= next_check:
                    self._check(now)
                    next_check = now + CHECK_EVERY
                self.watch.poll()
                backoff.sleep()
                continue
            self._receive(msg, status)
            backoff.reset()
        self._drain_sends()

    def _receive(self, msg, status):
        t0 = time.perf_counter()
        nbytes, source = status.Get_count(MPI.BYTE), status.Get_source()
        if nbytes > len(self.recv_buf):
            self.recv_buf = np.empty(max(nbytes, 2 * len(self.recv_buf)), dtype=np.uint8)
        msg.Recv([self.recv_buf, nbytes, MPI.BYTE])
        self.last_request = time.monotonic()
        if source in self.last_seen:
            self.last_seen[source] = self.last_request
        try:
            req = decode(self.recv_buf, nbytes, 1, source)
            self._validate(req, source)
        except ProtocolError as e:
            self._reject(e)
        else:
            self.handle(req, source)
        self.stats["requests"] += 1
        self.stats["bytes_in"] += nbytes
        self.stats["busy_s"] += time.perf_counter() - t0

    # ---- validation: a bad request is dropped before it touches a table
    def _validate(self, req, source):
        def bad(why):
            raise ProtocolError(f"request from rank {source}: {req.op.name} {why}")
        if source not in self.last_seen:
            bad(f"from a rank that is not a worker of this job (workers: {self.workers})")
        if req.op in (Op.PULL, Op.PUSH, Op.ADD, Op.SAVE):
            self._validate_step(req, source, bad)
        if req.op == Op.SAVE:
            if self.on_save is None:
                bad("but this run has no --save-dir")
            if req.count != 1 or req.values is not None or req.dense is not None:
                bad("must carry exactly one key (the checkpoint's sequence number)")
            if not 0 <= req.flags < len(SAVE_MODES):
                bad(f"mode flag {req.flags}: must be 0..{len(SAVE_MODES) - 1} ({', '.join(SAVE_MODES)})")
            why = self.save_check(int(req.keys[0]), req.flags) if self.save_check else None
            if why:
                bad(why)
        elif req.op in CONTROL_OPS:
            if req.count or req.dense is not None:
                bad(f"must have no body; got count={req.count} dense="
                    f"{len(req.dense) if req.dense is not None else 0}")
            if req.op == Op.BARRIER and source not in self.active:
                bad("sent twice in one phase")
            if req.op == Op.SHRINK and not 0 <= req.step <= MAX_SHRINK_THRESHOLD:
                bad(f"threshold {req.step}: must be 0..{MAX_SHRINK_THRESHOLD} (shrink calls)")
        elif req.op == Op.DENSE_PUT:
            if self.mode == "geo":
                bad("in geo mode (the servers train the dense weights there)")
            want = packed_size(self.dense.opt, self.dense.size)
            if req.count or req.dense is None or len(req.dense) != want:
                bad(f"must carry no keys and {want} dense floats (values + optimizer state "
                    f"of this server's slice); got count={req.count} dense="
                    f"{0 if req.dense is None else len(req.dense)}")
            if not np.isfinite(req.dense.sum()):
                bad("non-finite dense values")
        elif req.op == Op.PULL:
            if req.dense is not None or (req.values is not None and req.dim != 1):
                bad(f"may carry only occurrence counts (width 1); got dim={req.dim} "
                    f"dense={0 if req.dense is None else len(req.dense)}")
            if self.mode == "sync" and req.flags & F_CREATE and req.step < self.version:
                bad(f"for step {req.step}, already applied (phase at step {self.version}): "
                    "a training pull would be held for good")
            if req.values is not None and req.count:
                c = req.values[:, 0]
                if not (0 <= c.min() <= c.max() <= MAX_COUNT and (c == np.floor(c)).all()):
                    bad(f"occurrence counts must be whole numbers in 0..{MAX_COUNT:.0f}; got "
                        f"min {c.min()} max {c.max()}")
        else:                                   # PUSH, ADD
            if req.count and req.dim != self.sparse.dim:
                bad(f"rows of width {req.dim}; this table has dim {self.sparse.dim}")
            if req.dense is not None and req.op == Op.PUSH:
                bad("carrying dense gradients: the workers combine those among themselves")
            if req.dense is not None and len(req.dense) != self.dense.size:
                bad(f"a dense slice of {len(req.dense)}; this server holds {self.dense.size}")
            for arr in (req.values, req.dense):     # (min/max propagate NaN: no pass of abs)
                if arr is not None and arr.size and not -MAX_ABS <= arr.min() <= arr.max() <= MAX_ABS:
                    bad(f"non-finite or huge values (NaN, inf or beyond {MAX_ABS:.0e}): they would "
                        "poison the rows for good")
            if req.op == Op.PUSH and self.mode == "sync":
                if source not in self.active:
                    bad(f"for step {req.step} after this worker's BARRIER (phase step {self.version})")
                if source in self.pending.get(req.step, ()):
                    bad(f"for step {req.step} twice")

    def _validate_step(self, req, source, bad):
        """Steps of a phase: never negative, and never so far ahead that the request would
        wait for a step its own sender has not pushed (it would be parked for good)."""
        if req.step < 0:
            bad(f"for step {req.step}: steps are >= 0")
        if self.mode == "sync":
            # A push of step t comes after the sender's pull of step t was answered: t is the
            # step being collected.  A pull/save of step t+1 may come once the sender's push
            # of step t is in (or the sender is at the barrier); anything later waits for good.
            v, mine = self.version, source not in self.active or source in self.pending.get(
                self.version, ())
            if req.op == Op.PUSH and req.step != v:
                bad(f"for step {req.step}: the phase collects step {v}"
                    + (" (already applied)" if req.step < v else ""))
            if req.op in (Op.PULL, Op.SAVE) and req.step > v + mine:
                bad(f"for step {req.step}: the phase is at step {v} and this worker has "
                    f"{'pushed' if mine else 'not pushed'} it; it would wait for good")
        elif self.mode == "ssp" and req.op == Op.PULL and source in self.active:
            # waits until the slowest worker has pushed step - staleness; the sender itself
            # must not be that one for good
            if req.step - self.staleness > self.clock[source]:
                bad(f"for step {req.step}: this worker pushed {self.clock[source]} steps "
                    f"(staleness {self.staleness}); it would wait for itself for good")

    def _reject(self, err):
        self.rejected += 1
        self.last_reject = str(err)
        if self.rejected <= MAX_REJECT_LINES:
            err_line(f"mpips: rank {self.comm.rank} ({self.watch.label}): rejected malformed "
                     f"request, tables unchanged: {err}")
        if self.rejected == MAX_REJECT_LINES:
            err_line(f"mpips: rank {self.comm.rank}: further rejections only counted (STATS)")

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
            if self.mode == "sync" and req.step > self.version:
                self.deferred_saves.append(save)      # after step `req.step` is applied
            else:
                self._save(*save)
        elif req.op == Op.DENSE_PUT:
            self.dense.import_state(unpack_state(self.dense.opt, req.dense, self.dense.size))
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
        if req.count and req.values is not None:       # occurrence counts for admission
            self.sparse.pull(req.keys, out, create=bool(req.flags & F_CREATE),
                             counts=req.values[:, 0])
        elif req.count:
            self.sparse.pull(req.keys, out, create=bool(req.flags & F_CREATE))
        self._send(out, source, TAG_REPLY_SPARSE)
        if req.flags & F_DENSE:
            d = np.empty(self.dense.size, dtype=np.float32)
            self.dense.pull(d)
            self._send(d, source, TAG_REPLY_DENSE)

    def _push(self, req, source):
        if self.mode != "sync":
            if req.count:
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
            for req, source in self.deferred:       # nothing changes any more in this phase
                self._answer_pull(req, source)
            for save in self.deferred_saves:
                self._save(*save)
            for w in self.at_barrier:
                self._send(np.array([self.version], np.int64), w, TAG_CONTROL)
            self._new_phase()

    def _apply_sync(self, pushes):
        """One update from the sum of the workers' gradients of this step, taken in
        worker-rank order (each worker scaled its rows by 1 / the step's examples)."""
        keyed = [pushes[w] for w in sorted(pushes) if pushes[w].count]
        if keyed:
            keys = np.concatenate([r.keys for r in keyed])
            grads = np.concatenate([r.values for r in keyed])
            ukeys, ugrads = sum_duplicates(keys, grads)
            self.sparse.push(ukeys, ugrads)

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
