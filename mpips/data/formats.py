"""Text readers for any schema: the kernel arguments a Schema makes, and their results.

``TextFormat(schema, ...)`` turns a schema into the arrays its numba kernel takes (a key
table of slot/column names, per-slot salts or hash seeds and ``max_len``, per-dense-value
normalisation) and parses buffers of whole lines into ``criteo.ParseResult``:

* ``criteo`` (positional TSV, one value a column) -> one-hot rows, ``sparse`` (n, S);
* ``slot``, ``multislot``, ``csv`` -> CSR rows: ``sparse`` the ids of all bags,
  ``offsets`` (n*S + 1,) (see ``mpips.data.reader.Batch``).

Dense values come out of the kernels raw (float64, NaN where missing) and are finished
here per group: ``minmax`` (x - min) / diff (``--stats``, or Paddle's constants for Criteo's
I1..I13), ``log1p`` sign(x) * log1p(|x|), ``none`` x; missing -> the group's ``fill``.
The default Criteo schema does not come here: ``mpips.data.criteo`` and ``mpips.data.slot``
keep today's one-hot readers and fast paths.
"""
import csv
import difflib
import json

import numpy as np

from mpips.data import criteo
from mpips.kernels import bag_common as B
from mpips.kernels import csv_parse as CS
from mpips.kernels import multislot_parse as MS
from mpips.kernels import slot_bags as SB
from mpips.kernels import tsv_parse as K
from mpips.schema import Schema

RAW_NORM_ROWS = 3  # kernels given (3, D) [0, 1, nan] write raw values, NaN when empty
_CRITEO_DENSE = tuple(f"I{k}" for k in range(1, 14))
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------- key table
def _fnv(data: bytes) -> int:
    h = int(K.FNV1A_OFFSET)
    for b in data:
        h = ((h ^ b) * int(K.FNV1A_PRIME)) & _MASK64
    return h


def key_table(entries):
    """Name lookup arrays for the kernels: ``entries`` = [(name, kind, index, dim)].

    Returns (kbytes uint8, koff (K+1,) int64, tab (T,) int64, kinfo (K, 3) int64): see
    ``mpips.kernels.bag_common.find_key``.  Later entries of a repeated name are dropped.
    """
    names = [e[0].encode() for e in entries]
    size = 8
    while size < 2 * max(len(names), 1):
        size *= 2
    tab = np.full(size, -1, dtype=np.int64)
    for k, raw in enumerate(names):
        j = _fnv(raw) & (size - 1)
        while tab[j] >= 0 and names[tab[j]] != raw:
            j = (j + 1) & (size - 1)
        if tab[j] < 0:
            tab[j] = k
    kbytes = np.frombuffer(b"".join(names) or b"\0", dtype=np.uint8).copy()
    koff = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in names], out=koff[1:])
    kinfo = np.array([e[1:] for e in entries], dtype=np.int64).reshape(-1, 3)
    return kbytes, koff, tab, kinfo


def schema_keys(schema: Schema, extra=()):
    """(entries, names): the label, dense and sparse names of ``schema`` as key entries."""
    entries = [(name, B.KIND_LABEL, t, 1) for t, name in enumerate(schema.labels)]
    pos = 0
    for g in schema.dense:
        for name in g.names:
            entries.append((name, B.KIND_DENSE, pos, g.dim))
            pos += g.dim
    entries += [(name, B.KIND_SPARSE, s, 1) for s, name in enumerate(schema.sparse_names)]
    entries += [(name, B.KIND_SKIP, 0, 0) for name in extra]
    return entries, [e[0] for e in entries]


