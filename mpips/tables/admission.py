"""Feature admission in front of a SparseTable (Paddle's CountFilterEntry / ProbabilityEntry).

`AdmittedTable` has the SparseTable interface.  A training pull (create=True) brings the
number of *sightings* (occurrences in the batch's examples) of each of its ids.  An id
without a row is counted in a small side table (`counts`, itself a SparseTable of width 1,
so it ages, is shrunk and is saved with base/delta semantics like any table;
checkpoints hold it and the ``admitted`` counter next to the rows):
- ``count:N``: the id gets its row at its N-th sighting;
- ``probability:P``: at each sighting the id gets its row with probability P, decided by a
  hash of (seed, id, sighting number) so that runs are reproducible.
Until then the id reads zeros and its gradients and GEO deltas are dropped.  Evaluation
pulls (create=False) never count, never create.
"""
import numpy as np

from mpips.config import parse_entry
from mpips.kernels.hashmap import init_rows
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
class AdmittedTable:
    """A SparseTable that creates rows only for admitted ids."""

    def __init__(self, table, spec, seed):
        self.table = table
        self.kind, self.value = parse_entry(spec)
        self.seed = int(seed)
        self.counts = SparseTable(1, OptimizerConfig(name="sgd"), seed=0, init_range=0.0)
        self.admitted = 0          # ids given a row by admission since the start

    def __getattr__(self, name):          # everything else: the inner table
        return getattr(self.table, name)

    def __len__(self):
        return len(self.table)

    @property
    def nbytes(self):
        return self.table.nbytes + self.counts.nbytes

    def _admit(self, keys, counts):
        """Count sightings of each id without a row; return which keys have a row or are
        admitted now (their rows are made by the caller's pull, which counts them seen)."""
        have = self.table.has_rows(keys)
        absent = ~have
        if counts is not None:                  # an id pulled with 0 occurrences (GEO's
            counts = np.asarray(counts, np.float32)     # look-ahead) is not a sighting
            absent &= counts > 0
        missing = keys[absent]
        if not len(missing):
            return have
        n = np.ones((len(missing), 1), np.float32) if counts is None else \
            counts[absent].reshape(-1, 1)
        self.counts.add(missing, n)
        seen = np.empty((len(missing), 1), np.float32)
        self.counts.pull(missing, seen, create=False)
        seen = seen[:, 0]                                   # sightings so far, this included
        if self.kind == "count":
            ok = seen >= self.value
        else:
            salted = (missing.view(np.uint64) ^ (seen.astype(np.uint64) * GOLDEN)).view(np.int64)
            u = np.empty((len(missing), 1), np.float32)
            init_rows(salted, self.seed, 1.0, u)             # uniform [-1, 1) from (seed, id, n)
            ok = (u[:, 0] + 1.0) * 0.5 < self.value
        have[np.flatnonzero(absent)[ok]] = True
        self.admitted += int(ok.sum())
        return have

    def pull(self, keys, out, create=False, counts=None):
        """counts (n,): occurrences of each id in the batch (default 1 each).  Returns each
        key's row, -1 for ids not admitted (as :meth:`SparseTable.pull`)."""
        if not (create and self.kind):
            return self.table.pull(keys, out, create=create)
        keys = np.ascontiguousarray(keys, np.int64)
        have = self._admit(keys, counts)
        if have.all():
            return self.table.pull(keys, out, create=True)
        out[~have] = 0.0                                     # not admitted: zeros
        sub = np.empty((int(have.sum()), self.table.dim), np.float32)
        rows = np.full(keys.shape[0], -1, np.int64)
        rows[have] = self.table.pull(keys[have], sub, create=True)  # makes admitted rows
        out[have] = sub
        return rows

    def push(self, keys, grads, scale=1.0, create=True, lr_scale=None):
        self.table.push(keys, grads, scale, create=create and not self.kind, lr_scale=lr_scale)

    def add(self, keys, deltas, create=True):
        self.table.add(keys, deltas, create=create and not self.kind)

    def shrink(self, threshold):
        """Age and evict rows and waiting counts alike; returns rows removed."""
        self.counts.shrink(threshold)
        return self.table.shrink(threshold)

    def waiting(self):
        """Ids sighted but not (yet) admitted."""
        if not len(self.counts):
            return 0
        keys = self.counts.export_rows()["keys"]
        return int((~self.table.has_rows(keys)).sum())
