"""The feature schema: which inputs a line has, made once and passed everywhere.

A schema names the label, the dense features and the sparse slots of an example, the
text format they are read from, and how each slot's bag of ids is pooled.  It is made once
(``Schema.criteo()`` by default, or ``load_schema(path)`` from ``--schema FILE``), stored in
every checkpoint and serving bundle (``to_dict`` / ``from_dict``), and compared at resume,
infer and export (``diff``).  Nothing else in mpips hard-codes 13 dense or 26 sparse inputs:
they come from ``schema.n_dense`` and ``schema.n_sparse``.

TOML keys (``--schema FILE``)::

    format = "csv"                # criteo | csv | slot | multislot
    delimiter = ","               # csv: field separator ("\\t" for TSV)
    header = true                 # csv: the first line names the columns
    token_order = "slot:feasign"  # slot: or "feasign:slot" (PaddleRec slot_dnn data)
    label = "click"               # the column or slot holding 0/1 ("" = no label); a list,
                                  # e.g. ["click", "purchase"], names several tasks (docs/tasks.md)
    fields = []                   # multislot: every input in line order, label included
    raw_ids = false               # slot/multislot: keep integer feasigns as they are (one
                                  # id space for all slots, as Paddle's single table)
    pipe_command = ""             # feed each data file to this command, read its stdout
    na_values = ["", "NA", "null", "NaN"]  # csv: dense values read as missing (the fill)

    [[dense]]
    names = ["I1", "I2"]          # columns (criteo/csv) or slots (slot/multislot)
    dim = 1                       # slot/multislot: values in each slot
    fill = 0.0                    # value of an empty field / missing slot
    norm = "minmax"               # minmax | log1p | none

    [[sparse]]
    names = ["site_id", "app_id"] # one slot per name; the options apply to each
    separator = "|"               # csv: several values in one column ("" = one value)
    max_len = 0                   # keep N ids of a bag (0 = all)
    keep = "first"                # which N ids max_len keeps: "first" | "last" (the newest
                                  # of a history written oldest first, as DIN's data is)
    pooling = "sum"               # sum | mean | attention
    query = ""                    # attention: the slot whose embedding is the query
    attention_units = [36]        # attention: hidden widths of the scoring MLP (relu)
    attention_softmax = false     # attention: softmax the scores over the bag
    table = ""                    # slots with the same table share one id space and rows
                                  # (the same raw id in any of them is the same row)

``fields`` also names the columns of a csv file without a header, in line order (a name
the schema does not use is skipped), e.g. PaddleRec's DIN sample
``hist_items;hist_cats;target_item;target_cat;label`` (docs/sequences.md).

Ids.  A slot is known by its name, so reordering the schema's entries changes no id:
text values are hashed from (slot seed, raw bytes), integer feasigns of slot/multislot
files are mixed with the slot's salt.  ``hash_seed`` and ``feasign_salt`` are chosen so that
Criteo's names keep today's ids exactly: ``C1..C26`` hash as slot byte 0..25 (see
``mpips.kernels.tsv_parse``) and the slot-format slots ``1..26`` (and Criteo's ``C1..C26``
when read from slot files) mix with salt 1..26 (see ``mpips.data.slot``).
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import re
import sys
from dataclasses import asdict, dataclass

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FORMATS = ("criteo", "csv", "slot", "multislot")
NORMS = ("minmax", "log1p", "none")
POOLINGS = ("sum", "mean", "attention")  # index = the pooling code the kernels take
KEEPS = ("first", "last")  # which ids max_len keeps
TOKEN_ORDERS = ("slot:feasign", "feasign:slot")
SCHEMA_VERSION = 1

_MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_CRITEO_SLOT = re.compile(r"C([1-9]|1[0-9]|2[0-6])")
_TOP_KEYS = ("format", "delimiter", "header", "token_order", "label", "fields", "raw_ids",
             "pipe_command", "dense", "sparse", "na_values")
NA_VALUES = ("", "NA", "null", "NaN")  # the default null tokens of dense columns


class SchemaError(ValueError):
    """A schema that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class DenseGroup:
    """Dense inputs sharing options: ``len(names) * dim`` values of the dense vector."""

    names: tuple  # column names (criteo/csv) or slot names (slot/multislot)
    dim: int = 1  # values per name (slot/multislot; 1 for columns)
    fill: float = 0.0  # value of an empty field or a missing slot
    norm: str = "minmax"  # minmax | log1p | none


