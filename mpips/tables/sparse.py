"""Sparse parameter table of one server: int64 id -> embedding row + optimizer state.

Each row has these fields (see ``row_fields()``; ``export_rows`` returns them as arrays):

* ``keys`` int64 (R,), ``values`` float32 (R, dim)
* optimizer state: Adagrad ``accum`` (R, dim); Adam ``m``, ``v`` (R, dim) and
  ``beta1_pow``, ``beta2_pow`` (R,) for lazy Adam's per-row bias correction
* metadata: ``unseen`` uint16 (shrink calls since last seen), ``seen_count`` uint32
  (``pull(create=True)`` sightings, saturating), ``dirty`` uint8 (changed since
  ``clear_dirty``), ``seen_flag`` uint8 (seen since the last ``shrink``)

plus an open-addressing slot array (``mpips.kernels.hashmap``). Live rows are
``0 .. len-1``; new ids are appended. The rows are records in pages
(:class:`mpips.kernels.pages.PagedColumns`, ``PAGE_ROWS`` rows a page): a table grows by
adding pages and never copies its rows (only the first page grows by ``ROW_GROWTH``
copies while the table is below one page). The slot array (4 B a slot) doubles to keep
its load at most ``LOAD_FACTOR``; it is rebuilt from the keys after the old one is
freed, so growing never holds two copies of anything big. ``shrink`` compacts the rows
in place (keeping their order) and frees the pages past the end, so row indices are
only stable between shrinks.

A new row is initialised from ``(seed, id)`` alone (``init_rows``), so the table's
content never depends on arrival order or on which server holds an id.

Which calls create rows and set flags:

========================  ===========  =========  ==========  =====
call                      creates row  seen_flag  seen_count  dirty
========================  ===========  =========  ==========  =====
pull(create=False)        no           no         no          no
pull(create=True)         yes          yes        +1          yes
push / add (create=True)  yes          yes        no          yes
assign                    yes          no         no          yes
import_rows               yes          as given   as given    as given (default 1)
========================  ===========  =========  ==========  =====

So a row that is not dirty was not seen since ``clear_dirty``: its metadata changed only
by ``shrink`` ageing it, once per call, which ``shrinks`` counts and ``age`` replays (a
delta checkpoint holds the dirty rows and that count; loading ages older rows by it).

Admission filters sit in front: they call ``pull(create=False)`` and
``push(..., create=False)`` (gradients of ids without a row are dropped) until an id is
admitted. The table is not thread-safe; one server thread owns it.
"""
import numpy as np

from mpips.kernels.hashmap import (age_rows, init_rows, insert_missing, lookup_rows,
                                   read_rows, rebuild_slots, touch_rows)
from mpips.kernels.optim import add_rows
from mpips.kernels.pages import PagedColumns
from mpips.tables.optim import OptimizerConfig, apply_rows

LOAD_FACTOR = 0.6      # max live rows / slots
ROW_GROWTH = 1.25      # growth of the first page while the table is below one page
PAGE_ROWS = 1 << 18    # rows per page (Adam dim 10: ~38 MB a page)
SHRINK_SLACK = 0.25    # spare row capacity kept after a shrink compaction
MIN_CAPACITY = 16
MAX_ROWS = np.iinfo(np.int32).max     # rows are int32 indices in the slot array
SCRATCH_MAX = 1 << 16   # calls with more keys (bulk loads) allocate instead
UNSEEN_MAX = 65535      # ``unseen`` saturates here (uint16)
META_FIELDS = (('unseen', np.uint16), ('seen_count', np.uint32), ('dirty', np.uint8),
               ('seen_flag', np.uint8))


def slots_for(n_rows):
    """Smallest power-of-two slot count holding ``n_rows`` at <= LOAD_FACTOR."""
    need = max(int(np.ceil(n_rows / LOAD_FACTOR)), MIN_CAPACITY)
    return 1 << (need - 1).bit_length()


