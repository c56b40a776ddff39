"""What a server checks in a request before it touches a table (docs/reliability.md,
"Hostile wire input").

``RequestChecks`` is the validating half of ``mpips.server.loop.Server``: ``_validate``
raises ProtocolError naming the sender for a request that does not fit this server's
tables, ids or phase.  Every check is vectorised numpy or a numba kernel, O(n) in the
request: ownership (``mpips.tables.ownership.owners``), value bounds (min/max), whether ids repeat
(one comparison of neighbours; workers send each id once, ascending), dense optimizer
state (``mpips.tables.optim.state_violation``).  It reads the server's state (mode,
phase, held requests, shard) and changes nothing but a request whose repeated ids it sums.
"""
import numpy as np

from mpips.config import SAVE_MODES
from mpips.kernels.embedding import sum_duplicates
from mpips.tables.ownership import owners
from mpips.comm.protocol import F_CREATE, Op, ProtocolError
from mpips.tables.dense import packed_size, unpack_state
from mpips.tables.optim import state_violation

MAX_SHRINK_THRESHOLD = np.iinfo(np.uint16).max - 1   # rows age in a uint16 counter
MAX_COUNT = 2.0 ** 24   # largest occurrence count per id in one pull (float32 integers)
MAX_ABS = 1e15          # largest |gradient| or |delta| accepted, also per id summed over a
                        # request: squares stay finite in float32
CONTROL_OPS = (Op.FINISH, Op.STATS, Op.BARRIER, Op.SAVE, Op.SHRINK, Op.DENSE_GET)


