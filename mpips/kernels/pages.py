"""Paged row storage for the sparse table, and the accessors numba kernels use on it.

Rows live in pages of ``page_rows = 2**shift`` rows, so a table grows by adding a page
and never copies its rows. Only the first page may be smaller while the table is small
(it grows by copying until it reaches ``page_rows``, then pages are added). A page is
one array of records per *group* of fields: the fields of a group read together are
adjacent, so touching a row costs a few cache lines, not one per field (a big table
misses the cache on every row).

Kernels receive a field (a *paged column*) as a tuple ``(ptrs, shift, width, stride,
proto)``:

* ``ptrs``   int64 (n_pages,): address of the field in row 0 of each page
* ``shift``  int: log2 of the rows per page
* ``width``  int: elements per row (``dim`` for row vectors, 1 for scalar fields)
* ``stride`` int: bytes from one row to the next (the record size)
* ``proto``  empty 1-D array of the field's dtype (carries the dtype only)

and read it through ``row(col, r)`` (the row as a 1-D array view), ``at(col, r)`` and
``put(col, r, x)`` (element ``r`` of a scalar field); ``prefetch(col, r)`` asks the CPU to
bring row ``r``'s record into the cache (a hint: it changes no value). The four work on
plain numpy arrays (``col[r]``), so every kernel written with them takes flat arrays (tests, the
dense table) or paged columns alike, compiled once for each. Row ``r`` lives at
``ptrs[r >> shift] + (r & (2**shift - 1)) * stride``: one small array load on top of
the flat case.

Full pages are anonymous ``mmap`` s, so dropping a page gives its memory back to the
OS at once (malloc keeps freed chunks of this size in its heap).
"""
import mmap

import numpy as np
from llvmlite import binding as _llvm, ir as _ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

HUGE = 2 << 20             # huge page size (x86-64)


@intrinsic
def _address_ptr(typingctx, address, proto):
    """int64 address -> pointer to ``proto``'s dtype (no bounds, no lifetime)."""
    ptr_t = types.CPointer(proto.dtype)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_t))
    return ptr_t(types.int64, proto), codegen


# llvm.prefetch's name: mangled by its pointer type, opaque ("p0") from LLVM 17 on
_PREFETCH = "llvm.prefetch.p0" if _llvm.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"
LINE = 64                  # cache line bytes (x86-64)
PREFETCH_BYTES = 256       # of a row at most (the hardware prefetcher streams the rest)
# Rows ahead a kernel prefetches when it visits rows in a given, random order (a server's
# pull and push over a big table): without it each row's cache misses are taken one after
# the other.  2-core AMD EPYC (Zen 4), 1.17M rows of Adam dim 9, 50k random rows a call:
# lazy Adam 200 -> 60 ns a row, the hash probe 92 -> 55 (4-8 rows ahead alike, 16 worse).
AHEAD = 8


@intrinsic
def _prefetch_line(typingctx, address):
    """llvm.prefetch of the cache line at ``address`` (int64), for writing, kept in every
    cache level: a hint, no fault on any address."""
    def codegen(context, builder, sig, args):
        i8p, i32 = _ir.IntType(8).as_pointer(), _ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32]), _PREFETCH)
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@intrinsic
def _element_address(typingctx, arr, idx):
    """Address (int64) of ``arr[idx]``, the first element of row ``idx`` (no bounds check:
    only ever prefetched)."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        index = [args[1]] + [context.get_constant(types.intp, 0)] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, index, wraparound=False)
        return builder.ptrtoint(ptr, _ir.IntType(64))
    return types.int64(arr, types.intp), codegen


@njit(inline='always')
def _address(col, r):
    """Address (int64) of row ``r``'s field in a paged column."""
    ptrs, shift, _, stride, _ = col
    return ptrs[r >> shift] + (r & ((1 << shift) - 1)) * stride


@njit(inline='always')
def _prefetch_span(a, n):
    """Prefetch every cache line of the ``n`` bytes from address ``a``."""
    for off in range(0, n, LINE):
        _prefetch_line(a + off)
    _prefetch_line(a + n - 1)


def prefetch(col, r):
    """Prefetch row ``r`` of a column: the lines of its record (numba only)."""
    raise NotImplementedError('numba-only accessor')


def row(col, r):
    """Row ``r`` of a 2-D column as a 1-D view (numba only)."""
    raise NotImplementedError('numba-only accessor')


def at(col, r):
    """Element ``r`` of a scalar column (numba only)."""
    raise NotImplementedError('numba-only accessor')


def put(col, r, x):
    """Set element ``r`` of a scalar column (numba only)."""
    raise NotImplementedError('numba-only accessor')


@overload(row, inline='always')
def _ov_row(col, r):
    if isinstance(col, types.Array):
        return lambda col, r: col[r]

    def impl(col, r):
        return carray(_address_ptr(_address(col, r), col[4]), col[2])
    return impl


