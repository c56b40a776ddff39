"""Staleness of asynchronous pushes, counted per sparse row, and the rules that damp them.

The staleness of a pushed row is the number of updates it received (pushes applied to it,
by any worker, the pusher's own earlier pushes included) between the pushing worker's
training pull for that step and this push.  0: the worker computed on the row as it is
now.  In async mode a worker pulls step t+1 before it pushes step t, so a row in two
consecutive batches of one worker is at least 1 stale even with no other worker.

How it is counted (numpy and one kernel, ``mpips.kernels.staleness.count_push``):

* every row has a version, the pushes applied to it (uint32, wrapping; only differences
  are used, modulo 2**32), in an array indexed by table row and grown with the table;
* a training pull records, per (worker, step), its keys, their rows and the rows'
  versions; a worker keeps at most ``MAX_PULLS`` records (async has steps t and t+1
  outstanding): older ones are dropped, and a record is used up by its push;
* a push of that step normally sends the pull's keys in the pull's order: it reuses the
  record's rows (no lookup); otherwise it looks its keys up and finds their rows in the
  record by a sorted search.  It subtracts the recorded versions from the current ones,
  then adds 1 to each row's version.

Memory: 4 B a table row plus 20 B a key of two pulls per worker.  Row indices are stable
between shrinks only: a shrink that moved rows (the table's ``compactions``) resets the
versions and forgets the pulls, as `reset` does (the servers call it at each phase end,
where steps count from 0 again).

Pushed keys without a recorded pull of their row (no pull of that step by that worker,
a row made by the push itself, an id that has no row) get staleness 0 and are counted in
``unmatched``, not in the histogram.
"""
import numpy as np

from mpips.config import stale_power
from mpips.kernels.staleness import count_push

HIST_BINS = 65          # staleness 0 .. 63, and [64] = 64 or more
MAX_PULLS = 2           # pull records kept per worker (async: steps t and t+1)
MAX_RECORD_ROWS = 1 << 22   # a step pulled again past this many rows keeps its newest pull
MIN_VERSIONS = 1024
ALL = np.zeros(0, np.bool_)     # count_push's "every key was pulled"


class StalenessTracker:
    """Counts the staleness of every pushed row of one sparse table (see module doc).

    table: the SparseTable (or AdmittedTable) whose pulls and pushes are reported here;
    max_pulls: pull records kept per worker (a simulator with deeper delays needs more).
    hist: int64 (65,) pushed rows by staleness 0..63, [64] = 64 or more; ``total`` and
    ``max``: exact sum and largest value; ``unmatched``: pushed keys without a pull record.
    """

    def __init__(self, table, max_pulls=MAX_PULLS):
        if int(max_pulls) < 1:
            raise ValueError(f"max_pulls must be >= 1; got {max_pulls}")
        self.table = table
        self.max_pulls = int(max_pulls)     # pull records kept per worker
        self.hist = np.zeros(HIST_BINS, np.int64)
        self.total = 0
        self.max = 0
        self.unmatched = 0
        self._compactions = getattr(table, "compactions", 0)
        self.reset()

    def reset(self):
        """Forget every pull and every row's version (phase end, shrink)."""
        self._pulls = {}    # worker -> {step: (keys, rows, versions, every row existed)}
        self._version = np.zeros(max(self._span(), MIN_VERSIONS), np.uint32)

    def _span(self):
        """Row indices the versions cover: the table's rows (a disk tier's resident ones)."""
        span = getattr(self.table, "row_span", None)
        return len(self.table) if span is None else span

    def _moved(self):
        """Reset if a shrink moved rows since the last call."""
        if getattr(self.table, "compactions", 0) != self._compactions:
            self._compactions = self.table.compactions
            self.reset()

    def _rows(self, keys, rows=None):
        """Row of each key (-1: none; a copy of ``rows`` if the caller has them from its
        pull); versions cover every row of the table."""
        rows = self.table.rows_of(keys) if rows is None else np.array(rows, np.int64)
        n = self._span()
        if n > self._version.shape[0]:
            grown = np.zeros(max(n, 2 * self._version.shape[0]), np.uint32)
            grown[:self._version.shape[0]] = self._version
            self._version = grown
        return rows

    def pulled(self, worker, step, keys, rows=None):
        """A training pull (rows exist: create=True) of unique int64 ``keys`` by ``worker``
        for its ``step``; ``rows``: their rows as the table's pull returned them (else looked
        up).  A second pull of the same step adds to its record (the earlier pull's versions
        count for a key in both)."""
        self._moved()
        keys = _int64(keys).copy()                  # a server's keys are a receive buffer
        rows = self._rows(keys, rows)
        versions = self._version[np.maximum(rows, 0)]      # rows -1 are never matched
        recs = self._pulls.setdefault(worker, {})
        old = recs.get(step)
        if old is not None and old[0].shape[0] + rows.shape[0] <= MAX_RECORD_ROWS:
            keys, rows, versions = (np.concatenate([a, b]) for a, b in
                                    zip(old[:3], (keys, rows, versions)))
        recs[step] = (keys, rows, versions, bool((rows >= 0).all()))
        for s in [s for s in recs if s <= step - self.max_pulls]:
            del recs[s]
        while len(recs) > self.max_pulls:
            del recs[min(s for s in recs if s != step)]

    def pushed(self, worker, step, keys):
        """Staleness int64 (n,) of each of the unique ``keys`` pushed by ``worker`` for its
        ``step`` (0 without a recorded pull); then counts this push as one update of each
        key's row.  Call it before the table applies the push."""
        self._moved()
        keys = _int64(keys)
        recs = self._pulls.get(worker, {})
        rec = recs.pop(step, None)
        for s in [s for s in recs if s < step]:
            del recs[s]
        n = keys.shape[0]
        if rec is not None and rec[3] and np.array_equal(rec[0], keys):
            rows, then, hit = rec[1], rec[2], ALL       # the pull's keys: its rows, no lookup
        else:
            rows = self._rows(keys)
            if rec is None:
                then, hit = np.zeros(n, np.uint32), np.zeros(n, np.bool_)
            else:
                hit, then = _match(rec[1], rec[2], rows)
        stale = np.empty(n, np.int64)
        acc = np.array([0, 0, self.max], np.int64)
        count_push(self._version, rows, then, hit, stale, self.hist, acc)
        self.total += int(acc[1])
        self.max = int(acc[2])
        self.unmatched += n - int(acc[0])
        return stale

    def summary(self):
        """The counts so far as a JSON-ready dict (:func:`summarize`)."""
        return summarize(self.hist, self.total, self.max, self.unmatched)