@dataclass(frozen=True)
class SparseGroup:
    """Sparse slots sharing options; each name is one slot holding a bag of ids."""

    names: tuple
    separator: str = ""  # csv: values in one column are split on this ("" = one value)
    max_len: int = 0  # keep N ids of a bag (0 = all); truncations are counted
    pooling: str = "sum"  # sum | mean | attention
    keep: str = "first"  # the ids max_len keeps: the first N or the last N (the newest)
    query: str = ""  # attention: the slot whose pooled embedding is the query
    attention_units: tuple = (36,)  # attention: hidden widths of the scoring MLP
    attention_softmax: bool = False  # attention: softmax of the scores over the bag
    table: str = ""  # a shared embedding table: one id space for its slots ("" = own)


@dataclass(frozen=True)
class Schema:
    """A whole example layout.  Frozen: share it freely."""

    format: str = "criteo"
    dense: tuple = ()  # DenseGroup, in dense-vector order
    sparse: tuple = ()  # SparseGroup, in slot order
    label: object = "label"  # str (one task) or a tuple of >= 2 names (one per task)
    delimiter: str = "\t"
    header: bool = False
    token_order: str = "slot:feasign"
    fields: tuple = ()  # multislot: every input in line order
    raw_ids: bool = False
    pipe_command: str = ""
    na_values: tuple = NA_VALUES  # csv: dense values that are missing (-> the group's fill)

    # --- the Criteo default ------------------------------------------------------------
    @staticmethod
    @functools.lru_cache(maxsize=None)
    def criteo() -> "Schema":
        """13 integer columns I1..I13 (min-max with Paddle's constants) + 26 one-hot C1..C26."""
        return Schema(format="criteo",
                      dense=(DenseGroup(tuple(f"I{k}" for k in range(1, 14))),),
                      sparse=(SparseGroup(tuple(f"C{k}" for k in range(1, 27))),),
                      label="label")

    @property
    def is_criteo(self) -> bool:
        """True for the default Criteo layout (today's readers, ids and fast paths apply)."""
        return self == Schema.criteo()

    # --- sizes and per-input arrays ---------------------------------------------------
    @property
    def labels(self) -> tuple:
        """The label names, one per task, in order (() without a label)."""
        if isinstance(self.label, tuple):
            return self.label
        return (self.label,) if self.label else ()

    @property
    def n_tasks(self) -> int:
        """Tasks T: the number of labels (1 without a label: scoring still gives one)."""
        return max(len(self.labels), 1)

    @property
    def dense_names(self) -> tuple:
        return tuple(n for g in self.dense for n in g.names)

    @property
    def sparse_names(self) -> tuple:
        return tuple(n for g in self.sparse for n in g.names)

    @property
    def n_dense(self) -> int:
        """Width D of the dense vector."""
        return sum(len(g.names) * g.dim for g in self.dense)

    @property
    def n_sparse(self) -> int:
        """Number S of sparse slots."""
        return sum(len(g.names) for g in self.sparse)

    @property
    def one_hot(self) -> bool:
        """Every slot holds exactly one id (batches may use the (n, S) fast path)."""
        return self.format == "criteo"  # a Criteo column holds one value; empty is a value

    def slot_options(self, what: str) -> list:
        """Per slot, in slot order: ``what`` of its group (``pooling``, ``max_len``, ``separator``)."""
        return [getattr(g, what) for g in self.sparse for _ in g.names]

    def pooling_codes(self) -> list:
        """Per slot: 0 = sum, 1 = mean, 2 = attention (the codes the network takes)."""
        return [POOLINGS.index(p) for p in self.slot_options("pooling")]

    def attention(self) -> list:
        """Per attention-pooled slot: (slot, query slot, hidden widths, softmax)."""
        names = self.sparse_names
        return [(names.index(n), names.index(g.query), tuple(g.attention_units),
                 bool(g.attention_softmax))
                for g in self.sparse if g.pooling == "attention" for n in g.names]

    def max_len_codes(self) -> list:
        """Per slot: max_len, negative when the last N ids are kept (the parsers' code)."""
        return [-g.max_len if g.keep == "last" else g.max_len
                for g in self.sparse for _ in g.names]

    def id_space(self, name: str) -> str:
        """The name a slot's ids are hashed under: its table's, or its own."""
        for g in self.sparse:
            if name in g.names:
                return f"table:{g.table}" if g.table else name
        return name

    def dense_options(self, what: str) -> list:
        """Per dense value (length n_dense): ``fill`` or ``norm`` of its group."""
        return [getattr(g, what) for g in self.dense for _ in range(len(g.names) * g.dim)]

    def hash_seeds(self) -> list:
        """Per slot: the uint64 FNV state that raw bytes of that slot are hashed from."""
        return [hash_seed(self.id_space(n)) for n in self.sparse_names]

    def feasign_salts(self) -> list:
        """Per slot: the salt integer feasigns of that slot are mixed with."""
        return [feasign_salt(self.id_space(n)) for n in self.sparse_names]

    # --- storage and comparison -------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain JSON-able dict (stored in checkpoints and bundles)."""
        d = asdict(self)
        d["version"] = SCHEMA_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_dict(d: dict | None) -> "Schema":
        """Inverse of ``to_dict``; ``None`` (a file written before schemas) is Criteo."""
        if d is None:
            return Schema.criteo()
        d = dict(d)
        d.pop("version", None)
        return _build(d, "stored schema")

    def describe(self) -> str:
        """One line for the start of a run: format, label, dense and sparse inputs."""
        sp = self.slot_options("pooling")
        n_mean, n_att = sum(p == "mean" for p in sp), sum(p == "attention" for p in sp)
        kind = "one-hot" if self.one_hot else (
            f"bags ({n_mean} mean, {len(sp) - n_mean - n_att} sum"
            + (f", {n_att} attention)" if n_att else ")"))
        lab = ", ".join(self.labels) or "(none)"
        return (f"schema: format {self.format}, label{'s' if len(self.labels) > 1 else ''} "
                f"{lab}, "
                f"{self.n_dense} dense, {self.n_sparse} sparse slots {kind}"
                + (f", pipe_command {self.pipe_command!r}" if self.pipe_command else ""))

    def diff(self, other: "Schema") -> str:
        """'' when equal in everything that changes stored numbers, else the first difference."""
        a, b = self.to_dict(), other.to_dict()
        for k in ("pipe_command",):  # how bytes reach the reader does not change the numbers
            a.pop(k), b.pop(k)
        for k in sorted(set(a) | set(b), key=lambda k: (_TOP_KEYS + ("version",)).index(k)):
            if a.get(k) != b.get(k):
                return _first_difference(f"schema {k}", a.get(k), b.get(k))
        return ""