@overload(at, inline='always')
def _ov_at(col, r):
    if isinstance(col, types.Array):
        return lambda col, r: col[r]

    def impl(col, r):
        return _address_ptr(_address(col, r), col[4])[0]
    return impl


@overload(prefetch, inline='always')
def _ov_prefetch(col, r):
    if isinstance(col, types.Array):
        itemsize = col.dtype.bitwidth // 8
        if col.ndim == 1:
            return lambda col, r: _prefetch_line(_element_address(col, r))

        def flat(col, r):           # a row of a 2-D array: its first PREFETCH_BYTES
            _prefetch_span(_element_address(col, r), min(itemsize * col.shape[1], PREFETCH_BYTES))
        return flat

    def impl(col, r):   # the record from this field on (a record's first field: all of it)
        _prefetch_span(_address(col, r), min(col[3], PREFETCH_BYTES))
    return impl


@overload(put, inline='always')
def _ov_put(col, r, x):
    if isinstance(col, types.Array):
        def flat(col, r, x):
            col[r] = x
        return flat

    def impl(col, r, x):
        _address_ptr(_address(col, r), col[4])[0] = x
    return impl


@njit(cache=True, nogil=True)
def gather_rows(col, rows, out):
    """``out[i] = col[rows[i]]``; out (n, width) of the column's dtype."""
    for i in range(rows.shape[0]):
        src = row(col, rows[i])
        for j in range(src.shape[0]):
            out[i, j] = src[j]


@njit(cache=True, nogil=True)
def scatter_rows(col, rows, src):
    """``col[rows[i]] = src[i]``; src (n, width)."""
    for i in range(rows.shape[0]):
        dst = row(col, rows[i])
        for j in range(dst.shape[0]):
            dst[j] = src[i, j]


@njit(cache=True, nogil=True)
def compact_rows(col, keep, n):
    """Move the rows ``r < n`` with ``keep[r]`` to ``0, 1, ...`` in order (in place)."""
    w = 0
    for r in range(n):
        if keep[r]:
            if w != r:
                src, dst = row(col, r), row(col, w)
                for j in range(src.shape[0]):
                    dst[j] = src[j]
            w += 1
    return w


