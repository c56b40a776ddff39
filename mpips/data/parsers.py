"""One text-line parser for the readers and the serving path.

``LineParser`` parses buffers of whole lines of a schema's text into
``criteo.ParseResult`` (rows, and a record per bad line) and says what is wrong with a
bad line.  The default Criteo schema has two formats, chosen per file by its first line
(``fmt="auto"``) or forced: ``tsv`` (``mpips.data.criteo``) and Paddle's ``slot`` lines
(``mpips.data.slot``); any other schema reads its own format
(``mpips.data.formats.TextFormat``: criteo, csv, slot, multislot text).

Two callers:
- ``mpips.data.reader.DataReader`` parses files through it, a chunk at a time;
- :func:`parse_lines` parses a list of single lines (``mpips.serving.Predictor``): every
  line gets a row, or says why it has none (blank, or the parser's reason).
"""
import copy

import numpy as np

from mpips.data import bags, criteo, formats, slot
from mpips.kernels.tsv_parse import BAD_INT as K_BAD_INT
from mpips.kernels.tsv_parse import BAD_LABEL as K_BAD_LABEL
from mpips.schema import Schema

SLOT_PREFIX = (b"click:", b"dense_feature:")   # a slot line, with or without its label


def detect_bytes(head: bytes) -> str:
    """'slot' if ``head`` (a file's first chunk) starts with 'click:' after blanks, else
    'tsv'."""
    return "slot" if head.lstrip(b"\r\n\t ").startswith(b"click:") else "tsv"


class LineParser:
    """Parses whole lines of ``schema``'s text (None: the default Criteo schema).

    fmt: the Criteo schema's format, 'auto' (by each file's first line), 'tsv' or 'slot';
    has_label: the lines have a label (Criteo TSV: the first column); hash_bucket: ids
    modulo this (0: full int64 ids); cont_min/cont_diff: dense statistics; pad: Criteo
    lines missing trailing fields are read with them empty (else bad lines).
    """

    def __init__(self, schema=None, *, fmt="auto", has_label=True, hash_bucket=0,
                 cont_min=None, cont_diff=None, pad=True):
        if fmt not in ("auto", "tsv", "slot"):
            raise ValueError(f"fmt must be 'auto', 'tsv' or 'slot'; got {fmt!r}")
        if hash_bucket < 0:
            raise ValueError(f"hash_bucket must be >= 0 (0 = full int64 ids); got {hash_bucket}")
        self.schema = Schema.criteo() if schema is None else schema
        self.fmt, self.has_label, self.bucket, self.pad = fmt, has_label, int(hash_bucket), pad
        self.text = None        # the reader of a non-default schema (formats.TextFormat)
        self.norm = None        # the Criteo schema's dense normalisation (3, 13)
        if self.schema.is_criteo:
            self.norm = criteo.make_norm(cont_min, cont_diff)
        else:
            if fmt != "auto":
                raise ValueError(f"fmt {fmt!r} names a Criteo reader; a {self.schema.format} "
                                 f"schema reads its own format (use fmt='auto')")
            self.text = formats.TextFormat(self.schema, has_label=has_label,
                                           hash_bucket=hash_bucket, cont_min=cont_min,
                                           cont_diff=cont_diff, pad=pad)

    @property
    def needs_header(self):
        """Whether a file's first line names its columns (a CSV schema with a header)."""
        return self.text is not None and bool(self.text.needs_header)

    def format_of(self, head: bytes) -> str:
        """'tsv' or 'slot' (the Criteo schema's, by ``head``, a file's first chunk, unless
        forced), else the schema's format."""
        if self.text is not None:
            return self.schema.format
        return detect_bytes(head) if self.fmt == "auto" else self.fmt

    def parse(self, fmt: str, data) -> criteo.ParseResult:
        """Parse ``data``, whole lines of format ``fmt`` (from ``format_of``)."""
        if self.text is not None:
            return self.text.parse(data)
        if fmt == "slot":
            return slot.parse_slot_bytes(data, hash_bucket=self.bucket)
        return criteo.parse_tsv_bytes(data, has_label=self.has_label, pad=self.pad,
                                      hash_bucket=self.bucket, norm=self.norm)

    def with_header(self, line: bytes, where: str):
        """Read the column names ``line`` (the first line of ``where``) of a CSV schema;
        returns the parse function (fmt, data) for the lines after it."""
        return self.text.with_header(line, where)

    def with_label(self, has_label):
        """This parser for Criteo lines with (True) or without their label column."""
        p = copy.copy(self)
        p.has_label = has_label
        return p

    def describe(self, reason: int, detail: int, line: bytes | None = None) -> str:
        """Words for a bad-line record (reason, detail) of ``parse``; with the ``line``, a
        bad value is shown."""
        if self.text is not None:
            return self.text.describe(reason, detail, line)
        text = criteo.describe_bad(reason, detail, self.has_label)
        value = None
        if line is not None and reason == criteo.BAD_SLOT_VALUE:
            toks = line.split()
            value = toks[detail] if detail < len(toks) else None
        elif line is not None and reason in (K_BAD_INT, K_BAD_LABEL) and (
                self.has_label or reason == K_BAD_INT):
            value = formats.field_of(line, detail - (0 if self.has_label else 1)
                                     if reason == K_BAD_INT else 0)
        return text if value is None else f"{text}: {formats.shown(value)}"