def _first_difference(where, a, b):
    """'where[i].key: a vs b' at the first place two JSON-like values differ (into lists of
    equal length and into dicts), so that a long list of slots names the one field."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if len(a) == len(b):
            return _first_difference(f"{where}[{i}]", a[i], b[i])
        x, y = (v[i] if i < len(v) else None for v in (a, b))
        return (f"{where}: {len(a)} entries vs {len(b)}, the first different [{i}]: "
                f"{_short(x, 60)} vs {_short(y, 60)}")
    if isinstance(a, dict) and isinstance(b, dict):
        k = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
        return _first_difference(f"{where}.{k}", a.get(k), b.get(k))
    return f"{where}: {_short(a)} vs {_short(b)}"


def stored_schema(record: dict) -> Schema:
    """The schema a checkpoint or bundle manifest stores (key ``schema``); one written
    before schemas (no key) is Criteo's."""
    return Schema.from_dict(record.get("schema"))


def check_same(stored: Schema, current: Schema, what: str) -> None:
    """Raise SchemaError (one line) when ``current`` differs from the ``stored`` schema of
    ``what`` (a checkpoint or bundle) in anything that changes its numbers."""
    d = stored.diff(current)
    if d:
        raise SchemaError(f"{what} was saved with another feature schema: {d} (saved vs this "
                          f"run's); use the --schema it was saved with")


def _short(v, width=120):
    s = json.dumps(v)
    return s if len(s) <= width else s[:width - 3] + "..."


# --- ids ------------------------------------------------------------------------------
def hash_seed(name: str) -> int:
    """uint64 FNV-1a state after the slot prefix: Criteo ``C<k>`` is the byte k-1 (today's ids)."""
    m = _CRITEO_SLOT.fullmatch(name)
    if m:
        return ((_FNV_OFFSET ^ (int(m.group(1)) - 1)) * _FNV_PRIME) & _MASK64
    h = _FNV_OFFSET
    for b in b"\xff" + name.encode() + b"\x00":  # 0xff never starts a Criteo prefix
        h = ((h ^ b) * _FNV_PRIME) & _MASK64
    return h


def feasign_salt(name: str) -> int:
    """Salt of integer feasigns: slot ``k`` (a decimal name) or Criteo ``C<k>`` is k."""
    m = _CRITEO_SLOT.fullmatch(name)
    if m:
        return int(m.group(1))
    if re.fullmatch(r"[0-9]+", name) and int(name) < (1 << 63):
        return int(name)
    return hash_seed(name) | (1 << 63)  # named slots: a salt no decimal name below 2**63 has


# --- loading ----------------------------------------------------------------------------
_LOADED = {}    # absolute path -> (the file's stat identity, Schema): each file read once


