"""`mpips.serving.Predictor`: score raw lines with a serving bundle, patched atomically.

    p = Predictor("model.h5")                   # a bundle from `python -m mpips.export`
    p.predict_lines([b"0\t1\t...", "..."])    # Criteo TSV or Paddle slot lines -> (n,) float32
                                                # (a bad line raises LineError; errors="nan")
    p = Predictor("model.h5", header="click,price,site")   # a CSV schema's header line
    p.predict_lines(["0,12.5,s1", "..."])       # lines of the bundle's schema (docs/serving.md)
    p.predict_arrays(dense, ids)                # normalised (B, D) float32, (B, S) int64 ids
    p.predict_arrays(dense, ids, offsets)       # or bags: ids (nnz,), offsets (B*S + 1,)
    p.apply("patch-000005.h5")                  # rows changed / ids evicted since the bundle

    p = Predictor.follow("exports/")            # the newest state of a stream's --export-dir
    p.refresh()                                 # catch up (True if the model changed)

The lines are parsed by the training parsers (``mpips.data.criteo`` / ``mpips.data.slot``;
another schema's by ``mpips.data.formats.TextFormat``) with the bundle's data settings
(format, ``hash_bucket``, normalisation), and scored by
a ``mpips.serving.model.ServingModel`` (the training forward pass).  The predictor holds ONE
reference to its current model; a scoring call reads it once, and ``apply``/``refresh``
build the new model aside and then swap the reference, so a concurrent reader sees the
old model or the new one, never half of each.  When a patch or a followed folder's
file is bad, one ``BundleError`` is raised and the model stays as it was.
numpy/numba only (no MPI).
"""
import functools

import numpy as np

import mpips.serving.bundle as bd
import mpips.serving.exports as exports
from mpips.data import bags, criteo, slot
from mpips.data.formats import TextFormat
from mpips.serving.model import ServingModel

SLOT_PREFIX = (b"click:", b"dense_feature:")


# ---------------------------------------------------------------------- lines
def _as_bytes(line):
    b = line.encode() if isinstance(line, str) else bytes(line)
    if b.endswith(b"\n"):
        b = b[:-1]
    if b.endswith(b"\r"):
        b = b[:-1]
    if b"\n" in b:
        raise ValueError("a line must not contain a newline inside it")
    return b


@functools.lru_cache(maxsize=32)
def _norm(cont_min, cont_diff):
    """make_norm of tuples (or None), made once: a server parses a few lines a call."""
    return criteo.make_norm(cont_min, cont_diff)


def _parser(data, slot_format, has_label):
    bucket = int(data["hash_bucket"])
    if slot_format:
        return lambda buf: slot.parse_slot_bytes(buf, hash_bucket=bucket)
    lo, diff = data["cont_min"], data["cont_diff"]
    norm = _norm(None if lo is None else tuple(lo), None if diff is None else tuple(diff))
    return lambda buf: criteo.parse_tsv_bytes(buf, has_label=has_label, hash_bucket=bucket,
                                              norm=norm, pad=True)  # as the reader does


def _parse_group(raw, parse, why, index, has_label):
    """(dense, ids, ok) of lines ``raw`` parsed by ``parse``; ok marks lines with a row.

    ``why[index[j]]`` gets the reason line j has no row (blank, or the parser's reason)."""
    ok = np.array([bool(b.strip()) for b in raw], np.bool_)
    for j in np.flatnonzero(~ok):
        why[int(index[j])] = "blank line"
    step = len(raw) if len(raw) <= criteo.MAX_BAD_RECORDS else criteo.MAX_BAD_RECORDS
    res = parse(b"\n".join(raw))
    if res.n_bad <= len(res.bad):
        _mark_bad(res.bad, 0, ok, why, index, has_label)
        return res.dense, res.sparse, ok
    dense, ids = [], []                      # more bad lines than recorded: find them in pieces
    for lo in range(0, len(raw), step):
        res = parse(b"\n".join(raw[lo:lo + step]))
        _mark_bad(res.bad, lo, ok, why, index, has_label)
        dense.append(res.dense)
        ids.append(res.sparse)
    return np.concatenate(dense), np.concatenate(ids), ok


