"""Requests by feature name -> lines of the model's own text format.

An instance is a dict of the schema's input names: a dense input's value is a number (a
list of ``dim`` numbers for a slot of ``dim`` values), a sparse slot's one raw value
(string or integer) or a list of them (a bag); a name left out (or ``null``) is empty.
The instance is written as one line of the format the model was trained on, and that
line is read by the training parsers (``Predictor.predict_lines``): hashing, bag
separators, ``max_len``, normalisation and fill are the training code's by construction,
so a score over the network equals ``Predictor``'s on the same line.

Which line: the Criteo schema writes a TSV line without the label (its ``data_format``
``slot`` writes Paddle's slot tokens instead; ``auto`` means TSV: send slot-format data as
raw lines); ``csv`` writes the columns in the schema's order with a header line of its
own; ``slot`` writes ``name:value`` tokens; ``multislot`` writes a count and the values of
every field.  A value that would change the line's structure is refused, naming the input:
a tab or line break (TSV), the delimiter, a bag separator, a quote or a line break (CSV),
whitespace or ``:`` (slot formats).

Every problem raises :class:`BadInput` with one message naming the instance and input.
"""
import math
import re

SEPARATORS = "\t\r\n\"\x00"
_BAD_TSV = re.compile("[\r\n\x00]")


