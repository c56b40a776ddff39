"""Staleness of asynchronous pushes, counted per sparse row, and the rules that damp them.

The staleness of a pushed row is the number of updates it received (pushes applied to it,
by any worker, the pusher's own earlier pushes included) between the pushing worker's
training pull for that step and this push.  0: the worker computed on the row as it is
now.  In async mode a worker pulls step t+1 before it pushes step t, so a row in two
consecutive batches of one worker is at least 1 stale even with no other worker.

How it is counted (vectorised numpy, no per-row Python):

* every row has a version, the pushes applied to it (uint32, wrapping; only differences
  are used, modulo 2**32), in an array indexed by table row and grown with the table;
* a training pull records, per (worker, step), its rows and their versions; a worker
  keeps at most ``MAX_PULLS`` records (async has steps t and t+1 outstanding): older
  ones are dropped, and a record is used up by its push;
* a push looks its keys' rows up, finds them in that record (the same rows in the same
  order is the usual case: compared at once; otherwise by a sorted search) and subtracts
  the recorded versions from the current ones; then it adds 1 to each row's version.

Memory: 4 B a table row plus the rows of two pulls per worker.  Row indices are stable
between shrinks only: a shrink that moved rows (the table's ``compactions``) resets the
versions and forgets the pulls, as `reset` does (the servers call it at each phase end,
where steps count from 0 again).

Pushed keys without a recorded pull of their row (no pull of that step by that worker,
a row made by the push itself, an id that has no row) get staleness 0 and are counted in
``unmatched``, not in the histogram.
"""
import numpy as np

RULES = ("none", "inverse", "sqrt")     # --stale-lr: learning-rate factor by staleness s
HIST_BINS = 65          # staleness 0 .. 63, and [64] = 64 or more
MAX_PULLS = 2           # pull records kept per worker (async: steps t and t+1)
MAX_RECORD_ROWS = 1 << 22   # a step pulled again past this many rows keeps its newest pull
MIN_VERSIONS = 1024


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
        self._pulls = {}            # worker -> {step: (rows int64 (n,), versions uint32 (n,))}
        self._version = np.zeros(max(len(self.table), MIN_VERSIONS), np.uint32)

    def _rows(self, keys):
        """Row of each key (-1: none); versions cover every row of the table."""
        if getattr(self.table, "compactions", 0) != self._compactions:
            self._compactions = self.table.compactions
            self.reset()
        rows = self.table.rows_of(keys)
        n = len(self.table)
        if n > self._version.shape[0]:
            grown = np.zeros(max(n, 2 * self._version.shape[0]), np.uint32)
            grown[:self._version.shape[0]] = self._version
            self._version = grown
        return rows

    def pulled(self, worker, step, keys):
        """A training pull (rows exist: create=True) of unique int64 ``keys`` by ``worker``
        for its ``step``.  A second pull of the same step adds to its record (the earlier
        pull's versions count for a key in both)."""
        rows = self._rows(keys)
        versions = self._version[np.maximum(rows, 0)]      # rows -1 are never matched
        recs = self._pulls.setdefault(worker, {})
        old = recs.get(step)
        if old is not None and old[0].shape[0] + rows.shape[0] <= MAX_RECORD_ROWS:
            rows, versions = np.concatenate([old[0], rows]), np.concatenate([old[1], versions])
        recs[step] = (rows, versions)
        for s in [s for s in recs if s <= step - self.max_pulls]:
            del recs[s]
        while len(recs) > self.max_pulls:
            del recs[min(s for s in recs if s != step)]

    def pushed(self, worker, step, keys):
        """Staleness int64 (n,) of each of the unique ``keys`` pushed by ``worker`` for its
        ``step`` (0 without a recorded pull); then counts this push as one update of each
        key's row.  Call it before the table applies the push."""
        rows = self._rows(keys)
        n = rows.shape[0]
        recs = self._pulls.get(worker, {})
        rec = recs.pop(step, None)
        for s in [s for s in recs if s < step]:
            del recs[s]
        live = rows >= 0
        every = bool(live.all())
        if rec is None or not n:
            stale = np.zeros(n, np.int64)
            s = stale[:0]
        else:
            hit, then = _match(rec, rows)
            if every and (hit is None or hit.all()):        # usually: the pull's rows
                stale = (self._version[rows] - then).astype(np.int64)  # uint32: mod 2**32
                s = stale
            else:
                hit = live if hit is None else hit & live
                stale = np.zeros(n, np.int64)
                s = (self._version[rows[hit]] - then[hit]).astype(np.int64)
                stale[hit] = s
        self._count(s, n)
        self._version[rows if every else rows[live]] += 1
        return stale

    def _count(self, s, n):
        if s.shape[0]:
            self.hist += np.bincount(np.minimum(s, HIST_BINS - 1), minlength=HIST_BINS)
            self.total += int(s.sum())
            self.max = max(self.max, int(s.max()))
        self.unmatched += n - s.shape[0]

    def summary(self):
        """The counts so far as a JSON-ready dict (:func:`summarize`)."""
        return summarize(self.hist, self.total, self.max, self.unmatched)


def _match(rec, rows):
    """(hit bool (n,) or None = all, recorded versions of ``rows`` (n,)) from a pull record
    (rows, versions): the same rows in the same order is the usual case."""
    prow, pver = rec
    if prow.shape == rows.shape and np.array_equal(prow, rows):
        return None, pver
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


def lr_factors(rule, staleness):
    """Learning-rate factor float32 (n,) of rows pushed with ``staleness`` (n,) under
    ``rule``: "none" -> None (no scaling), "inverse" -> 1 / (1 + s), "sqrt" ->
    1 / sqrt(1 + s)."""
    if rule == "none":
        return None
    s = np.asarray(staleness, np.float64)
    if rule == "inverse":
        return (1.0 / (1.0 + s)).astype(np.float32)
    if rule == "sqrt":
        return (1.0 / np.sqrt(1.0 + s)).astype(np.float32)
    raise ValueError(f"--stale-lr must be one of {', '.join(RULES)}; got {rule!r}")
