"""The serving embedding table: a read-only base hash map and an overlay of later changes.

A patch (rows changed, ids evicted) is not merged into the base: it goes into the overlay,
a small hash map of the ids changed since the base was built (new values, or dead for an
evicted id), consulted before the base (``mpips.kernels.overlay``).  So applying a patch
costs O(overlay + patch), not O(table): the new table shares the base arrays with the old
one and gets a new overlay.  When the overlay grows over ``FOLD_FRACTION`` of the base
(and ``FOLD_MIN`` rows) it is folded into a new base, an O(table) step every few dozen
patches, in kernels that release the GIL.

A ``Table`` never changes once built: a reader holding one sees one whole version.  Its
arrays (``arrays()``) may live in shared memory (``mpips.serving.shared``); ``Table(...)``
over the same arrays is the same table.
"""
import numpy as np

from mpips.kernels.hashmap import rebuild_slots
from mpips.kernels.overlay import fold, gather, in_base
from mpips.tables.sparse import slots_for

FOLD_FRACTION = 0.125      # fold when the overlay holds more ids than this part of the base
FOLD_MIN = 8192            # ... and at least this many (small tables do not fold each patch)
FIELDS = ("keys", "values", "slots", "ov_keys", "ov_values", "ov_slots", "ov_dead")


def hash_slots(keys, out=None):
    """The open-addressing slot array of ``keys`` (into ``out``, sized by ``slots_for``)."""
    out = np.empty(slots_for(len(keys)), np.int32) if out is None else out
    rebuild_slots(keys, len(keys), out)
    return out


def layout(n, dim, m):
    """[(name, dtype, shape)] of a table of n base rows and m overlay ids (``FIELDS``)."""
    return [("keys", np.int64, (n,)), ("values", np.float32, (n, dim)),
            ("slots", np.int32, (slots_for(n),)), ("ov_keys", np.int64, (m,)),
            ("ov_values", np.float32, (m, dim)), ("ov_slots", np.int32, (slots_for(m),)),
            ("ov_dead", np.uint8, (m,))]


class Table:
    """Base (keys, values, slots) + overlay (ov_keys, ov_values, ov_slots, ov_dead); immutable.

    ``n_rows``: the ids with a row (base ids not in the overlay + live overlay ids).
    """

    def __init__(self, keys, values, slots=None, overlay=None, n_rows=None):
        self.keys = np.ascontiguousarray(keys, np.int64)
        self.values = np.ascontiguousarray(values, np.float32)
        self.slots = hash_slots(self.keys) if slots is None else slots
        dim = self.values.shape[1]
        if overlay is None:
            overlay = (np.empty(0, np.int64), np.empty((0, dim), np.float32), None,
                       np.empty(0, np.uint8))
        ok, ov, os_, od = overlay
        self.ov_keys, self.ov_values, self.ov_dead = ok, ov, od
        self.ov_slots = hash_slots(ok) if os_ is None else os_
        if n_rows is None:
            hidden = np.empty(len(ok), np.uint8)
            in_base(self.slots, self.keys, ok, hidden)
            n_rows = len(self.keys) - int(hidden.sum()) + int(len(od) - od.sum())
        self.n_rows = int(n_rows)

    @property
    def dim(self):
        return self.values.shape[1]

    def __len__(self):
        return self.n_rows

    def arrays(self):
        return {f: getattr(self, f) for f in FIELDS}

    @classmethod
    def from_arrays(cls, a, n_rows=None):
        return cls(a["keys"], a["values"], a["slots"],
                   (a["ov_keys"], a["ov_values"], a["ov_slots"], a["ov_dead"]), n_rows)

    def gather(self, ids, out):
        """``out[i]`` = the row of ``ids[i]`` (zeros for an id without one)."""
        gather(self.slots, self.keys, self.values, self.ov_slots, self.ov_keys,
               self.ov_values, self.ov_dead, ids, out)
        return out

    def rows(self):
        """(keys, values) of every id with a row: the base itself when there is no overlay,
        else a folded copy (base rows not overridden, then the overlay's live rows)."""
        if not len(self.ov_keys):
            return self.keys, self.values
        keys = np.empty(self.n_rows, np.int64)
        values = np.empty((self.n_rows, self.dim), np.float32)
        n = fold(self.slots, self.keys, self.values, self.ov_keys, self.ov_values,
                 self.ov_dead, keys, values)
        assert n == self.n_rows, (n, self.n_rows)
        return keys, values

    def folded(self):
        """The same table as one base (no overlay)."""
        keys, values = self.rows()
        return self if keys is self.keys else Table(keys, values, n_rows=self.n_rows)

    def patched(self, new_keys, new_values, evicted, fold_fraction=FOLD_FRACTION,
                fold_min=FOLD_MIN):
        """The table with ``evicted`` ids dropped, then rows ``new_keys`` (unique) set to
        ``new_values`` (an id both evicted and in ``new_keys`` keeps its new row, as in
        ``bundle.merge_rows``).  O(overlay + patch); folded when the overlay grows large."""
        new_keys = np.asarray(new_keys, np.int64)
        evicted = np.asarray(evicted, np.int64)
        dim = self.dim
        keys = np.concatenate([self.ov_keys, evicted, new_keys])
        # the last entry of an id wins: old overlay < evictions < new rows
        uniq, first_rev = np.unique(keys[::-1], return_index=True)
        src = len(keys) - 1 - first_rev
        n_old, n_ev = len(self.ov_keys), len(evicted)
        dead = np.concatenate([self.ov_dead, np.ones(n_ev, np.uint8),
                               np.zeros(len(new_keys), np.uint8)])[src]
        hidden = np.empty(len(uniq), np.uint8)
        in_base(self.slots, self.keys, uniq, hidden)
        keep = (dead == 0) | (hidden == 1)      # a dead id the base lacks hides nothing
        uniq, src, dead, hidden = uniq[keep], src[keep], dead[keep], hidden[keep]
        values = np.zeros((len(uniq), dim), np.float32)
        old = src < n_old
        values[old] = self.ov_values[src[old]]
        new = src >= n_old + n_ev
        values[new] = np.asarray(new_values, np.float32)[src[new] - n_old - n_ev]
        n_rows = len(self.keys) - int(hidden.sum()) + int(len(dead) - dead.sum())
        out = Table(self.keys, self.values, self.slots, (uniq, values, None, dead), n_rows)
        if len(uniq) > max(fold_min, fold_fraction * len(self.keys)):
            return out.folded()
        return out