class BadInput(ValueError):
    """A request the server refuses with a 4xx (``status``), the message naming the field."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


def _number(v, where):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(f"{where}: expected a number, got {type(v).__name__} {_short(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise BadInput(f"{where}: not a finite number ({v!r})")
    return repr(v) if isinstance(v, float) else str(v)


def _short(v, n=40):
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


class Encoder:
    """Instances -> lines for one model (its schema and data settings)."""

    def __init__(self, model):
        s = model.schema
        self.schema, self.labels = s, frozenset(s.labels)     # names an instance may carry
        fmt = model.data.get("data_format", "auto")
        if s.is_criteo:
            self.kind = "criteo_slot" if fmt == "slot" else "tsv"
        else:
            self.kind = s.format                       # csv | slot | multislot
        self.dense = {}                                # name -> dim
        for g in s.dense:
            for n in g.names:
                self.dense[n] = g.dim
        seps = s.slot_options("separator")
        self.sparse = dict(zip(s.sparse_names, seps))  # name -> csv bag separator ("": one)
        self.names = list(self.dense) + list(self.sparse)
        self.index = {n: j for j, n in enumerate(self.names)}
        self.dims = [self.dense.get(n, 0) for n in self.names]      # 0: sparse
        self.n_dense = len(self.dense)
        self.known = set(self.names) | self.labels
        one = self.kind in ("csv", "tsv", "criteo_slot")
        self.joiner = [None] * self.n_dense + [
            (sep if self.kind == "csv" and sep else (None if one else "")) for sep in seps]
        if self.kind == "csv":
            self.header = s.delimiter.join(self.names)
            bad = [s.delimiter + SEPARATORS + (sep or "") for sep in seps]
        elif self.kind == "tsv":          # a TSV field is any bytes but a tab or line break
            self.header = None
            bad = ["\t\r\n\x00"] * len(seps)
        else:
            self.header = None
            bad = [SEPARATORS + " :"] * len(seps)
        self.forbidden = [None] * self.n_dense + [
            re.compile("[" + re.escape("".join(sorted(set(b)))) + "]") for b in bad]
        self.join = getattr(self, "_" + self.kind)

    # ---------------------------------------------------------------- inputs
    def describe_inputs(self):
        """[(name, datatype, shape)] of the model's inputs (KServe V2 metadata)."""
        out = [(n, "FP32", [-1] if d == 1 else [-1, d]) for n, d in self.dense.items()]
        return out + [(n, "BYTES", [-1]) for n in self.sparse]

    def _dense(self, j, v, where):
        dim = self.dims[j]
        if dim == 1:
            if type(v) is list:
                if len(v) != 1:
                    raise BadInput(f"{where}: dense input {self.names[j]!r} takes one number, "
                                   f"got a list of {len(v)}")
                v = v[0]
            return [_number(v, where)]
        if not isinstance(v, list) or len(v) != dim:
            raise BadInput(f"{where}: dense input {self.names[j]!r} takes a list of {dim} "
                           f"numbers, got {_short(v)}")
        return [_number(x, f"{where}[{k}]") for k, x in enumerate(v)]

    def _sparse(self, j, v, where):
        vals = v if type(v) is list else [v]
        if all(type(x) is int for x in vals):          # feasigns: the common bag
            out = list(map(str, vals))
            vals = ()
        else:
            out = []
        bad = self.forbidden[j].search
        for x in vals:
            t = type(x)
            if t is int:
                out.append(str(x))
            elif t is str and bad(x) is None:
                if x:
                    out.append(x)
            else:
                self._refuse(j, vals, where, type(v) is list)
        if len(out) > 1 and self.joiner[j] is None:
            raise BadInput(f"{where}: slot {self.names[j]!r} holds one value in this model's "
                           f"format; got a bag of {len(out)}")
        return out or None

    def _refuse(self, j, vals, where, listed):
        """Raise BadInput for the first bad sparse value of ``vals``."""
        for k, x in enumerate(vals):
            w = f"{where}[{k}]" if listed else where
            if type(x) not in (str, int):
                raise BadInput(f"{w}: a sparse value is a string or an integer, got "
                               f"{type(x).__name__} {_short(x)}")
            if type(x) is str and self.forbidden[j].search(x) is not None:
                raise BadInput(f"{w}: value {_short(x)} holds a character a {self.kind} line "
                               "cannot carry in a value (a separator, quote, space, ':' or line "
                               "break)")
        raise BadInput(f"{where}: a bad sparse value")   # (not reached)

    # ---------------------------------------------------------------- lines
    def line(self, inst, i):
        """The text line of instance ``inst`` (a dict), the i-th of its request."""
        if type(inst) is not dict:
            raise BadInput(f"instances[{i}]: an instance is an object of input names, got "
                           f"{type(inst).__name__}")
        vals = [None] * len(self.names)
        index, nd, forbidden, finite = self.index, self.n_dense, self.forbidden, math.isfinite
        tsv = self.kind == "tsv"
        for k, v in inst.items():
            j = index.get(k)
            if j is None:
                if k in self.labels:
                    continue
                raise BadInput(f"instances[{i}]: unknown input {_short(k)}; this model's "
                               f"inputs are {', '.join(self.names[:8])}"
                               f"{' ...' if len(self.names) > 8 else ''}")
            t = type(v)                        # the common cases first, inline
            if t is int:
                vals[j] = (str(v),)
            elif j < nd:
                if t is float and finite(v) and self.dims[j] == 1:
                    vals[j] = (repr(v),)
                elif v is not None:
                    vals[j] = self._dense(j, v, f"instances[{i}].{k}")
            elif t is str and (tsv or forbidden[j].search(v) is None):
                vals[j] = (v,) if v else None     # (TSV: the whole line is checked after)
            elif v is not None:
                vals[j] = self._sparse(j, v, f"instances[{i}].{k}")
        if not any(vals):
            raise BadInput(f"instances[{i}]: no input has a value (an empty row is not scored)")
        return self.join(vals, i)

    def _tsv(self, vals, i):
        line = "\t".join([v[0] if v else "" for v in vals])
        if line.count("\t") != len(vals) - 1 or _BAD_TSV.search(line) is not None:
            for j, v in enumerate(vals):           # name the value that broke the line
                if v and j >= self.n_dense:
                    self._sparse(j, v[0], f"instances[{i}].{self.names[j]}")
        return line

    def _criteo_slot(self, vals, i):
        if not all(vals):
            raise BadInput(f"instances[{i}].{self.names[vals.index(None)]}: the slot format "
                           "this model reads has no empty value: every input is needed")
        nd = self.n_dense
        return " ".join([f"dense_feature:{v[0]}" for v in vals[:nd]]
                        + [f"{k}:{v[0]}" for k, v in enumerate(vals[nd:], 1)])

    def _csv(self, vals, i):
        return self.schema.delimiter.join(
            ["" if v is None else (v[0] if len(v) == 1 else self.joiner[j].join(v))
             for j, v in enumerate(vals)])

    def _slot(self, vals, i):
        parts = []
        if self.schema.token_order == "feasign:slot":       # "v1:name v2:name"
            for n, v in zip(self.names, vals):
                if v:
                    parts.append(f":{n} ".join(v) + f":{n}")
        else:                                                # "name:v1 name:v2"
            for n, v in zip(self.names, vals):
                if v:
                    parts.append(f"{n}:" + f" {n}:".join(v))
        return " ".join(parts)

    def _multislot(self, vals, i):
        toks = []
        for f in self.schema.fields:
            j = self.index.get(f)
            v = (["0"] if f in self.labels else []) if j is None else list(vals[j] or [])
            toks.append(" ".join([str(len(v))] + v))
        return " ".join(toks)

    def lines(self, instances):
        return [self.line(x, i) for i, x in enumerate(instances)]