# ---------------------------------------------------------------- dense values
class DenseFinish:
    """Per dense value: normalisation and fill of the raw float64 kernel output."""

    def __init__(self, schema: Schema, cont_min=None, cont_diff=None):
        D = schema.n_dense
        norms = schema.dense_options("norm")
        self.fill = np.array(schema.dense_options("fill"), dtype=np.float64)  # (D,)
        self.minmax = np.array([n == "minmax" for n in norms], dtype=bool)
        self.log1p = np.array([n == "log1p" for n in norms], dtype=bool)
        self.lo, self.diff = np.zeros(D), np.ones(D)
        if self.minmax.any():
            if cont_min is None and cont_diff is None and schema.dense_names != _CRITEO_DENSE:
                groups = [list(g.names)[:3] for g in schema.dense if g.norm == "minmax"]
                raise ValueError(
                    f"dense inputs {groups} use norm = \"minmax\", which needs statistics: "
                    f"give --stats FILE (JSON with cont_min and cont_diff lists of {D} "
                    f"numbers), or set norm = \"log1p\" or \"none\" in the schema")
            norm = criteo.make_norm(cont_min, cont_diff, D)
            self.lo, self.diff = norm[0], norm[1]

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        """(n, D) float64 raw (NaN missing) -> (n, D) float32 normalised and filled."""
        out = raw.copy()
        if self.minmax.any():
            out[:, self.minmax] = (raw[:, self.minmax] - self.lo[self.minmax]) / self.diff[self.minmax]
        if self.log1p.any():
            x = raw[:, self.log1p]
            out[:, self.log1p] = np.sign(x) * np.log1p(np.abs(x))
        missing = np.isnan(raw)
        if missing.any():
            out = np.where(missing, self.fill, out)
        return out.astype(np.float32)


# ---------------------------------------------------------------- bad lines
def describe_bad(reason: int, detail: int, names, fmt: str, has_label=True) -> str:
    """Words for a bad-line record of a bag reader; ``names`` are its key names."""
    def name(k):
        return repr(names[k]) if 0 <= k < len(names) else f"#{k}"
    if reason == B.BAD_TOKEN:
        return f"token {detail + 1} has no ':' (slot text is key:value tokens)"
    if reason == B.BAD_VALUE:
        return f"bad value of {name(detail)}"
    if reason == B.BAD_DENSE_DIM:
        return f"dense slot {name(detail)} appears neither 0 nor dim times"
    if reason == B.BAD_NO_LABEL:
        t, times = detail >> 32, detail & 0xFFFFFFFF
        which = f"label {name(t)}" if t else "the label"
        return f"{which} appears {times} times (once a line)"
    if reason == B.BAD_COLUMNS:
        return f"expected {len(names)} columns as the header, found {detail}"
    if reason == B.BAD_QUOTE:
        return f"bad quoting in column {name(detail)}"
    if reason == B.BAD_COUNT:
        return f"field {name(detail)}: count missing, not an integer, or beyond the line"
    if reason == B.BAD_EXTRA:
        return f"{detail} tokens after the last field"
    if fmt == "criteo" and reason == K.BAD_INT and 0 < detail <= len(names):
        return f"dense field {names[detail - 1]} is not a number"
    return criteo.describe_bad(reason, detail, has_label)


DELIMITERS = (",", "\t", ";", "|", " ")  # tried when a header does not fit the schema's


def other_delimiter(header: str, need, delimiter: str):
    """A delimiter other than ``delimiter`` on which ``header`` holds every name of ``need``
    (None if there is none)."""
    for d in DELIMITERS:
        if d == delimiter:
            continue
        try:
            cols = next(csv.reader([header], delimiter=d), [])
        except csv.Error:
            continue
        if len(cols) > 1 and all(n in cols for n in need):
            return d
    return None


def delimiter_for(line: str, n: int, delimiter: str):
    """A delimiter other than ``delimiter`` that splits ``line`` into ``n`` > 1 fields."""
    for d in DELIMITERS:
        if d != delimiter and n > 1 and len(next(csv.reader([line], delimiter=d), [])) == n:
            return d
    return None


def multislot_values(line: bytes, f: int):
    """The values of field ``f`` of a MultiSlot line (``count v1 .. vcount`` per field),
    space-separated, or None."""
    toks, pos, vals = line.split(), 0, None
    for _ in range(f + 1):
        if pos >= len(toks) or not toks[pos].isdigit():
            return None
        c = int(toks[pos])
        vals, pos = toks[pos + 1:pos + 1 + c], pos + 1 + c
    return b" ".join(vals) if vals else None


def shown(value) -> str:
    """A field's bytes as a message shows them: repr of the text, cut at 40 characters."""
    t = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return repr(t if len(t) <= 40 else t[:37] + "...")


def field_of(line: bytes, k: int, delim: bytes = b"\t"):
    """Field ``k`` of a delimited line, or None."""
    fields = line.split(delim)
    return fields[k] if 0 <= k < len(fields) else None


def slot_value(line: bytes, name: str, value_last: bool = True):
    """The value of the first token of slot ``name`` in a slot line, or None."""
    for tok in line.split():
        key, _, val = tok.rpartition(b":") if not value_last else tok.partition(b":")
        if not value_last:
            key, val = val, key
        if key.decode("utf-8", "replace") == name:
            return val
    return None


