"""A stand-alone reader of Paddle slot text for the PyTorch reference (bench/torch_ref.py).

Used by the reference only while mpips's own reader cannot take a ``--schema`` (issue 20,
readers); it yields the same Batch layout mpips's reader does (see SCHEMA_CONTRACT):
``dense (n, D) float32``, ``sparse`` flat int64 ids of every bag example-major, ``offsets
(n*S + 1,)`` int64, ``label (n,) float32``.

Format: whitespace-separated ``slot:feasign`` tokens (``feasign:slot`` with that token
order), in any order; a repeated slot is a bag, a missing slot an empty bag; the label slot
holds 0 or 1; a dense slot of ``dim`` values takes its first ``dim`` tokens (missing values are
the group's ``fill``); tokens of undeclared slots are skipped.  Dense values are used as written
(the generator writes them normalised; other ``norm`` settings are not applied here).  A line
with a malformed token, a label other than 0/1 or no label is skipped and counted.

Ids: with ``hash_bucket = B > 0`` a feasign ``v`` is the row ``v % B`` (mpips's ``--hash-bucket``
on slot files); with 0 it is mixed with its slot's salt, ``splitmix64(v + salt * golden)``
(``raw_ids`` keeps ``v``), as mpips's slot ids.
"""
import queue
import threading

import numpy as np
from numba import njit

from mpips.data.files import resolve_paths

CHUNK_BYTES = 4 << 20
_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)
KIND_LABEL, KIND_DENSE, KIND_SPARSE = 0, 1, 2


def _fnv(name: bytes) -> int:
    h = int(_FNV_OFFSET)
    for b in name:
        h = ((h ^ b) * int(_FNV_PRIME)) & ((1 << 64) - 1)
    return h


@njit(cache=True, nogil=True)
def _float(buf, a, b):
    """Decimal float of buf[a:b] (sign, digits, '.', digits, e[sign]digits); NaN if malformed."""
    i, neg, m, scale, nd = a, False, 0.0, 0, 0
    if i < b and (buf[i] == 45 or buf[i] == 43):
        neg = buf[i] == 45
        i += 1
    dot = False
    while i < b and buf[i] != 101 and buf[i] != 69:
        c = buf[i]
        if c == 46 and not dot:
            dot = True
        elif 48 <= c <= 57:
            m = m * 10.0 + (c - 48)
            nd += 1
            if dot:
                scale -= 1
        else:
            return np.nan
        i += 1
    if nd == 0:
        return np.nan
    if i < b:                                   # exponent
        i += 1
        eneg = i < b and buf[i] == 45
        if i < b and (buf[i] == 45 or buf[i] == 43):
            i += 1
        if i == b:
            return np.nan
        e = 0
        while i < b:
            if not 48 <= buf[i] <= 57:
                return np.nan
            e = e * 10 + (buf[i] - 48)
            i += 1
        scale += -e if eneg else e
    v = m * 10.0 ** scale
    return -v if neg else v