def _mark_bad(bad, lo, ok, why, index, has_label):
    """Lines of parser records ``bad`` ((line, reason, detail) rows, lines from ``lo``)."""
    ok[lo + bad[:, 0]] = False
    for line, reason, detail in bad.tolist():
        text = criteo.describe_bad(reason, detail, has_label)
        if reason == criteo.K.BAD_FIELDS and has_label:
            text += " (39 without the label column)"
        why[int(index[lo + line])] = text


def parse_lines(lines, data, why=None):
    """(dense, ids, ok) for raw lines: the parsed rows and which lines they are (bool (n,)).

    Blank and malformed lines have no row (``ok`` False; with a dict ``why``, ``why[i]``
    says why line i has none).  Each TSV line may come with or without its label column
    (39 or 38 tabs); a slot line without a ``click:`` token gets ``click:0``.  The format
    is the bundle's, or (``auto``) that of the first non-blank line, as the reader decides
    for a file.
    """
    why = {} if why is None else why
    raw = [_as_bytes(x) for x in lines]
    every = np.arange(len(raw))
    first = next((b for b in raw if b.strip()), b"")
    fmt = data["data_format"]
    slot_format = fmt == "slot" or (fmt == "auto" and first.lstrip().startswith(SLOT_PREFIX))
    if slot_format:
        raw = [b if b.lstrip().startswith(b"click:") else b"click:0 " + b for b in raw]
        return _parse_group(raw, _parser(data, True, True), why, every, True)
    no_label = np.array([b.count(b"\t") == criteo.N_DENSE + criteo.N_SPARSE - 1 for b in raw],
                        np.bool_)
    if not no_label.any() or no_label.all():
        has_label = not no_label.any()
        return _parse_group(raw, _parser(data, False, has_label), why, every, has_label)
    dense = np.zeros((len(raw), criteo.N_DENSE), np.float32)
    ids = np.zeros((len(raw), criteo.N_SPARSE), np.int64)
    ok = np.zeros(len(raw), np.bool_)
    for has_label in (False, True):
        idx = np.flatnonzero(no_label != has_label)
        d, i, k = _parse_group([raw[j] for j in idx], _parser(data, False, has_label), why,
                               idx, has_label)
        dense[idx[k]], ids[idx[k]], ok[idx] = d, i, k
    return dense[ok], ids[ok], ok


def text_parser(model, header=None):
    """The parse function of a non-Criteo model's lines: the training readers' parser
    (``mpips.data.formats.TextFormat``) with the bundle's data settings; a CSV schema
    with ``header = true`` needs ``header``, the column names line of its files."""
    schema, data = model.schema, model.data
    fmt = TextFormat(schema, has_label=False, hash_bucket=int(data["hash_bucket"]),
                     cont_min=data.get("cont_min"), cont_diff=data.get("cont_diff"))
    if fmt.needs_header or (header is not None and schema.format == "csv"):
        if header is None:
            raise ValueError("this model's schema is CSV with a header line: give it, "
                             "Predictor(bundle, header=\"col1,col2,...\") (the first line of "
                             "its data files)")
        fmt.with_header(_as_bytes(header), "the predictor's header")
    return fmt


def parse_text_lines(lines, fmt, why=None):
    """(piece, ok) for raw lines of a TextFormat ``fmt``: the parsed rows as a batch piece
    (dense, sparse, label, offsets) and which lines they are (bool (n,)); blank and bad
    lines have no row (``why[i]`` says why, as in ``parse_lines``)."""
    why = {} if why is None else why
    raw = [_as_bytes(x) for x in lines]
    ok = np.array([bool(b.strip()) for b in raw], np.bool_)
    for j in np.flatnonzero(~ok):
        why[int(j)] = "blank line"
    index = np.flatnonzero(ok)
    step = criteo.MAX_BAD_RECORDS
    pieces = []
    for lo in range(0, len(index), step):    # at most MAX_BAD_RECORDS bad lines a parse
        res = fmt.parse(b"\n".join(raw[j] for j in index[lo:lo + step]) + b"\n")
        for line, reason, detail in res.bad.tolist():
            ok[index[lo + line]] = False
            why[int(index[lo + line])] = fmt.describe(reason, detail)
        pieces.append((res.dense, res.sparse, res.label, res.offsets))
    if not pieces:
        return None, ok
    return bags.concat(pieces), ok