def _int64(keys):
    keys = np.asarray(keys)
    return keys if keys.dtype == np.int64 else keys.astype(np.int64)   # uint64: same bits


def _match(prow, pver, rows):
    """(hit bool (n,), recorded versions (n,)) of ``rows`` in a pull record of rows
    ``prow`` and versions ``pver``."""
    if prow.shape == rows.shape and np.array_equal(prow, rows):
        return ALL, pver
    if not prow.shape[0]:
        return np.zeros(rows.shape[0], np.bool_), np.zeros(rows.shape[0], np.uint32)
    order = np.argsort(prow, kind="stable")     # the first pull of a row wins
    at = order[np.minimum(np.searchsorted(prow[order], rows), prow.shape[0] - 1)]
    return prow[at] == rows, pver[at]


def summarize(hist, total, largest, unmatched):
    """{pushed_rows, mean, p50, p90, p99, max, unmatched, hist} of a staleness histogram.

    Percentiles are histogram bins (the smallest s with at least that share of the rows at
    or below it; 64 means 64 or more); mean and max are exact."""
    hist = np.asarray(hist, np.int64)
    rows = int(hist.sum())
    out = {"pushed_rows": rows, "mean": round(total / rows, 4) if rows else 0.0}
    cum = np.cumsum(hist)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        out[name] = int(np.searchsorted(cum, q * rows)) if rows else 0
    out.update(max=int(largest), unmatched=int(unmatched), hist=hist.tolist())
    return out


def counts_staleness(mode, staleness):
    """Do the servers of ``--mode mode --staleness staleness`` count push staleness?  Async
    and ssp do; sync (and ssp with staleness 0, which is sync) is 0 by construction."""
    return mode == "async" or (mode == "ssp" and staleness > 0)


SMALL_W = 4     # --dense-lr-rule auto: x W up to this many workers (mpips.job.build)
STALE_AUTO_W = 16   # --stale-lr auto (the default): no damping up to this many workers,
STALE_AUTO = "power:0.75"   # and this beyond


def stale_rule(rule, n_workers):
    """The --stale-lr rule a run of ``n_workers`` workers applies: "auto" (the default) is
    "none" up to STALE_AUTO_W workers and STALE_AUTO, (1 + s)^-0.75, beyond; others as
    given.  At a global batch of 4096 (1M rows, seeds 0-2) 32 and 64 simulated workers went
    from -0.0034 / +0.0035 and -0.0009 / +0.0049 (AUC / logloss against one process) to
    -0.0019 / +0.0029 and -0.0012 / +0.0010 on the default shape, and from +0.0153 /
    -0.0125 and +0.0130 / -0.0086 to +0.0057 / -0.0048 and +0.0049 / -0.0005 on the
    second; sqrt and inverse each missed more; up to 16 workers no damping met the bar
    (docs/studies/scaling-with-w.md, "Staleness damping at 32 and 64 workers")."""
    if rule != "auto":
        return rule
    return "none" if n_workers <= STALE_AUTO_W else STALE_AUTO


def lr_factors(rule, staleness):
    """Learning-rate factor float32 (n,) of rows pushed with ``staleness`` (n,) under
    ``rule``: "none" -> None (no scaling), "inverse" -> 1 / (1 + s), "sqrt" ->
    1 / sqrt(1 + s), "power:P" -> (1 + s)^-P (power:0 -> None)."""
    power = stale_power(rule)               # raises for a rule that is none of these
    if power == 0.0:
        return None
    s = np.asarray(staleness, np.float64)
    if rule == "inverse":
        return (1.0 / (1.0 + s)).astype(np.float32)
    if rule == "sqrt":
        return (1.0 / np.sqrt(1.0 + s)).astype(np.float32)
    return ((1.0 + s) ** -power).astype(np.float32)

