"""Job-wide liveness: what each rank waits for, status dumps, and failing with a name.

Every rank (server or worker) has one ``Watch`` (``WATCH``).  A rank records what it is
waiting for (``WATCH.waiting(...)``), answers other ranks' status requests while it waits
(``WATCH.poll()``), and when a peer stops answering within ``--peer-timeout`` it asks every
rank for its line, prints the dump to stderr and raises ``PeerTimeout`` naming the ranks
that did not answer (``WATCH.fail(text)``).  ``wait_for`` is that wait loop (with
back-off, ``mpips.comm.backoff``); ``wait_requests`` and ``wait_collective`` complete MPI
requests with it.  See docs/reliability.md.

The status channels are checked before anything is received: a status request must be
one int64 (``DUMP_BYTES``), a status line at most ``MAX_LINE_BYTES`` from a rank that was
asked; anything else is discarded unread (:func:`discard`) with a line naming the sender.
A worker also listens for refusals (``TAG_ERROR``) from its servers and raises
``RequestRefused`` with the server's line.
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpips.comm.backoff import COLLECTIVE, REPLY, Backoff
from mpips.comm.protocol import DUMP_BYTES, MAX_LINE_BYTES, TAG_DUMP, TAG_DUMP_REPLY, TAG_ERROR

POLL_EVERY = 5e-3   # seconds between looks for a status request (TAG_DUMP)
DUMP_WAIT = 1.0     # seconds a failing rank waits for the others' status lines
MAX_IGNORED_LINES = 100     # discarded messages logged one line each; later ones only counted


class PeerTimeout(RuntimeError):
    """A peer stopped answering within --peer-timeout."""


class RequestRefused(RuntimeError):
    """A server refused one of this worker's requests (its line says why)."""


def err_line(text):
    """Print one line to stderr in one write, so that lines of ranks sharing the
    launcher's stream do not run into each other."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def discard(msg):
    """Take a matched message (``MPI.Message``) off the wire without reading it.

    It is received into 8 bytes: MPI reports a longer one as truncated, which is the
    point (the bytes are dropped, not allocated).  Returns nothing."""
    try:
        msg.Recv([np.empty(8, np.uint8), 8, MPI.BYTE])
    except MPI.Exception as e:
        if e.Get_error_class() not in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
            raise


def line_text(buf):
    """A line received from the wire as printable text (no control characters)."""
    text = bytes(buf).decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() else "?" for c in text)


class Watch:
    """What this rank is waiting for; answers other ranks' status requests.

    One per process (``WATCH``), bound to the world communicator by the server or the
    client.  ``waiting(state)`` records the current wait (a string or a callable giving
    one); ``poll()`` answers TAG_DUMP requests; ``fail(text)`` asks every other rank,
    prints the dump to stderr and raises PeerTimeout naming the ranks that did not answer.
    """

    def __init__(self):
        self.comm, self.label = None, ""
        self.state, self.since, self.next_poll = "starting", time.monotonic(), 0.0
        self.timed = True           # append the time spent in this state to the line
        self.answered_at = -1e9     # when this rank last answered a status request
        self._sends = []        # (request, buffer) of status traffic, kept alive
        self._token = np.zeros(1, np.int64)
        self.servers = ()       # a worker: server ranks whose refusals (TAG_ERROR) it takes
        self.ignored = 0        # messages discarded (wrong size, tag or sender)

    def bind(self, comm, label):
        if self.comm is None:
            self.comm, self.label = comm, label
        return self

    def listen(self, servers):
        """Take refusals from these server ranks: ``poll`` raises RequestRefused on one."""
        self.servers = tuple(servers)

    def waiting(self, state, timed=True):
        self.state, self.since, self.timed = state, time.monotonic(), timed

    def line(self):
        state = self.state() if callable(self.state) else self.state
        since = f" [for {time.monotonic() - self.since:.1f} s]" if self.timed else ""
        return f"rank {self.comm.rank} ({self.label}): {state}{since}"

    def poll(self, force=False):
        """Answer pending status requests and take refusals (at most every POLL_EVERY s
        unless forced)."""
        if self.comm is None:
            return
        now = time.monotonic()
        if not force and now < self.next_poll:
            return
        self.next_poll = now + POLL_EVERY
        status = MPI.Status()
        while (msg := self.comm.Improbe(MPI.ANY_SOURCE, TAG_DUMP, status)) is not None:
            self.answer(msg, status)
        if self.servers:
            while (msg := self.comm.Improbe(MPI.ANY_SOURCE, TAG_ERROR, status)) is not None:
                self._refusal(msg, status)
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def answer(self, msg, status):
        """Answer one probed status request (``TAG_DUMP``) with this rank's line."""
        src, n = status.Get_source(), status.Get_count(MPI.BYTE)
        if n != DUMP_BYTES:
            return self.ignore(msg, status, f"a status request is {DUMP_BYTES} bytes")
        msg.Recv([np.empty(1, np.int64), 1, MPI.INT64_T])
        self.answered_at = time.monotonic()
        text = np.frombuffer(self.line().encode()[:1000], np.uint8).copy()
        self._sends.append((self.comm.Isend([text, len(text), MPI.BYTE], src,
                                            TAG_DUMP_REPLY), text))

    def _refusal(self, msg, status):
        src, n = status.Get_source(), status.Get_count(MPI.BYTE)
        if src not in self.servers or n > MAX_LINE_BYTES:
            return self.ignore(msg, status, f"refusals come from the servers {list(self.servers)}"
                               f", at most {MAX_LINE_BYTES} bytes")
        buf = np.empty(n, np.uint8)
        msg.Recv([buf, n, MPI.BYTE])
        raise RequestRefused(f"server rank {src} refused a request of this worker: "
                             f"{line_text(buf)}")

    def ignore(self, msg, status, why):
        """Discard a probed message that does not fit its tag, with a line naming the sender."""
        src, tag, n = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
        discard(msg)
        self.ignored += 1
        if self.ignored <= MAX_IGNORED_LINES:
            err_line(f"mpips: rank {self.comm.rank} ({self.label}): ignored a message of {n} "
                     f"bytes from rank {src} on tag {tag} ({why})")
        if self.ignored == MAX_IGNORED_LINES:
            err_line(f"mpips: rank {self.comm.rank}: further ignored messages only counted")

    def collect(self, wait=DUMP_WAIT):
        """Ask every other rank for its status line: (lines by rank, ranks that did not answer)."""
        comm = self.comm
        others = [r for r in range(comm.size) if r != comm.rank]
        for r in others:
            self._sends.append((comm.Isend([self._token, 1, MPI.INT64_T], r, TAG_DUMP),
                                self._token))
        lines, missing = {comm.rank: self.line()}, set(others)
        status, t0 = MPI.Status(), time.monotonic()
        backoff = Backoff(*COLLECTIVE)
        while missing and time.monotonic() - t0 < wait:
            msg = comm.Improbe(MPI.ANY_SOURCE, TAG_DUMP_REPLY, status)
            if msg is not None:
                src, n = status.Get_source(), status.Get_count(MPI.BYTE)
                if src not in missing or n > MAX_LINE_BYTES:
                    self.ignore(msg, status, f"status lines come once from each rank asked, "
                                f"at most {MAX_LINE_BYTES} bytes")
                    continue
                buf = np.empty(n, np.uint8)
                msg.Recv([buf, n, MPI.BYTE])
                lines[src] = line_text(buf)
                missing.discard(src)
            else:
                self.poll(force=True)       # another failing rank may be asking us
                backoff.sleep()
        for r in missing:
            lines[r] = f"rank {r}: NO ANSWER within {wait:.1f} s (dead, stopped, or busy)"
        return [lines[r] for r in sorted(lines)], sorted(missing)

    def fail(self, text):
        """Dump every rank's wait state to stderr, then raise PeerTimeout."""
        if self.comm is None or self.comm.size == 1:
            raise PeerTimeout(text)
        quiet = time.monotonic() - self.answered_at < 3 * DUMP_WAIT   # the asker prints one
        lines, missing = self.collect()
        me = f"mpips: rank {self.comm.rank} ({self.label})"
        if not quiet:
            err_line(f"{me}: peer status dump (what each rank is waiting for):")
            for line in lines:
                err_line(f"{me}:   {line}")
        if missing:
            raise PeerTimeout(f"rank(s) {missing} stopped answering (no reply to a status "
                              f"request within {DUMP_WAIT:.0f} s); seen here: {text}")
        raise PeerTimeout(f"{text}; every rank answered a status request (see the dump above)")