class LineError(ValueError):
    """Lines ``predict_lines`` cannot score; ``bad``: [(index, reason)] of all of them."""

    def __init__(self, bad, n):
        self.bad = bad
        i, why = bad[0]
        more = f" (and {len(bad) - 1} more: lines {', '.join(str(j) for j, _ in bad[1:6])}" \
               f"{' ...' if len(bad) > 6 else ''})" if len(bad) > 1 else ""
        super().__init__(f"line {i} of {n} cannot be scored: {why}{more}; fix the line(s), "
                         f"or call predict_lines(lines, errors='nan') for NaN there")


# ---------------------------------------------------------------------- predictor
class Predictor:
    """A serving model from a bundle, patched atomically, optionally following a folder.

    ``Predictor(BUNDLE)`` loads a full bundle; ``Predictor.follow(DIR)`` starts from the
    newest state of an export folder and ``refresh()`` catches up with it.
    """

    def __init__(self, bundle=None, *, model=None, header=None):
        if model is None:
            m, arrays = bd.read_bundle(bundle)
            if m["kind"] != "full":
                raise bd.BundleError(f"{bundle}: is a patch; load a full bundle and apply() it")
            model = ServingModel.from_arrays(m, arrays)
        self._model = model
        self.header = header        # CSV schemas: the column names line of the data files
        self._text = (None, None)   # (model, its TextFormat) of non-Criteo schemas
        self.folder = None
        self.bad_lines = 0          # bad lines given NaN by predict_lines(errors="nan")
        self.last_bad = []          # [(index, reason)] of the last such call

    @property
    def model(self):
        """The current ServingModel (read it once per use)."""
        return self._model

    @property
    def version(self):
        return self._model.version

    def predict_arrays(self, dense, ids, offsets=None):
        """Probabilities (B,) float32 for dense (B, D) normalised and ids (B, S) int64, or
        bags of ids (nnz,) with ``offsets`` (B*S + 1,) (the layout of ``Batch``)."""
        return self._model.predict(dense, ids, offsets=offsets)

    def predict_lines(self, lines, errors="raise"):
        """Probabilities (n,) float32 for n raw lines (TSV or slot, str or bytes).

        A blank or malformed line raises LineError naming its index (0-based) and what is
        wrong with it (``errors="raise"``); with ``errors="nan"`` it gets NaN instead, is
        counted in ``bad_lines``, and ``last_bad`` lists (index, reason) of this call's.
        """
        if errors not in ("raise", "nan"):
            raise ValueError(f"errors must be 'raise' or 'nan'; got {errors!r}")
        model = self._model
        if not model.schema.is_criteo:
            return self._predict_text(model, lines, errors)
        why = {}
        dense, ids, ok = parse_lines(lines, model.data, why)
        bad = sorted(why.items())
        if bad and errors == "raise":
            raise LineError(bad, len(ok))
        out = np.full(len(ok), np.nan, np.float32)
        if len(ids):
            out[ok] = model.predict(dense, ids)
        self.last_bad = bad
        self.bad_lines += len(bad)
        return out

    def _predict_text(self, model, lines, errors):
        if self._text[0] is not model:
            self._text = (model, text_parser(model, self.header))
        why = {}
        piece, ok = parse_text_lines(lines, self._text[1], why)
        bad = sorted(why.items())
        if bad and errors == "raise":
            raise LineError(bad, len(ok))
        out = np.full(len(ok), np.nan, np.float32)
        if piece is not None and ok.any():
            out[ok] = model.predict(piece[0], piece[1], offsets=piece[3])
        self.last_bad = bad
        self.bad_lines += len(bad)
        return out

    def apply(self, patch):
        """Apply a patch file (or (manifest, arrays)); all or nothing, one reference swap."""
        m, arrays = bd.read_bundle(patch) if isinstance(patch, str) else patch
        if m["kind"] != "patch":
            raise bd.BundleError(f"{patch}: is a full bundle, not a patch")
        self._model = self._model.patched(m, arrays)

    # ------------------------------------------------------------ export folders
    @classmethod
    def follow(cls, folder, header=None):
        """A predictor at the newest state of export folder ``folder``."""
        p = cls(model=exports.load_latest(folder), header=header)
        p.folder = folder
        return p

    def refresh(self):
        """Catch up with the followed folder; True if the model changed.

        A missing, truncated or corrupt file raises BundleError; the model stays as it was.
        """
        if self.folder is None:
            raise ValueError("refresh() needs a predictor made by Predictor.follow(DIR)")
        new = exports.catch_up(self.folder, self._model)
        if new is self._model:
            return False
        self._model = new
        return True