class RequestChecks:
    """Request validation for ``Server`` (a mixin: it uses the server's attributes)."""

    # ---- validation: a bad request is dropped before it touches a table
    def _validate(self, req, source):
        def bad(why):
            raise ProtocolError(f"request from rank {source}: {req.op.name} {why}")
        if source not in self.last_seen:
            bad(f"from a rank that is not a worker of this job (workers: {self.workers})")
        if req.op in (Op.PULL, Op.PUSH, Op.ADD, Op.SAVE):
            self._validate_step(req, source, bad)
        if req.op == Op.SAVE:
            self._check_save(req, bad)
        elif req.op in CONTROL_OPS:
            if req.count or req.dense is not None:
                bad(f"must have no body; got count={req.count} dense="
                    f"{len(req.dense) if req.dense is not None else 0}")
            if req.op == Op.BARRIER and source not in self.active:
                bad("sent twice in one phase")
            if req.op == Op.SHRINK and not 0 <= req.step <= MAX_SHRINK_THRESHOLD:
                bad(f"threshold {req.step}: must be 0..{MAX_SHRINK_THRESHOLD} (shrink calls)")
            if req.op == Op.FINISH and (held := self._held_for(source)):
                bad(f"with {held} of its requests still held: they would "
                    "never be answered")
        elif req.op == Op.DENSE_PUT:
            self._check_dense_put(req, bad)
        elif req.op == Op.PULL:
            self._check_pull(req, source, bad)
        else:                                   # PUSH, ADD
            self._check_rows(req, source, bad)
        if req.op in (Op.PULL, Op.PUSH, Op.ADD):
            self._check_owned(req, bad)

    def _check_save(self, req, bad):
        if self.on_save is None:
            bad("but this run has no --save-dir")
        if req.count != 1 or req.values is not None or req.dense is not None:
            bad("must carry exactly one key (the checkpoint's sequence number)")
        if not 0 <= req.flags < len(SAVE_MODES):
            bad(f"mode flag {req.flags}: must be 0..{len(SAVE_MODES) - 1} ({', '.join(SAVE_MODES)})")
        seq = int(req.keys[0])
        if seq in self.saved:
            bad(f"for checkpoint {seq} twice: this server wrote (or queued) its shard already")
        why = self.save_check(seq, req.flags) if self.save_check else None
        if why:
            bad(why)

    def _check_dense_put(self, req, bad):
        if self.mode == "geo":
            bad("in geo mode (the servers train the dense weights there)")
        opt, want = self.dense.opt, packed_size(self.dense, self.dense.size)
        if req.count or req.dense is None or len(req.dense) != want:
            bad(f"must carry no keys and {want} dense floats (values + optimizer state "
                f"of this server's slice); got count={req.count} dense="
                f"{0 if req.dense is None else len(req.dense)}")
        why = state_violation(opt, unpack_state(self.dense, req.dense, self.dense.size))
        if why:
            bad(why)

    def _check_pull(self, req, source, bad):
        if req.dense is not None or (req.values is not None and req.dim != 1):
            bad(f"may carry only occurrence counts (width 1); got dim={req.dim} "
                f"dense={0 if req.dense is None else len(req.dense)}")
        if self.mode == "sync" and req.flags & F_CREATE:
            if req.step < self.version:
                bad(f"for step {req.step}, already applied (phase at step {self.version}): "
                    "a training pull would be held for good")
            if source not in self.active:
                bad(f"for step {req.step} after this worker's BARRIER: a training pull would "
                    "be held past the end of the phase")
            if source in self.held.get(req.step, ()):
                bad(f"for step {req.step} twice (the first is held until the step is ready)")
        if req.values is not None and req.count:
            c = req.values[:, 0]
            if not (0 <= c.min() <= c.max() <= MAX_COUNT and (c == np.floor(c)).all()):
                bad(f"occurrence counts must be whole numbers in 0..{MAX_COUNT:.0f}; got "
                    f"min {c.min()} max {c.max()}")

    def _check_rows(self, req, source, bad):
        """PUSH / ADD: widths, bounds of each value and of each id's summed rows, phase."""
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
        if req.count:
            self._sum_repeats(req, bad)
        if req.op == Op.PUSH and self.mode == "sync":
            if source not in self.active:
                bad(f"for step {req.step} after this worker's BARRIER (phase step {self.version})")
            if source in self.pending.get(req.step, ()):
                bad(f"for step {req.step} twice")

    @staticmethod
    def _sum_repeats(req, bad):
        """An id listed more than once is applied once, with its rows summed; the sums are
        held to the per-value bound too (MAX_ABS: their squares stay finite in float32).

        The workers send each id once, in ascending order: one vectorised comparison
        confirms it; only other requests are summed (``sum_duplicates``, O(n))."""
        k = req.keys
        if req.count < 2 or (k[1:] > k[:-1]).all():
            return
        ukeys, usums = sum_duplicates(k, req.values)
        if not -MAX_ABS <= usums.min() <= usums.max() <= MAX_ABS:
            peak = np.abs(usums).max(axis=1)
            r = int(np.argmax(np.where(np.isnan(peak), np.inf, peak)))
            bad(f"rows summed per id reach {peak[r]:.3g} (id {ukeys[r]} listed "
                f"{np.count_nonzero(k == ukeys[r])} times), beyond {MAX_ABS:.0e}: they would "
                "poison the row for good")
        req.keys, req.values, req.count = ukeys, usums, len(ukeys)

    def _check_owned(self, req, bad):
        """Every id of a PULL/PUSH/ADD must be this server's (``mpips.tables.ownership.owners``):
        a row made elsewhere would be saved twice and read from the wrong server."""
        me, n_servers = self.shard
        if n_servers == 1 or not req.count:
            return
        own = owners(req.keys, n_servers)
        foreign = own != me
        if foreign.any():
            k = int(np.argmax(foreign))
            bad(f"for {np.count_nonzero(foreign)} of {req.count} ids this server does not own "
                f"(id {req.keys[k]} belongs to server {own[k]} of {n_servers}; this is server "
                f"{me}): the sender maps ids to servers differently from this job")

    def _held_for(self, source):
        """Requests of `source` this server holds and still has to answer."""
        return (sum(source in got for got in self.held.values())
                + sum(src == source for _, src in self.deferred)
                + sum(x[3] == source for x in self.deferred_saves))

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