@njit(cache=True, nogil=True)
def _parse(buf, hashes, kind, index, dims, S, D, feasign_first, fill,
           label, dense, lengths, tok_val, tok_bag):
    """Parse whole lines of buf.  Returns (rows, tokens, bad lines, skipped tokens)."""
    n_rows, n_tok, n_bad, n_skip = 0, 0, 0, 0
    seen = np.zeros(dims.size, np.int64)          # values taken per dense name on this line
    p, end = 0, buf.size
    while p < end:
        q = p
        while q < end and buf[q] != 10:
            q += 1
        r, t0, ok, has_label = n_rows, n_tok, True, False
        for k in range(S):
            lengths[r, k] = 0
        for k in range(D):
            dense[r, k] = fill[k]
        seen[:] = 0
        i = p
        while i < q and ok:
            while i < q and (buf[i] == 32 or buf[i] == 9 or buf[i] == 13):
                i += 1
            if i >= q:
                break
            j, c = i, -1
            while j < q and buf[j] != 32 and buf[j] != 9 and buf[j] != 13:
                if buf[j] == 58 and c < 0:
                    c = j
                j += 1
            if c <= i or c >= j - 1:
                ok = False
                break
            na, nb, va, vb = (c + 1, j, i, c) if feasign_first else (i, c, c + 1, j)
            h = _FNV_OFFSET
            for x in range(na, nb):
                h = (h ^ np.uint64(buf[x])) * _FNV_PRIME
            lo, hi = 0, hashes.size
            while lo < hi:
                mid = (lo + hi) // 2
                if hashes[mid] < h:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == hashes.size or hashes[lo] != h:
                n_skip += 1
            elif kind[lo] == KIND_SPARSE:
                v = np.uint64(0)
                for x in range(va, vb):
                    d = np.int64(buf[x]) - 48
                    if d < 0 or d > 9:
                        ok = False
                        d = 0
                    v = v * np.uint64(10) + np.uint64(d)
                tok_val[n_tok] = v
                tok_bag[n_tok] = index[lo]
                lengths[r, index[lo]] += 1
                n_tok += 1
            elif kind[lo] == KIND_DENSE:
                if seen[lo] < dims[lo]:
                    dense[r, index[lo] + seen[lo]] = _float(buf, va, vb)
                    ok = ok and dense[r, index[lo] + seen[lo]] == dense[r, index[lo] + seen[lo]]
                seen[lo] += 1
            else:
                ok = ok and vb == va + 1 and (buf[va] == 48 or buf[va] == 49) and not has_label
                label[r] = buf[va] - 48
                has_label = True
            i = j
        if q > p and ok and has_label:
            n_rows += 1
        elif q > p:
            n_bad += 1
            n_tok = t0
        p = q + 1
    return n_rows, n_tok, n_bad, n_skip