WATCH = Watch()


def wait_for(done, backoff, timeout=None, failure=None, since=None):
    """Call ``done()`` until it returns true; meanwhile answer status requests and back off.

    With ``timeout``: once ``timeout`` s passed since ``since()`` (default: the call), fail
    the job with ``WATCH.fail(failure())`` (a status dump of every rank, then PeerTimeout).
    """
    t0 = time.monotonic()
    while not done():
        WATCH.poll()
        if timeout is not None and time.monotonic() - (since() if since else t0) > timeout:
            WATCH.fail(failure())
        backoff.sleep()


def wait_requests(reqs, timeout, what, spin=0.0, statuses=None):
    """Wait for all MPI requests, sleeping between polls and answering status requests.

    what: text, or a callable giving it, naming the awaited op, step and peers; after
    `timeout` seconds the job fails with it, following a status dump of every rank.
    spin: poll without sleeping for up to this many seconds first (a wait that is usually
    short and on the critical path of every rank, such as the workers' dense exchange).
    statuses: a list that receives one MPI.Status per request once all are complete.
    """
    WATCH.poll()
    if not reqs or MPI.Request.Testall(reqs, statuses):
        return
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < spin:
        if MPI.Request.Testall(reqs, statuses):
            return
        os.sched_yield()        # a rank waiting for its core gets it (8 ranks on 2 cores)
    WATCH.waiting(what)
    wait_for(lambda: MPI.Request.Testall(reqs, statuses), Backoff(*REPLY), timeout,
             lambda: f"no answer within {timeout:.0f} s: {what() if callable(what) else what}")


def wait_collective(req, what="an MPI collective"):
    """Complete a non-blocking collective without burning a core.

    Meanwhile answer other ranks' status requests (a failing rank's dump shows `what`).
    """
    if req.Test():
        return
    WATCH.waiting(f"waiting in {what}")
    wait_for(req.Test, Backoff(*COLLECTIVE))
