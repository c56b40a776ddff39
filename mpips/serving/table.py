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

from mpips.kernels.hashmap import lookup_rows, rebuild_slots
from mpips.kernels.overlay import fold, gather
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

    def __init__(self, keys, values, slots=None, overlay=None, n_rows=None, hidden=None):
        self.keys = np.ascontiguousarray(keys, np.int64)
        self.values = np.ascontiguousarray(values, np.float32)
        self.slots = hash_slots(self.keys) if slots is None else slots
        dim = self.values.shape[1]
        if overlay is None:
            overlay = (np.empty(0, np.int64), np.empty((0, dim), np.float32), None,
                       np.empty(0, np.uint8))
            hidden = np.empty(0, np.uint8)
        ok, ov, os_, od = overlay
        self.ov_keys, self.ov_values, self.ov_dead = ok, ov, od
        self.ov_slots = hash_slots(ok) if os_ is None else os_
        self._hidden = hidden       # which overlay ids the base holds (made when needed)
        if n_rows is None:
            hidden = self.hidden()
            n_rows = len(self.keys) - int(hidden.sum()) + int(len(od) - od.sum())
        self.n_rows = int(n_rows)

    def hidden(self):
        """uint8 (m,): 1 where the overlay's id has a row in the base (that it hides)."""
        if self._hidden is None:
            self._hidden = self._in_base(self.ov_keys)
        return self._hidden

    def _in_base(self, ids):
        rows = np.empty(len(ids), np.int64)
        lookup_rows(self.slots, self.keys, ids, rows)
        return (rows >= 0).astype(np.uint8)

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
        ``bundle.merge_rows``).  The patch's ids are sorted and looked up (O(p log p)), the
        overlay copied (O(overlay)); folded when the overlay grows large."""
        new_keys = np.asarray(new_keys, np.int64)
        evicted = np.asarray(evicted, np.int64)
        n_ev = len(evicted)
        ids = np.concatenate([evicted, new_keys])
        uniq, first_rev = np.unique(ids[::-1], return_index=True)   # the last entry wins:
        src = len(ids) - 1 - first_rev                               # evictions < new rows
        dead = (src < n_ev).astype(np.uint8)
        hidden = self._in_base(uniq)
        old = np.empty(len(uniq), np.int64)            # the overlay entries the patch replaces
        lookup_rows(self.ov_slots, self.ov_keys, uniq, old)
        old = old[old >= 0]
        keep_old = np.ones(len(self.ov_keys), np.bool_)
        keep_old[old] = False
        old_hidden = self.hidden()
        gone = int(len(old) - self.ov_dead[old].sum()) - int(old_hidden[old].sum())
        keep = (dead == 0) | (hidden == 1)             # a dead id the base lacks hides nothing
        uniq, src, dead, hidden = uniq[keep], src[keep], dead[keep], hidden[keep]
        values = np.zeros((len(uniq), self.dim), np.float32)
        live = dead == 0
        values[live] = np.asarray(new_values, np.float32)[src[live] - n_ev]
        added = int(live.sum()) - int(hidden.sum())
        overlay = (np.concatenate([self.ov_keys[keep_old], uniq]),
                   np.concatenate([self.ov_values[keep_old], values]), None,
                   np.concatenate([self.ov_dead[keep_old], dead]))
        out = Table(self.keys, self.values, self.slots, overlay, self.n_rows - gone + added,
                    np.concatenate([old_hidden[keep_old], hidden]))
        if len(overlay[0]) > max(fold_min, fold_fraction * len(self.keys)):
            return out.folded()
        return out
