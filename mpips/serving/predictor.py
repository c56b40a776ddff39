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

The lines are parsed by the training readers' parser (``mpips.data.parsers``) with the
bundle's data settings (format, ``hash_bucket``, normalisation), and scored by
a ``mpips.serving.model.ServingModel`` (the training forward pass).  The predictor holds ONE
reference to its current model; a scoring call reads it once, and ``apply``/``refresh``
build the new model aside and then swap the reference, so a concurrent reader sees the
old model or the new one, never half of each.  When a patch or a followed folder's
file is bad, one ``BundleError`` is raised and the model stays as it was.
numpy/numba only (no MPI).
"""
import numpy as np

import mpips.serving.bundle as bd
import mpips.serving.exports as exports
from mpips.data import criteo, parsers
from mpips.data.parsers import LineParser
from mpips.serving.model import ServingModel


# ---------------------------------------------------------------------- lines
def line_parser(model, header=None):
    """The LineParser (``mpips.data.parsers``, the training readers' parser) of a model's
    lines, with the bundle's data settings; a CSV schema with ``header = true`` needs
    ``header``, the column names line of its files."""
    schema, data = model.schema, model.data
    if schema.is_criteo:
        return _criteo_parser(data)
    parser = LineParser(schema, has_label=False, hash_bucket=int(data["hash_bucket"]),
                        cont_min=data.get("cont_min"), cont_diff=data.get("cont_diff"))
    if parser.needs_header or (header is not None and schema.format == "csv"):
        if header is None:
            raise ValueError("this model's schema is CSV with a header line: give it, "
                             "Predictor(bundle, header=\"col1,col2,...\") (the first line of "
                             "its data files)")
        parser.with_header(parsers.as_line(header), "the predictor's header")
    return parser


def _criteo_parser(data):
    """The Criteo schema's parser (lines with or without their label, per line)."""
    return LineParser(fmt=data["data_format"], hash_bucket=int(data["hash_bucket"]),
                      cont_min=data["cont_min"], cont_diff=data["cont_diff"])


def parse_lines(lines, data, why=None):
    """(dense, ids, ok) for raw Criteo lines (TSV or slot) with a bundle's data settings
    ``data``: the parsed rows and which lines they are (bool (n,)); blank and malformed
    lines have no row (``why[i]`` says why; ``mpips.data.parsers.parse_lines``)."""
    piece, ok = parsers.parse_lines(lines, _criteo_parser(data), why)
    if piece is None:
        return (np.zeros((0, criteo.N_DENSE), np.float32),
                np.zeros((0, criteo.N_SPARSE), np.int64), ok)
    return piece[0], piece[1], ok


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
        self._parsing = (None, None)    # (model, its LineParser)
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

    @property
    def task_names(self):
        """The labels of a multi-task model's outputs, in column order (() for one task)."""
        return self._model.task_names

    def predict_arrays(self, dense, ids, offsets=None):
        """Probabilities (B,) float32 — (B, T) with T tasks, one column a label of
        ``task_names`` — for dense (B, D) normalised and ids (B, S) int64, or
        bags of ids (nnz,) with ``offsets`` (B*S + 1,) (the layout of ``Batch``)."""
        return self._model.predict(dense, ids, offsets=offsets)

    def predict_lines(self, lines, errors="raise"):
        """Probabilities (n,) float32 — (n, T) with T tasks — for n raw lines (TSV or slot,
        str or bytes).

        A blank or malformed line raises LineError naming its index (0-based) and what is
        wrong with it (``errors="raise"``); with ``errors="nan"`` it gets NaN instead, is
        counted in ``bad_lines``, and ``last_bad`` lists (index, reason) of this call's.
        """
        if errors not in ("raise", "nan"):
            raise ValueError(f"errors must be 'raise' or 'nan'; got {errors!r}")
        model = self._model
        if self._parsing[0] is not model:
            self._parsing = (model, line_parser(model, self.header))
        why = {}
        piece, ok = parsers.parse_lines(lines, self._parsing[1], why)
        bad = sorted(why.items())
        if bad and errors == "raise":
            raise LineError(bad, len(ok))
        T = model.n_tasks
        out = np.full((len(ok),) if T == 1 else (len(ok), T), np.nan, np.float32)
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