def record_dtype(fields):
    """Structured dtype of ``fields`` {name: (dtype, width)}: largest element first, size
    a multiple of 8."""
    order = sorted(fields, key=lambda name: -np.dtype(fields[name][0]).itemsize)
    names, formats, offsets, pos = [], [], [], 0
    for name in order:
        dtype, width = np.dtype(fields[name][0]), int(fields[name][1])
        names.append(name)
        formats.append((dtype, (width,)) if width else dtype)
        offsets.append(pos)
        pos += dtype.itemsize * max(width, 1)
    return np.dtype({'names': names, 'formats': formats, 'offsets': offsets,
                     'itemsize': -(-pos // 8) * 8})


def _new_page(rows, dtype):
    """A page in its own anonymous mmap, 2 MB aligned, its whole 2 MB blocks advised to
    use huge pages (as numpy does for its big arrays: random rows over GBs miss the TLB
    otherwise; measured 1.7x slower pulls at 5M rows)."""
    nbytes = rows * dtype.itemsize
    buf = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -np.frombuffer(buf, np.uint8, count=1).ctypes.data % HUGE
    whole = nbytes // HUGE * HUGE          # (a huge page past the end would be all RSS)
    if whole and hasattr(mmap, 'MADV_HUGEPAGE'):
        buf.madvise(mmap.MADV_HUGEPAGE, offset, whole)
    return np.frombuffer(buf, dtype, count=rows, offset=offset)


class PagedColumns:
    """Row-aligned fields stored as records in pages of ``page_rows`` rows.

    Parameters
    ----------
    spec : dict name -> (dtype, width, group)    width 0: a scalar field; the fields of
                                                 one group share a record (and its pages)
    page_rows : int                              a power of two
    capacity : int                               initial rows
    growth : float                               growth of the first page while small

    ``col[name]`` is the paged column the kernels take. Groups let fields read together
    share cache lines while the hash probe's field (the key) stays in a small record.
    """

    def __init__(self, spec, page_rows, capacity, growth):
        page_rows = int(page_rows)
        if page_rows < 1 or page_rows & (page_rows - 1):
            raise ValueError(f'page_rows must be a power of two; got {page_rows}')
        self.page_rows = page_rows
        self.shift = page_rows.bit_length() - 1
        self.growth = float(growth)
        self.spec = {name: (np.dtype(dt), int(w)) for name, (dt, w, _) in spec.items()}
        self.group = {name: g for name, (_, _, g) in spec.items()}
        self.dtypes = {g: record_dtype({n: self.spec[n] for n in spec if self.group[n] == g})
                       for g in dict.fromkeys(self.group.values())}
        self.pages = {g: [] for g in self.dtypes}
        self.col = {}
        self._set_first(min(int(capacity), page_rows), 0)
        while self.capacity < capacity:
            self._add_page()

    # ------------------------------------------------------------ layout
    def _alloc(self, g, rows):
        if rows >= self.page_rows:
            return _new_page(rows, self.dtypes[g])
        return np.empty(rows, self.dtypes[g])

    def _refresh(self):
        shift = np.int64(self.shift)
        self.records = {}
        for g, dtype in self.dtypes.items():
            bases = np.array([p.ctypes.data for p in self.pages[g]], np.int64)
            stride = np.int64(dtype.itemsize)
            for name in dtype.names:
                fdt, width = self.spec[name]
                self.col[name] = (bases + dtype.fields[name][1], shift, np.int64(max(width, 1)),
                                  stride, np.empty(0, fdt))
            self.records[g] = (bases, shift, stride, stride, np.empty(0, np.uint8))

    def _set_first(self, rows, keep):
        """(Re)allocate page 0 with ``rows`` rows, copying its first ``keep`` rows."""
        for g, pages in self.pages.items():
            new = self._alloc(g, rows)
            if keep:
                new[:keep] = pages[0][:keep]
            if pages:
                pages[0] = new
            else:
                pages.append(new)
        self._refresh()

    def _add_page(self):
        for g, pages in self.pages.items():
            pages.append(self._alloc(g, self.page_rows))
        self._refresh()

    def _drop_pages(self, keep):
        for pages in self.pages.values():
            del pages[keep:]

    @property
    def _first(self):
        return next(iter(self.pages.values()))

    @property
    def capacity(self):
        first = self._first
        return first[0].shape[0] + (len(first) - 1) * self.page_rows

    @property
    def n_pages(self):
        return len(self._first)

    @property
    def nbytes(self):
        return sum(p.nbytes for pages in self.pages.values() for p in pages)

    def view(self, name, p):
        """Field ``name`` of page ``p`` (a strided numpy view)."""
        return self.pages[self.group[name]][p][name]

    def grow(self, need, n_live):
        """Make room for ``need`` rows; ``n_live`` rows are in use (copied if page 0 moves)."""
        if need <= self.capacity:
            return
        first = self._first[0].shape[0]
        if first < self.page_rows:
            self._set_first(min(self.page_rows, max(need, int(first * self.growth) + 1)),
                            n_live)
        while self.capacity < need:
            self._add_page()

    def compact(self, keep, n):
        """Move the rows ``r < n`` with ``keep[r]`` to ``0, 1, ...`` in order (in place)."""
        for rec in self.records.values():
            compact_rows(rec, keep, n)

    def fit(self, n_live, small_cap):
        """Give back pages past ``n_live`` rows; a table below a page gets ``small_cap`` rows."""
        if small_cap < self.page_rows:
            if self.n_pages > 1 or small_cap < self.capacity:
                self._drop_pages(1)
                self._set_first(small_cap, n_live)
            return
        keep = max(1, -(-n_live // self.page_rows))
        if keep < self.n_pages:
            self._drop_pages(keep)
            self._refresh()

    # ------------------------------------------------------------ bulk access
    def spans(self, lo, hi):
        """``(page, a, b, start)``: rows ``start .. start + b - a - 1`` are ``page[a:b]``."""
        shift, size = self.shift, self.page_rows
        for p in range(lo >> shift, ((hi - 1) >> shift) + 1 if hi > lo else lo >> shift):
            a = max(lo, p * size)
            b = min(hi, (p + 1) * size)
            yield p, a - p * size, b - p * size, a

    def slices(self, name, lo, hi):
        """Views of field ``name`` covering rows ``lo .. hi-1``, in order."""
        return [self.view(name, p)[a:b] for p, a, b, _ in self.spans(lo, hi)]

    def flat(self, name, n):
        """A copy of rows ``0 .. n-1`` of field ``name`` as one array."""
        dtype, width = self.spec[name]
        out = np.empty((n, width) if width else (n,), dtype)
        pos = 0
        for part in self.slices(name, 0, n):
            out[pos:pos + len(part)] = part
            pos += len(part)
        return out

    def gather(self, name, rows):
        dtype, width = self.spec[name]
        out = np.empty((rows.shape[0], max(width, 1)), dtype)
        gather_rows(self.col[name], rows, out)
        return out if width else out.reshape(-1)

    def scatter(self, name, rows, values):
        """``field[rows] = values`` (an array of len(rows) rows, or one scalar for all)."""
        dtype, width = self.spec[name]
        n, width = rows.shape[0], max(width, 1)
        if np.ndim(values) == 0:
            src = np.full((n, width), values, dtype)
        else:
            src = np.ascontiguousarray(np.asarray(values).reshape(n, width), dtype=dtype)
        scatter_rows(self.col[name], rows, src)