@njit(cache=True, nogil=True)
def _place(lengths, tok_val, tok_bag, n_rows, n_tok, offsets, out):
    """Counting sort of the tokens (file order) into example-major bags."""
    S = lengths.shape[1]
    offsets[0] = 0
    for r in range(n_rows):
        for k in range(S):
            offsets[r * S + k + 1] = offsets[r * S + k] + lengths[r, k]
    pos = offsets[:-1].copy()
    r, left = 0, 0
    for t in range(n_tok):                      # tokens are in line order: walk the lines
        while left == 0:
            left = offsets[(r + 1) * S] - offsets[r * S]
            if left == 0:
                r += 1
            else:
                break
        b = r * S + tok_bag[t]
        out[pos[b]] = tok_val[t]
        pos[b] += 1
        left -= 1
        if left == 0:
            r += 1


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x):
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class SlotTextReader:
    """Iterable of Batch-contract tuples over slot text files, as described above."""

    def __init__(self, files, batch_size, schema, hash_bucket=0, prefetch=True):
        if schema.format != "slot":
            raise SystemExit(f"torch_ref: format {schema.format!r} needs mpips's schema reader "
                             "(issue 20); this fallback reads slot text only")
        self.files, self.batch_size, self.hash_bucket = resolve_paths(files), batch_size, hash_bucket
        self.prefetch = prefetch
        self.S, self.D = schema.n_sparse, schema.n_dense
        names, kind, index, dims, fill, off = [], [], [], [], [], 0
        if schema.label:
            names.append(schema.label), kind.append(KIND_LABEL), index.append(0), dims.append(0)
        for g in schema.dense:
            for nm in g.names:
                names.append(nm), kind.append(KIND_DENSE), index.append(off), dims.append(g.dim)
                fill += [g.fill] * g.dim
                off += g.dim
        for k, nm in enumerate(schema.sparse_names):
            names.append(nm), kind.append(KIND_SPARSE), index.append(k), dims.append(0)
        h = np.array([_fnv(n.encode()) for n in names], np.uint64)
        if np.unique(h).size != h.size:
            raise SystemExit("torch_ref: two slot names share a 64-bit FNV hash; rename one")
        o = np.argsort(h)
        self.hashes, self.kind = h[o], np.array(kind, np.int64)[o]
        self.index, self.dims = np.array(index, np.int64)[o], np.array(dims, np.int64)[o]
        self.fill = np.array(fill, np.float64)
        self.feasign_first = schema.token_order == "feasign:slot"
        self.salts = np.array(schema.feasign_salts(), np.uint64)
        self.raw_ids = schema.raw_ids
        self.rows = self.bad_lines = self.skipped_tokens = 0

    def _ids(self, v, n):
        if self.hash_bucket:
            return (v % np.uint64(self.hash_bucket)).astype(np.int64)
        if self.raw_ids:
            return v.view(np.int64)
        return v  # mixed with the salt in _chunks (needs the slot of each id)

    def _chunks(self):
        """(label, dense, offsets, ids) per chunk of whole lines."""
        S, D = self.S, self.D
        for path in self.files:
            with open(path, "rb") as f:
                rest = b""
                while True:
                    data = f.read(CHUNK_BYTES)
                    buf = rest + data
                    if not data:
                        cut = len(buf)
                    else:
                        cut = buf.rfind(b"\n") + 1
                        if cut == 0:
                            rest = buf
                            continue
                    rest = buf[cut:]
                    if cut:
                        yield self._parse_buf(np.frombuffer(buf[:cut], np.uint8), S, D)
                    if not data:
                        break

    def _parse_buf(self, b, S, D):
        lines = int(np.count_nonzero(b == 10)) + 1
        label = np.empty(lines, np.float32)
        dense = np.empty((lines, D), np.float32)
        lengths = np.empty((lines, S), np.int64)
        ntok = int(np.count_nonzero(b == 58))
        tok_val = np.empty(ntok, np.uint64)
        tok_bag = np.empty(ntok, np.int64)
        n, nt, bad, skip = _parse(b, self.hashes, self.kind, self.index, self.dims, S, D,
                                  self.feasign_first, self.fill, label, dense, lengths,
                                  tok_val, tok_bag)
        self.rows += n
        self.bad_lines += bad
        self.skipped_tokens += skip
        offsets = np.empty(n * S + 1, np.int64)
        ids = np.empty(nt, np.uint64)
        _place(lengths, tok_val, tok_bag, n, nt, offsets, ids)
        if not self.hash_bucket and not self.raw_ids:
            slot = np.repeat(np.tile(np.arange(S), n), np.diff(offsets))
            with np.errstate(over="ignore"):
                ids = _splitmix(ids + self.salts[slot] * _GOLDEN).view(np.int64)
        else:
            ids = self._ids(ids, n)
        return label[:n], dense[:n], offsets, ids

    def _batches(self):
        B, S = self.batch_size, self.S
        pend = []
        count = 0
        for c in self._chunks():
            pend.append(c)
            count += c[0].size
            while count >= B:
                lab, den, off, ids = _concat(pend, S)
                k = B * S
                yield lab[:B], den[:B], off[:k + 1], ids[:off[k]]
                pend = [(lab[B:], den[B:], off[k:] - off[k], ids[off[k]:])]
                count -= B
        if count:
            yield _concat(pend, S)

    def __iter__(self):
        self.rows = self.bad_lines = self.skipped_tokens = 0
        if not self.prefetch:
            yield from self._batches()
            return
        q, stop = queue.Queue(maxsize=4), object()

        def work():
            try:
                for b in self._batches():
                    q.put(b)
                q.put(stop)
            except BaseException as e:  # handed to the consumer
                q.put(e)
        t = threading.Thread(target=work, daemon=True)
        t.start()
        while True:
            b = q.get()
            if b is stop:
                break
            if isinstance(b, BaseException):
                raise b
            yield b
        t.join()


def _concat(parts, S):
    if len(parts) == 1:
        return parts[0]
    lab = np.concatenate([p[0] for p in parts])
    den = np.concatenate([p[1] for p in parts])
    ids = np.concatenate([p[3] for p in parts])
    offs, base = [np.zeros(1, np.int64)], 0
    for p in parts:
        offs.append(p[2][1:] + base)
        base += int(p[2][-1])
    return lab, den, np.concatenate(offs), ids