# ---------------------------------------------------------------- the formats
class TextFormat:
    """Parses buffers of whole lines of a (non-default) schema's text format."""

    def __init__(self, schema: Schema, *, has_label=True, hash_bucket=0, cont_min=None,
                 cont_diff=None, pad=True):
        self.schema, self.bucket, self.pad = schema, int(hash_bucket), pad
        self.has_label = bool(has_label and schema.label)
        self.finish = DenseFinish(schema, cont_min, cont_diff)
        self.S, self.D = schema.n_sparse, schema.n_dense
        self.max_len = np.array(schema.max_len_codes(), dtype=np.int64)  # <0: keep last
        self.seeds = np.array(schema.hash_seeds(), dtype=np.uint64)
        self.salts = np.array([s & _MASK64 for s in schema.feasign_salts()], dtype=np.uint64)
        entries, self.names = schema_keys(schema)
        self.keys = key_table(entries)
        self.needs_header = schema.format == "csv" and schema.header
        self.seps = np.array([ord(x) if x else -1 for x in schema.slot_options("separator")],
                             dtype=np.int64)
        na = [x.encode() for x in schema.na_values]
        self.na = (np.frombuffer(b"".join(na) or b"\0", dtype=np.uint8).copy(),
                   np.cumsum([0] + [len(x) for x in na]).astype(np.int64))
        self.entries = entries
        if schema.format == "csv" and not schema.header:  # columns: fields, or label,
            cols = list(schema.fields) or self.names       # dense, sparse
            self.colinfo, self.names = self._columns(cols, "(no header)")
        if schema.format == "criteo":
            self.names = list(schema.dense_names)
        if schema.format == "multislot":
            info = {e[0]: e[1:] for e in entries}
            self.finfo = np.array([info.get(f, (B.KIND_SKIP, 0, 0)) for f in schema.fields],
                                  dtype=np.int64).reshape(-1, 3)
            self.names = list(schema.fields)

    def describe(self, reason, detail, line: bytes | None = None) -> str:
        """Words for a bad-line record; with the ``line``, a bad value is shown."""
        text = describe_bad(reason, detail, self.names, self.schema.format, self.has_label)
        value = None if line is None else self.value_of(reason, detail, line)
        return text if value is None else f"{text}: {shown(value)}"

    def value_of(self, reason, detail, line: bytes):
        """The offending value of a bad line, when the record names one (else None)."""
        fmt = self.schema.format
        if fmt == "csv" and reason == B.BAD_VALUE:
            text = line.decode("utf-8", "replace")
            try:
                cols = next(csv.reader([text], delimiter=self.schema.delimiter), [])
            except csv.Error:
                return None
            return cols[detail] if detail < len(cols) else None
        if fmt == "slot" and reason == B.BAD_VALUE and 0 <= detail < len(self.names):
            return slot_value(line, self.names[detail],
                              self.schema.token_order == "slot:feasign")
        if fmt == "multislot" and reason == B.BAD_VALUE:
            return multislot_values(line, detail)
        if fmt == "criteo" and reason in (K.BAD_INT, K.BAD_LABEL):
            k = detail if reason == K.BAD_INT else 0
            return field_of(line, k - (0 if self.has_label else 1),
                            self.schema.delimiter.encode())
        return None

    def parse(self, data) -> criteo.ParseResult:
        buf = criteo.as_uint8(data)
        if self.schema.format == "criteo":
            return self._criteo(buf)
        if self.schema.format == "multislot":
            return self._multislot(buf)
        if self.schema.format == "csv":
            return self._csv(buf)
        return self._slot(buf)

    # ---- csv
    def with_header(self, line: bytes, path: str):
        """Read the header ``line`` of ``path``: a parse function for the rest of the file."""
        text = line.decode("utf-8", errors="replace").lstrip("\ufeff").rstrip("\r\n")
        try:
            cols = next(csv.reader([text], delimiter=self.schema.delimiter, strict=True), [])
        except csv.Error as e:
            raise ValueError(f"{path}: header line is not valid delimited text ({e})") from None
        self.colinfo, self.names = self._columns(cols, path, text)
        return lambda fmt, data: self._csv(criteo.as_uint8(data))

    def _columns(self, cols, where, header=None):
        """(colinfo (C, 3), column names) for the columns ``cols`` of a file (its ``header``
        line, to suggest another delimiter when the schema's does not fit)."""
        info = {e[0]: e[1:] for e in self.entries}
        need = [e[0] for e in self.entries if e[1] != B.KIND_LABEL or self.has_label]
        missing = [n for n in need if n not in cols]
        if missing:
            other = None if header is None else other_delimiter(header, need,
                                                                 self.schema.delimiter)
            if other is not None:
                raise ValueError(
                    f"{where}: the header does not split into the schema's columns on "
                    f"delimiter {self.schema.delimiter!r}, but does on {other!r}: set "
                    f"delimiter = {json.dumps(other)} in the schema")
            near = {n: difflib.get_close_matches(n, cols, n=1) for n in missing[:5]}
            means = "; ".join(f"{n!r}: did you mean {m[0]!r}?" for n, m in near.items() if m)
            raise ValueError(f"{where}: the header has no column {missing[:5]} that the schema "
                             f"names{f' ({means})' if means else ''} (header: "
                             f"{', '.join(cols[:12])}{' ...' if len(cols) > 12 else ''}); "
                             f"fix the schema's names")
        seen = set()
        rows = []
        for c in cols:
            rows.append(info.get(c, (B.KIND_SKIP, 0, 0)) if c not in seen else (B.KIND_SKIP, 0, 0))
            seen.add(c)
        return np.array(rows, dtype=np.int64).reshape(-1, 3), list(cols)

    def _csv(self, buf):
        out, scratch, bad, counts = self._outputs(buf)
        scratch = scratch[:4] + (np.empty(buf.size + 1, dtype=np.uint8),)
        opts = np.array([self.has_label, self.bucket, ord(self.schema.delimiter)],
                        dtype=np.int64)
        n = CS.parse_csv(buf, self.colinfo, (self.seeds, self.max_len, self.seps) + self.na,
                         opts, out, scratch, bad, counts)
        return self._result(n, out, bad, counts)

    def _criteo(self, buf):
        norm = np.zeros((RAW_NORM_ROWS, self.D))
        norm[1], norm[2] = 1.0, np.nan
        r = criteo.parse_tsv_bytes(buf, has_label=self.has_label, hash_bucket=self.bucket,
                                   norm=norm, pad=self.pad, seeds=self.seeds)
        r.dense = self.finish(r.dense)
        return r

    def _outputs(self, buf):
        cap = int(np.count_nonzero(buf == 10)) + 1 if buf.size else 0
        icap = buf.size // 2 + 1
        offsets = np.empty(cap * self.S + 1, dtype=np.int64)
        offsets[0] = 0
        out = (np.empty((cap, self.D)), np.empty((cap, self.schema.n_tasks), dtype=np.float32),
               np.empty(icap, dtype=np.int64), offsets)
        scratch = (np.empty(icap, dtype=np.int64), np.empty(icap, dtype=np.int64),
                   np.empty(self.S, dtype=np.int64), np.empty(self.S, dtype=np.int64),
                   np.empty(self.keys[3].shape[0], dtype=np.int64))
        bad = np.empty((criteo.MAX_BAD_RECORDS, 3), dtype=np.int64)
        return out, scratch, bad, np.zeros(K.N_COUNTS, dtype=np.int64)

    def _result(self, n, out, bad, counts):
        dense, label, ids, offsets = out
        label = label[:, 0] if label.shape[1] == 1 else label      # (n,) or (n, T)
        offsets = offsets[:n * self.S + 1].copy()
        res = criteo.parse_result(n, self.finish(dense[:n]), ids[:offsets[-1]].copy(), label,
                                  bad, counts, offsets)
        return res

    def _opts(self):
        return np.array([self.has_label, self.bucket, self.schema.raw_ids,
                         self.schema.token_order == "feasign:slot"], dtype=np.int64)

    def _slot(self, buf):
        out, scratch, bad, counts = self._outputs(buf)
        n = SB.parse_slot_bags(buf, self.keys, (self.salts, self.max_len), self._opts(), out,
                               scratch, bad, counts)
        return self._result(n, out, bad, counts)

    def _multislot(self, buf):
        out, scratch, bad, counts = self._outputs(buf)
        n = MS.parse_multislot(buf, self.finfo, (self.salts, self.max_len), self._opts(), out,
                               scratch, bad, counts)
        return self._result(n, out, bad, counts)