def _read_toml(path: str) -> dict:
    """The one place a schema file is read (tests count the calls)."""
    with open(path, "rb") as f:
        return tomllib.load(f)


def load_schema(path: str) -> Schema:
    """Read a TOML schema file; errors name the file and the fix.  A file is read once per
    process: later calls (config checks, the run plan, resume and checkpoint checks) get the
    same Schema while the file is unchanged (same inode, size and times)."""
    key = os.path.abspath(path)
    try:
        st = os.stat(path)
        ident = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = _LOADED.get(key)
        if hit is not None and hit[0] == ident:
            return hit[1]
        d = _read_toml(path)
    except OSError as e:
        raise SchemaError(f"cannot read schema file {path}: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        raise SchemaError(f"schema file {path} is not valid TOML: {e}")
    schema = _build(d, f"schema file {path}")
    _LOADED[key] = (ident, schema)
    return schema


def _suggest(key, known):
    near = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {near[0]!r}?)" if near else f" (known keys: {', '.join(known)})"


def _group(raw, cls, where, i):
    if not isinstance(raw, dict):
        raise SchemaError(f"{where}: each [[{cls.__name__}]] entry must be a table")
    known = tuple(f.name for f in cls.__dataclass_fields__.values())
    for k in raw:
        if k not in known:
            raise SchemaError(f"{where}: unknown key {k!r} in entry {i + 1}{_suggest(k, known)}")
    names = raw.get("names")
    if isinstance(names, str):
        names = [names]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise SchemaError(f"{where}: entry {i + 1} needs names = [\"...\", ...] (non-empty strings)")
    raw = {**raw, "names": tuple(names)}
    if isinstance(raw.get("attention_units"), list):
        raw["attention_units"] = tuple(raw["attention_units"])
    return cls(**raw)


def _build(d: dict, where: str) -> Schema:
    for k in d:
        if k not in _TOP_KEYS:
            raise SchemaError(f"{where}: unknown key {k!r}{_suggest(k, _TOP_KEYS)}")
    if "na_values" in d and d.get("format", "criteo") != "csv" and \
            tuple(d["na_values"] or ()) != NA_VALUES:
        raise SchemaError(f"{where}: na_values is read by the csv format only (a "
                          f"{d.get('format', 'criteo')} file's missing dense value is an "
                          f"empty field or an absent slot)")
    dense = tuple(_group(g, DenseGroup, where, i) for i, g in enumerate(d.get("dense", [])))
    sparse = tuple(_group(g, SparseGroup, where, i) for i, g in enumerate(d.get("sparse", [])))
    fmt = d.get("format", "criteo")
    defaults = {"delimiter": "\t" if fmt == "criteo" else ",", "header": fmt == "csv",
                "label": "label" if fmt == "criteo" else "click"}
    s = Schema(format=fmt, dense=dense, sparse=sparse,
               label=_label(d.get("label", defaults["label"]), where),
               delimiter=d.get("delimiter", defaults["delimiter"]),
               header=bool(d.get("header", defaults["header"])),
               token_order=d.get("token_order", "slot:feasign"),
               fields=tuple(d.get("fields", ())), raw_ids=bool(d.get("raw_ids", False)),
               pipe_command=d.get("pipe_command", ""),
               na_values=_na_values(d.get("na_values", NA_VALUES), where))
    validate(s, where)
    return s