def _as_keys(keys):
    keys = np.asarray(keys)
    if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
        raise TypeError(f'keys must be a 1-D integer array; got {keys.dtype} {keys.shape}')
    if keys.dtype == np.uint64:
        keys = keys.view(np.int64)
    return np.ascontiguousarray(keys, dtype=np.int64)


class SparseTable:
    """Hash table of embedding rows with a server-side optimizer.

    Parameters
    ----------
    dim : int                 row width (embedding size)
    opt : OptimizerConfig     optimizer applied by ``push``
    seed : int                row-init seed, 0 <= seed < 2**63
    init_range : float        new rows are uniform in [-init_range, init_range)
    capacity : int            initial row capacity (grows as needed)
    page_rows : int           rows per storage page, a power of two
    """

    def __init__(self, dim, opt, seed, init_range=0.01, capacity=1024, page_rows=PAGE_ROWS):
        if int(dim) < 1:
            raise ValueError(f'dim must be >= 1; got {dim}')
        if not isinstance(opt, OptimizerConfig):
            raise TypeError(f'opt must be an OptimizerConfig; got {type(opt).__name__}')
        if not 0 <= int(seed) < 2**63:
            raise ValueError(f'seed must be in [0, 2**63); got {seed}')
        if not init_range >= 0:
            raise ValueError(f'init_range must be >= 0; got {init_range}')
        self.dim = int(dim)
        self.opt = opt
        self.seed = int(seed)
        self.init_range = float(init_range)
        self._hyper = opt.hyper()
        # name -> (dtype, per_element, fill value of a fresh row; None = init_rows)
        self._spec = {'keys': (np.int64, False, 0), 'values': (np.float32, True, None)}
        for name, per_element in opt.state_arrays():
            self._spec[name] = (np.float32, per_element, opt.initial_state(name))
        for name, dtype in META_FIELDS:
            self._spec[name] = (dtype, False, 0)
        self._n = 0
        # two records a row: key + metadata (16 B: what a probe and a pull's
        # bookkeeping touch), values + optimizer state (Adam dim 10: 128 B, 2 cache lines)
        index = {'keys'} | {name for name, _ in META_FIELDS}
        self._store = PagedColumns(
            {name: (dt, self.dim if per_el else 0, 'index' if name in index else 'row')
             for name, (dt, per_el, _) in self._spec.items()},
            page_rows, max(int(capacity), MIN_CAPACITY), ROW_GROWTH)
        self._cols = self._store.col      # name -> paged column, as the kernels take it
        self._slots = np.full(slots_for(self.capacity), -1, np.int32)
        self._rows_buf = np.empty(1024, np.int64)
        self._evicted = []
        self.shrinks = 0            # shrink calls since clear_dirty
        self.compactions = 0        # shrinks that moved rows (row indices changed)

    # ----------------------------------------------------------------- storage
    def _rebuild_index(self, n_slots):
        """New slot array of ``n_slots`` filled from the keys (the old one is freed first)."""
        self._slots = None
        self._slots = np.empty(n_slots, np.int32)
        rebuild_slots(self._cols['keys'], self._n, self._slots)

    def _ensure_room(self, n_new):
        need = self._n + n_new
        if need > MAX_ROWS:
            raise OverflowError(f"sparse table: {need} rows would not fit its int32 slot array "
                                f"(at most {MAX_ROWS} rows per server); use more servers "
                                f"(--servers) or evict rows (--shrink-every)")
        self._store.grow(need, self._n)
        if need > LOAD_FACTOR * self._slots.shape[0]:
            self._rebuild_index(slots_for(need))

    def _init_new(self, lo, hi):
        """Initialise freshly appended rows ``lo .. hi-1``; they start dirty."""
        view = self._store.view
        for p, a, b, _ in self._store.spans(lo, hi):
            init_rows(view('keys', p)[a:b], self.seed, self.init_range, view('values', p)[a:b])
            for name, (_, _, fill) in self._spec.items():
                if fill is not None and name != 'keys':
                    view(name, p)[a:b] = fill
            view('dirty', p)[a:b] = 1

    def _rows_for(self, keys, create):
        """Row of each key (-1: none) in a scratch buffer; creates rows if asked."""
        n = keys.shape[0]
        if n > self._rows_buf.shape[0] and n <= SCRATCH_MAX:
            self._rows_buf = np.empty(max(n, 2 * self._rows_buf.shape[0]), np.int64)
        rows = self._rows_buf[:n] if n <= SCRATCH_MAX else np.empty(n, np.int64)
        found = lookup_rows(self._slots, self._cols['keys'], keys, rows)
        if create and found < n:
            self._ensure_room(n - found)
            lo = self._n
            self._n = insert_missing(self._slots, self._cols['keys'], lo, keys, rows)
            self._init_new(lo, self._n)
        return rows

    def _check_rows_arg(self, arr, n, name, writable=False):
        if writable:
            ok = (isinstance(arr, np.ndarray) and arr.dtype == np.float32
                  and arr.flags.c_contiguous and arr.flags.writeable)
            if not ok or arr.shape != (n, self.dim):
                raise ValueError(f'{name} must be a writable C-contiguous float32 array of '
                                 f'shape ({n}, {self.dim})')
            return arr
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.shape != (n, self.dim):
            raise ValueError(f'{name} must have shape ({n}, {self.dim}); got {arr.shape}')
        return arr

    # --------------------------------------------------------------- hot path
    def pull(self, keys, out, create=False, counts=None):
        """Read rows of ``keys`` into ``out`` float32 (n, dim).

        create=False: ids without a row read zeros and no row is made (inference,
        admission). create=True: missing rows are made; every key counts as seen.
        counts (occurrences, for an admission filter in front) are not used here.
        Returns each key's row (-1: none), int64 (n,) in a scratch buffer that the next
        call overwrites (the staleness tracker copies it rather than looking keys up again).
        """
        keys = _as_keys(keys)
        self._check_rows_arg(out, keys.shape[0], 'out', writable=True)
        rows = self._rows_for(keys, create)
        if create:
            c = self._cols
            touch_rows(rows, c['seen_flag'], c['seen_count'], c['dirty'], True, True)
        read_rows(self._cols['values'], rows, out)
        return rows

    def push(self, keys, grads, scale=1.0, create=True, lr_scale=None):
        """Apply the optimizer to the rows of unique ``keys`` with ``grads * scale``.

        Ids without a row get one first (create=True) or are dropped (create=False).
        lr_scale: float32 (n,) multiplying each key's learning rate (the staleness
        rules, :func:`mpips.tables.staleness.lr_factors`), or None (exactly 1).
        """
        keys = _as_keys(keys)
        n = keys.shape[0]
        grads = self._check_rows_arg(grads, n, 'grads')
        if lr_scale is not None:
            lr_scale = np.ascontiguousarray(lr_scale, dtype=np.float32)
            if lr_scale.shape != (n,):
                raise ValueError(f'lr_scale must have shape ({n},); got {lr_scale.shape}')
        rows, grads, lr_scale = self._live(keys, grads, create, lr_scale)
        c = self._cols
        state = {name: c[name] for name, _ in self.opt.state_arrays()}
        apply_rows(self.opt, self._hyper, c['values'], state, rows, grads, float(scale),
                   lr_scale)
        touch_rows(rows, c['seen_flag'], c['seen_count'], c['dirty'], False, True)

    def add(self, keys, deltas, create=True):
        """``values[keys] += deltas`` (GEO-SGD); unique keys, rows made as in push."""
        keys = _as_keys(keys)
        deltas = self._check_rows_arg(deltas, keys.shape[0], 'deltas')
        rows, deltas, _ = self._live(keys, deltas, create)
        c = self._cols
        add_rows(c['values'], rows, deltas)
        touch_rows(rows, c['seen_flag'], c['seen_count'], c['dirty'], False, True)

    def assign(self, keys, values):
        """``values[keys] = values`` keeping optimizer state; missing rows are made (GEO rebase)."""
        keys = _as_keys(keys)
        values = self._check_rows_arg(values, keys.shape[0], 'values')
        rows = self._rows_for(keys, True)
        self._store.scatter('values', rows, values)
        self._store.scatter('dirty', rows, 1)

    def _live(self, keys, data, create, lr_scale=None):
        """(rows, data[, lr_scale]) of the keys that have a row (create: all of them)."""
        rows = self._rows_for(keys, create)
        if not create:
            have = rows >= 0
            if not have.all():
                rows, data = rows[have], data[have]
                lr_scale = None if lr_scale is None else lr_scale[have]
        return rows, data, lr_scale

    # ------------------------------------------------------------------- info
    def __len__(self):
        return self._n

    @property
    def capacity(self):
        """Rows the pages hold before growing."""
        return self._store.capacity

    @property
    def n_slots(self):
        return self._slots.shape[0]

    @property
    def nbytes(self):
        """Bytes of all arrays owned by the table (row pages, slots, scratch)."""
        return self._store.nbytes + self._slots.nbytes + self._rows_buf.nbytes

    @property
    def n_pages(self):
        return self._store.n_pages

    def row_fields(self):
        """Names of the per-row arrays ``export_rows`` returns, ``keys`` first."""
        return list(self._spec)

    def field(self, name):
        """A copy of field ``name`` of every row, in row order."""
        return self._store.flat(name, self._n)

    def rows_of(self, keys):
        """Row index of each key, -1 where the id has no row (int64 (n,), a copy)."""
        return self._rows_for(_as_keys(keys), False).copy()

    def has_rows(self, keys):
        """Which keys have a row (bool (n,))."""
        return self._rows_for(_as_keys(keys), False) >= 0

    # ------------------------------------------------------ checkpoint support
    def export_rows(self, rows=None):
        """Copy of all fields of ``rows`` (row indices; None = all live rows)."""
        if rows is None:
            return {name: self._store.flat(name, self._n) for name in self._spec}
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= self._n)):
            raise IndexError(f'rows must be a 1-D array of row indices in [0, {self._n})')
        return {name: self._store.gather(name, rows) for name in self._spec}

    def import_rows(self, data):
        """Insert or overwrite rows exactly from a dict like ``export_rows`` returns.

        ``keys`` and ``values`` are required; a missing optimizer state array gives
        fresh state, missing ``dirty`` gives 1, other missing metadata 0. After loading
        a checkpoint call ``clear_dirty()`` if the table should count as saved.
        """
        keys, cols = self.checked_rows(data)
        rows = self._rows_for(keys, True).copy()
        for name, val in cols.items():
            if name != 'keys':
                self._store.scatter(name, rows, val)

    def checked_rows(self, data):
        """(keys, {field: array, or the scalar of a missing field}) of an ``import_rows``
        dict, checked (fields, shapes, unique keys); ValueError otherwise."""
        unknown = set(data) - set(self._spec)
        if unknown or 'keys' not in data or 'values' not in data:
            raise ValueError(f'import_rows needs keys and values and accepts only '
                             f'{self.row_fields()}; got {sorted(data)}')
        keys = _as_keys(data['keys'])
        n = keys.shape[0]
        ordered = np.sort(keys)                 # (np.unique is ~50x slower here)
        if n > 1 and (ordered[1:] == ordered[:-1]).any():
            raise ValueError('import_rows: keys must be unique')
        cols = {'keys': keys}
        for name, (dtype, per_el, fill) in self._spec.items():
            shape = (n, self.dim) if per_el else (n,)
            if name in data and name != 'keys':
                arr = np.asarray(data[name])
                if arr.shape != shape:
                    raise ValueError(f'import_rows: {name} must have shape {shape}; '
                                     f'got {arr.shape}')
                cols[name] = arr
            elif name != 'keys':
                cols[name] = 1 if name == 'dirty' else fill
        return keys, cols

    def count_rows(self, dirty_only=False):
        """Rows ``iter_rows`` yields: all, or those changed since ``clear_dirty``."""
        return len(self.dirty_rows()) if dirty_only else self._n

    def iter_rows(self, dirty_only=False, chunk=1 << 18):
        """Copies of the rows (all fields, as ``export_rows``), at most ``chunk`` at a time, in
        row order: all rows, or those changed since ``clear_dirty``."""
        rows = self.dirty_rows() if dirty_only else None
        n = self._n if rows is None else len(rows)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            yield self.export_rows(np.arange(lo, hi, dtype=np.int64) if rows is None
                                   else rows[lo:hi])

    def dirty_rows(self):
        """Row indices changed since ``clear_dirty`` (int64, ascending)."""
        parts = [np.flatnonzero(part) + start for part, (_, _, _, start) in
                 zip(self._store.slices('dirty', 0, self._n), self._store.spans(0, self._n))]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def dirty_keys(self):
        """Ids of rows changed since ``clear_dirty`` (int64, in row order)."""
        return self._store.gather('keys', self.dirty_rows())

    def clear_dirty(self):
        """Start tracking changes afresh (after a base/delta save or a load)."""
        for part in self._store.slices('dirty', 0, self._n):
            part[:] = 0
        self.shrinks = 0

    def evicted_keys(self):
        """Sorted unique ids removed by ``shrink`` since ``clear_evicted``.

        An id evicted and later re-created is listed too: apply evictions first,
        then the changed rows.
        """
        if not self._evicted:
            return np.empty(0, np.int64)
        return np.unique(np.concatenate(self._evicted))

    def clear_evicted(self):
        self._evicted = []

    # ------------------------------------------------------------------ shrink
    def shrink(self, threshold):
        """Age rows by one shrink call and remove those unseen for > ``threshold``.

        A row seen since the previous call has its ``unseen`` reset to 0, every other
        row gets ``unseen += 1``; rows with ``unseen > threshold`` are removed and the
        remaining rows moved down in place, keeping their order; pages past the end are
        freed (memory is given back). Returns the number removed.
        """
        if int(threshold) != threshold or threshold < 0:
            raise ValueError(f'shrink threshold must be an integer >= 0; got {threshold}')
        self.shrinks += 1
        keep = self.age_mask(threshold)
        n = self._n
        kept = int(keep.sum())
        if kept == n:
            return 0
        self._evicted.append(self._store.gather('keys', np.flatnonzero(~keep)))
        self.drop(keep)
        return n - kept

    def age_mask(self, threshold):
        """Age every row by one shrink call (as ``shrink``); return which rows stay (bool (n,)).
        Removes nothing: ``drop`` does."""
        keep = np.empty(self._n, np.bool_)
        c = self._cols
        age_rows(c['unseen'], c['seen_flag'], self._n, int(threshold), keep)
        return keep

    def drop(self, keep):
        """Remove the rows where ``keep`` (bool (len,)) is False, moving the others down in
        order; not recorded as evicted (the disk tier moves rows out this way)."""
        n = self._n
        kept = int(np.count_nonzero(keep))
        if kept == n:
            return
        self._store.compact(np.ascontiguousarray(keep, np.bool_), n)
        self.compactions += 1
        self._n = kept
        small = max(kept + int(kept * SHRINK_SLACK), MIN_CAPACITY)
        self._store.fit(kept, small)
        self._rebuild_index(slots_for(min(small, self.capacity)))

    def age(self, times):
        """Age every row as ``times`` shrink calls would, evicting none (checkpoint replay)."""
        keep = np.empty(self._n, np.bool_)
        c = self._cols
        for _ in range(int(times)):
            age_rows(c['unseen'], c['seen_flag'], self._n, UNSEEN_MAX, keep)