# ---------------------------------------------------------------------- single lines
def as_line(line) -> bytes:
    """A str or bytes line as bytes without its line end; a newline inside is an error."""
    b = line.encode() if isinstance(line, str) else bytes(line)
    if b.endswith(b"\n"):
        b = b[:-1]
    if b.endswith(b"\r"):
        b = b[:-1]
    if b"\n" in b:
        raise ValueError("a line must not contain a newline inside it")
    return b


def _parse_some(raw, index, parse, describe, ok, why):
    """The rows (a batch piece, or None) of lines ``raw[index]`` (none blank) parsed by
    ``parse(data)``; a bad line's ``ok`` is cleared and ``why`` says what is wrong with it.
    One parse when its bad lines fit its records, else parses of MAX_BAD_RECORDS lines."""
    if not len(index):
        return None
    res = parse(b"\n".join(raw[j] for j in index) + b"\n")
    if res.n_bad <= len(res.bad):
        groups = [(0, res)]
    else:                                   # more bad lines than recorded: find them in pieces
        step = criteo.MAX_BAD_RECORDS
        groups = [(lo, parse(b"\n".join(raw[j] for j in index[lo:lo + step]) + b"\n"))
                  for lo in range(0, len(index), step)]
    for lo, r in groups:
        for line, reason, detail in r.bad.tolist():
            ok[index[lo + line]] = False
            why[int(index[lo + line])] = describe(reason, detail)
    return bags.concat([(r.dense, r.sparse, r.label, r.offsets) for _, r in groups])


def _criteo_parts(raw, parser):
    """[(indices of lines, parse(data), describe(reason, detail))] of the Criteo schema's
    lines: a slot line without its ``click:`` token gets ``click:0``; TSV lines with and
    without their label column (39 or 38 tabs) are parsed apart."""
    first = next((b for b in raw if b.strip()), b"")
    fmt = parser.fmt
    if fmt == "slot" or (fmt == "auto" and first.lstrip().startswith(SLOT_PREFIX)):
        for j, b in enumerate(raw):
            if not b.lstrip().startswith(b"click:"):
                raw[j] = b"click:0 " + b
        p = parser.with_label(True)
        return [(np.arange(len(raw)), lambda data: p.parse("slot", data), _tsv_words(p))]
    no_label = np.array([b.count(b"\t") == criteo.N_DENSE + criteo.N_SPARSE - 1 for b in raw],
                        np.bool_)
    out = []
    for has_label in (False, True):
        index = np.flatnonzero(no_label != has_label)
        if len(index):
            p = parser.with_label(has_label)
            out.append((index, lambda data, p=p: p.parse("tsv", data), _tsv_words(p)))
    return out


def _tsv_words(p):
    """describe(reason, detail) of Criteo TSV lines parsed by ``p``: a labelled line with
    the wrong field count may be one without its label column, said so."""
    def describe(reason, detail):
        text = p.describe(reason, detail)
        if reason == criteo.K.BAD_FIELDS and p.has_label:
            text += " (39 without the label column)"
        return text
    return describe


def parse_lines(lines, parser, why=None):
    """(piece, ok) for a list of single lines (str or bytes): the rows as a batch piece
    (dense, sparse, label, offsets) in line order, or None when no line has one, and
    which lines they are (bool (n,)).

    Blank and malformed lines have no row (``ok`` False; with a dict ``why``, ``why[i]``
    says why line i has none).  With the Criteo schema each TSV line may come with or
    without its label column, and a slot line without a ``click:`` token gets
    ``click:0``; the format is the parser's, or (``auto``) that of the first non-blank
    line, as the reader decides for a file.
    """
    why = {} if why is None else why
    raw = [as_line(x) for x in lines]
    ok = np.array([bool(b.strip()) for b in raw], np.bool_)
    for j in np.flatnonzero(~ok):
        why[int(j)] = "blank line"
    if parser.text is None:
        parts = _criteo_parts(raw, parser)
    else:
        fmt = parser.schema.format
        parts = [(np.arange(len(raw)), lambda data: parser.parse(fmt, data), parser.describe)]
    pieces, rows_of = [], []
    for index, parse, describe in parts:
        index = index[ok[index]]
        piece = _parse_some(raw, index, parse, describe, ok, why)
        if piece is not None:
            pieces.append(piece)
            rows_of.append(index[ok[index]])
    if not pieces:
        return None, ok
    piece = bags.concat(pieces)
    order = np.concatenate(rows_of)
    if len(pieces) > 1 and np.any(order[1:] < order[:-1]):   # groups back in line order
        piece = bags.take(piece, np.argsort(order, kind="stable"))
    return piece, ok