def columns_to_instances(columns, known, what):
    """{name: [value per instance]} (TF ``inputs`` / V2 tensors) -> instances; every
    column must have the same length."""
    n = None
    for name, col in columns.items():
        if name not in known:
            raise BadInput(f"{what}: unknown input {_short(name)}")
        if not isinstance(col, list):
            raise BadInput(f"{what}.{name}: expected a list of values, one per instance")
        if n is not None and len(col) != n:
            raise BadInput(f"{what}.{name}: {len(col)} values, but other inputs have {n}")
        n = len(col)
    n = n or 0
    out = [{} for _ in range(n)]
    for name, col in columns.items():
        for j, v in enumerate(col):
            out[j][name] = v
    return out


V2_DENSE = {"FP32", "FP64", "FP16", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16",
            "UINT32", "UINT64"}
V2_SPARSE = {"BYTES", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}


def v2_instances(body, enc, max_instances):
    """The instances of a KServe V2 ``infer`` request body (a dict)."""
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadInput("inputs: expected a non-empty list of tensors {name, shape, datatype, "
                       "data}")
    columns = {}
    for k, t in enumerate(inputs):
        w = f"inputs[{k}]"
        if not isinstance(t, dict):
            raise BadInput(f"{w}: expected a tensor object")
        name, shape, dtype, data = (t.get(x) for x in ("name", "shape", "datatype", "data"))
        if not isinstance(name, str):
            raise BadInput(f"{w}.name: expected a string")
        w = f"inputs[{k}] ({name})"
        if name not in enc.known:
            raise BadInput(f"{w}: unknown input; this model's inputs are "
                           f"{', '.join(enc.names[:8])}{' ...' if len(enc.names) > 8 else ''}")
        if name in columns:
            raise BadInput(f"{w}: given twice")
        if not (isinstance(shape, list) and shape and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise BadInput(f"{w}.shape: expected a list of non-negative integers")
        if shape[0] > max_instances:
            raise BadInput(f"{w}.shape: {shape[0]} instances; the limit is {max_instances} "
                           "(--max-instances)", 413)
        dim = enc.dense.get(name, 1)
        is_dense = name in enc.dense
        if not isinstance(data, list):
            raise BadInput(f"{w}.data: expected a list")
        flat = _flatten(data, w) if any(isinstance(x, list) for x in data) and \
            (is_dense or len(shape) > 1) else data
        allowed = V2_DENSE if is_dense else V2_SPARSE
        if name in enc.labels:
            allowed = V2_DENSE
        if dtype not in allowed:
            raise BadInput(f"{w}.datatype: {_short(dtype)} is not one of {sorted(allowed)}")
        want = shape[0] * dim if is_dense else shape[0]
        ok_shape = (shape == [shape[0]] or shape == [shape[0], dim]) if is_dense \
            else shape in ([shape[0]], [shape[0], 1])
        if not ok_shape:
            raise BadInput(f"{w}.shape: {shape} does not fit this input (expected "
                           f"[{shape[0]}{', %d' % dim if dim > 1 else ''}])")
        if len(flat) != want:
            raise BadInput(f"{w}.data: {len(flat)} values for shape {shape}")
        if dtype == "BYTES":
            for j, x in enumerate(flat):
                if not (x is None or isinstance(x, str) or (isinstance(x, list) and all(
                        isinstance(y, str) for y in x))):
                    raise BadInput(f"{w}.data[{j}]: BYTES values are strings (a list of "
                                   "strings for a bag, null for none)")
        elif not is_dense:
            for j, x in enumerate(flat):
                if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
                    raise BadInput(f"{w}.data[{j}]: {dtype} values are integers")
        columns[name] = flat if dim == 1 else [flat[j * dim:(j + 1) * dim]
                                               for j in range(shape[0])]
    return columns_to_instances(columns, enc.known, "inputs")


def _flatten(data, w):
    out = []
    for x in data:
        if isinstance(x, list):
            out.extend(_flatten(x, w))
        else:
            out.append(x)
    return out