def _label(raw, where):
    """``label``: a name (one task) or a list of names (a tuple; one name is the str)."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (list, tuple)) and raw and all(isinstance(x, str) and x for x in raw):
        return raw[0] if len(raw) == 1 else tuple(raw)
    raise SchemaError(f"{where}: label must be a column/slot name or a non-empty list of "
                      f"names, e.g. label = [\"click\", \"purchase\"]; got {raw!r}")


def _na_values(raw, where):
    if isinstance(raw, str) or not all(isinstance(x, str) and not set(x) & set("\r\n")
                                       for x in raw):
        raise SchemaError(f"{where}: na_values must be a list of strings without line breaks, "
                          f"e.g. [\"\", \"NA\"]; got {raw!r}")
    return tuple(raw)


def validate(s: Schema, where: str = "schema") -> None:
    """Raise SchemaError naming the first impossible setting and its fix."""
    def bad(msg):
        raise SchemaError(f"{where}: {msg}")
    if s.format not in FORMATS:
        bad(f"format {s.format!r} is not one of {', '.join(FORMATS)}")
    if s.token_order not in TOKEN_ORDERS:
        bad(f"token_order {s.token_order!r} is not one of {', '.join(TOKEN_ORDERS)}")
    if len(s.delimiter) != 1 or s.delimiter in "\r\n\"":
        bad(f"delimiter must be one character other than CR, LF and '\"'; got {s.delimiter!r}")
    if not s.sparse and not s.dense:
        bad("declares no inputs: add [[dense]] and/or [[sparse]] entries")
    names = list(s.labels)
    names += list(s.dense_names) + list(s.sparse_names)
    seen: set = set()
    dup = sorted({n for n in names if n in seen or seen.add(n)})
    if dup:
        bad(f"input name(s) {dup} declared more than once (label, dense and sparse names are one namespace)")
    for g in s.dense:
        if g.norm not in NORMS:
            bad(f"dense norm {g.norm!r} is not one of {', '.join(NORMS)}")
        if not isinstance(g.dim, int) or g.dim < 1:
            bad(f"dense dim must be an integer >= 1; got {g.dim!r}")
        if g.dim != 1 and s.format in ("criteo", "csv"):
            bad(f"dense dim {g.dim} needs a slot or multislot format (a {s.format} column holds one value)")
        if not isinstance(g.fill, (int, float)) or g.fill != g.fill or abs(g.fill) == float("inf"):
            bad(f"dense fill must be a finite number; got {g.fill!r}")
    for g in s.sparse:
        if g.pooling not in POOLINGS:
            bad(f"sparse pooling {g.pooling!r} is not one of {', '.join(POOLINGS)}")
        if not isinstance(g.max_len, int) or g.max_len < 0:
            bad(f"sparse max_len must be an integer >= 0 (0 = keep all); got {g.max_len!r}")
        if g.separator and s.format != "csv":
            bad(f"sparse separator is for csv columns; {s.format} bags come from repeated slots or counts")
        if len(g.separator) > 1 or g.separator == s.delimiter:
            bad(f"sparse separator must be one character other than the delimiter; got {g.separator!r}")
        _check_sequence_options(s, g, bad)
    if s.format == "multislot":
        if not s.fields:
            bad("multislot needs fields = [...]: every input in line order, label included")
        fields = set(s.fields)
        missing = [n for n in names if n not in fields]
        if missing:
            bad(f"multislot fields do not list {missing}: add them in line order")
    elif s.fields and (s.format != "csv" or s.header):
        bad("fields is for the multislot format, or a csv file without a header "
            "(header = false): the columns in line order")
    elif s.fields:
        missing = [n for n in names if n not in set(s.fields)]
        if missing:
            bad(f"fields (the csv columns in line order) do not list {missing}: add them")
    if s.raw_ids and s.format not in ("slot", "multislot"):
        bad("raw_ids keeps integer feasigns; it needs the slot or multislot format")
    if s.format == "criteo" and s.label not in ("label", ""):
        bad("the criteo format's label is its first column: label = \"label\" (or \"\" for none;"
            " several labels need the csv, slot or multislot format)")


def _check_sequence_options(s: Schema, g: SparseGroup, bad) -> None:
    """The options of behaviour histories: keep, attention pooling and its query, table."""
    if g.keep not in KEEPS:
        bad(f"sparse keep {g.keep!r} is not one of {', '.join(KEEPS)}")
    if not isinstance(g.table, str):
        bad(f"sparse table must be a name (a string); got {g.table!r}")
    if g.pooling != "attention":
        if g.query:
            bad(f"slot {g.names[0]!r} names query = {g.query!r} but its pooling is "
                f"{g.pooling!r}: set pooling = \"attention\" or drop query")
        return
    if s.format == "criteo":
        bad("attention pooling needs bags of ids (a csv, slot or multislot format); a "
            "criteo column holds one id")
    if g.query not in s.sparse_names:
        bad(f"slot {g.names[0]!r}: query = {g.query!r} names no sparse slot (slots: "
            f"{', '.join(s.sparse_names[:8])}{' ...' if s.n_sparse > 8 else ''})")
    if g.query in g.names or dict(zip(s.sparse_names, s.slot_options("pooling")))[
            g.query] == "attention":
        bad(f"slot {g.names[0]!r}: the query slot {g.query!r} must be pooled by sum or "
            f"mean, not by attention")
    units = g.attention_units
    if not isinstance(units, tuple) or not units or not all(
            isinstance(u, int) and not isinstance(u, bool) and u >= 1 for u in units):
        bad(f"slot {g.names[0]!r}: attention_units must be a non-empty list of widths "
            f">= 1, e.g. [36]; got {units!r}")
    if not isinstance(g.attention_softmax, bool):
        bad(f"attention_softmax must be true or false; got {g.attention_softmax!r}")
