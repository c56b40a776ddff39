"""KServe V2 inference requests of any transport: binary tensors, scoring, the output.

Both transports of the Open Inference Protocol end here: the HTTP/REST one (JSON tensors,
or the **binary tensor data extension**: an ``Inference-Header-Content-Length`` header, the
JSON head, then each input's raw bytes, ``parameters.binary_data_size`` long) and the gRPC
one (``raw_input_contents``, or typed ``contents``).  An input is a dict
``{name, datatype, shape, data}`` (JSON) or ``{name, datatype, shape, raw}`` (its bytes in
the extension's layout: little-endian, row-major; BYTES as a 4-byte length before each
element); a missing dense value is ``null`` (or ``NaN``) in JSON and NaN in a float tensor.

Scoring (:func:`score`): a Criteo TSV model given raw tensors (FP32/FP64 dense, BYTES
sparse, one value per row) takes the **array path**: the dense values are normalised and
the BYTES hashed (``tsv_parse.bytes_column_ids``) exactly as the TSV parser does a line
holding them (float64 ``(x - min) / diff`` stored float32, an empty field 0; FNV-1a +
splitmix64 of the field's bytes), and the model scores the arrays: no line is written or
parsed.  Anything else (JSON tensors, other schemas, integer tensors, bags) becomes
instances written as lines of the model's format (``instances.v2_instances``), as before.
Either way a row scores as ``Predictor.predict_lines`` scores its line.
"""
import json

import numpy as np

from mpips.data import criteo
from mpips.kernels import tsv_parse as K
from mpips.serving.instances import BadInput, v2_instances

OUTPUT = "probability"
RAW_DTYPES = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "INT8": "i1", "INT16": "<i2",
              "INT32": "<i4", "INT64": "<i8", "UINT8": "u1", "UINT16": "<u2",
              "UINT32": "<u4", "UINT64": "<u8", "BOOL": "?"}
BYTES_ERRORS = {K.BYTES_PAST_END: "the 4-byte length of element {k} (or its bytes) runs "
                                  "past the end of the tensor",
                K.BYTES_FORBIDDEN: "element {k} holds a tab, line break or NUL, which a tsv "
                                   "line cannot carry in a value",
                K.BYTES_TRAILING: "bytes left after the {k} elements of its shape"}


def _where(k, t):
    name = t.get("name") if isinstance(t, dict) else None
    return f"inputs[{k}] ({name})" if isinstance(name, str) else f"inputs[{k}]"


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------- HTTP body
def split_body(body, header_length):
    """(head dict, inputs) of an ``infer`` body; ``header_length``: the value of the
    ``Inference-Header-Content-Length`` header, or None (the whole body is JSON)."""
    if header_length is None:
        head, tail = _loads(body), b""
    else:
        raw = header_length.strip()
        n = int(raw) if raw.isdigit() and len(raw) <= 15 else -1
        if not 0 <= n <= len(body):
            raise BadInput(f"Inference-Header-Content-Length: {raw[:20]!r} is not a length "
                           f"within the body's {len(body)} bytes")
        head, tail = _loads(body[:n]), memoryview(body)[n:]
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadInput("inputs: expected a non-empty list of tensors {name, shape, datatype, "
                       "data}")
    pos = 0
    for k, t in enumerate(inputs):
        params = t.get("parameters") if isinstance(t, dict) else None
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is None:
            continue
        w = _where(k, t)
        if not _int(size) or size < 0:
            raise BadInput(f"{w}.parameters.binary_data_size: expected a byte count, got "
                           f"{size!r}"[:200])
        if "data" in t:
            raise BadInput(f"{w}: give data or parameters.binary_data_size, not both")
        if pos + size > len(tail):
            raise BadInput(f"{w}.parameters.binary_data_size: {size} bytes, but only "
                           f"{len(tail) - pos} of the body are left for it")
        t["raw"] = tail[pos:pos + size]
        pos += size
    if pos != len(tail):
        raise BadInput(f"body: {len(tail) - pos} bytes after the binary tensors "
                       "(binary_data_size of the inputs do not add up to the body)")
    return head, inputs


def _loads(data):
    try:
        head = json.loads(bytes(data), parse_constant=_reject)
    except BadInput:
        raise
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"body is not valid JSON ({e})") from None
    if not isinstance(head, dict):
        raise BadInput("body: expected a JSON object")
    return head


def _reject(name):
    """JSON's constants: NaN is a missing value (what a float tensor holds for one, and
    what tritonclient's JSON mode writes for it); the infinities are refused."""
    if name == "NaN":
        return _NAN
    raise BadInput(f"{name} is not a finite number (a missing value is null or NaN)")


class _Nan(float):
    """The NaN of a JSON body: a float that ``_null`` turns into None."""


_NAN = _Nan("nan")


def _null(data):
    """``data`` (a tensor's JSON list) with each NaN of the body as None."""
    return [None if x is _NAN else (_null(x) if type(x) is list else x) for x in data]


def output_names(serving):
    """The model's output tensors: ``probability``, or one per task named by its label."""
    return list(serving.model.task_names) or [OUTPUT]


def check_output(name, k, names):
    """BadInput unless ``name`` (of ``outputs[k]``) is one of the model's outputs."""
    if name not in names:
        raise BadInput(f"outputs[{k}]: unknown output {str(name)[:40]!r}; this model's "
                       f"output{'s are' if len(names) > 1 else ' is'} "
                       f"{', '.join(map(repr, names))}")


def binary_output(head, names=(OUTPUT,)):
    """(the outputs to answer, in order; True when they go as binary data (the
    extension)).  ``names``: the model's outputs (``output_names``)."""
    params = head.get("parameters")
    every = isinstance(params, dict) and params.get("binary_data_output") is True
    outputs = head.get("outputs")
    if outputs is None:
        return list(names), every
    if not isinstance(outputs, list):
        raise BadInput("outputs: expected a list of {name, parameters}")
    binary, wanted = every, []
    for k, o in enumerate(outputs):
        name = o.get("name") if isinstance(o, dict) else None
        check_output(name, k, names)
        wanted.append(name)
        p = o.get("parameters")
        if isinstance(p, dict) and "binary_data" in p:
            binary = p["binary_data"] is True
    return wanted or list(names), binary


def columns(scores, names, wanted):
    """[(name, (n,) float32)] of ``wanted`` outputs of scores (n,) or (n, T)."""
    if scores.ndim == 1:
        return [(n, scores) for n in wanted]
    return [(n, np.ascontiguousarray(scores[:, names.index(n)])) for n in wanted]


# ---------------------------------------------------------------------- raw tensors
def _shape(t, w, max_instances):
    shape = t.get("shape")
    if not (isinstance(shape, list) and shape and all(_int(d) and d >= 0 for d in shape)):
        raise BadInput(f"{w}.shape: expected a list of non-negative integers")
    if shape[0] > max_instances:
        raise BadInput(f"{w}.shape: {shape[0]} instances; the limit is {max_instances} "
                       "(--max-instances)", 413)
    return shape


def _count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def raw_array(t, w, max_instances):
    """The numpy array (numeric) or uint8 blob (BYTES) of a raw tensor, its size checked."""
    dtype, raw = t.get("datatype"), t["raw"]
    shape = _shape(t, w, max_instances)
    if dtype == "BYTES":
        return np.frombuffer(raw, np.uint8)
    if dtype not in RAW_DTYPES:
        raise BadInput(f"{w}.datatype: {str(dtype)[:40]!r} is not a V2 datatype this server "
                       f"reads ({', '.join(sorted(RAW_DTYPES))}, BYTES)")
    item = np.dtype(RAW_DTYPES[dtype]).itemsize
    if len(raw) != _count(shape) * item:
        raise BadInput(f"{w}: {len(raw)} bytes of binary data for shape {shape} of {dtype} "
                       f"({_count(shape) * item} expected)")
    return np.frombuffer(raw, RAW_DTYPES[dtype])


def bytes_elements(blob, n, w):
    """The n elements of a BYTES blob (4-byte little-endian length before each)."""
    out, pos, data = [], 0, bytes(blob)
    for k in range(n):
        if pos + 4 > len(data) or pos + 4 + int.from_bytes(data[pos:pos + 4], "little") > \
                len(data):
            raise BadInput(f"{w}: {BYTES_ERRORS[K.BYTES_PAST_END].format(k=k)}")
        ln = int.from_bytes(data[pos:pos + 4], "little")
        out.append(data[pos + 4:pos + 4 + ln])
        pos += 4 + ln
    if pos != len(data):
        raise BadInput(f"{w}: {BYTES_ERRORS[K.BYTES_TRAILING].format(k=n)}")
    return out


def _as_json(t, k, max_instances):
    """A raw tensor as the JSON tensor it stands for (NaN -> null, BYTES -> strings)."""
    w = _where(k, t)
    arr = raw_array(t, w, max_instances)
    if t.get("datatype") == "BYTES":
        vals = []
        for j, b in enumerate(bytes_elements(arr, _count(t["shape"]), w)):
            try:
                vals.append(b.decode())
            except UnicodeDecodeError:
                raise BadInput(f"{w}: element {j} is not UTF-8 text") from None
    elif arr.dtype.kind == "f":
        a64 = arr.astype(np.float64)
        if np.isinf(a64).any():
            raise BadInput(f"{w}: element {int(np.argmax(np.isinf(a64)))} is not a finite "
                           "number")
        vals = [None if v != v else v for v in a64.tolist()]
    else:
        vals = arr.tolist()
    out = {x: t[x] for x in ("name", "datatype", "shape") if x in t}
    out["data"] = vals
    return out


# ---------------------------------------------------------------------- scoring
_FAST_DENSE = {"FP32": (4, "<f4"), "FP64": (8, "<f8")}


def fast_columns(serving, inputs, max_instances):
    """({name: (k, tensor, numpy dtype or bytes)}, rows) when the array path applies (module
    doc), else None: then the lines path reads the request and names what is wrong."""
    enc = serving.encoder
    if enc.kind != "tsv":
        return None
    dense, sparse = enc.dense, enc.sparse
    cols, n = {}, None
    for k, t in enumerate(inputs):
        try:
            name, dtype, shape, raw = t["name"], t["datatype"], t["shape"], t["raw"]
        except (KeyError, TypeError):
            return None
        if type(shape) is not list or not 1 <= len(shape) <= 2 or shape[1:] not in ([], [1]):
            return None
        b = shape[0]
        if type(b) is not int or b < 0 or (n is not None and b != n) or name in cols:
            return None
        n = b
        if name in dense:
            fmt = _FAST_DENSE.get(dtype)
            if fmt is None or dense[name] != 1 or len(raw) != b * fmt[0]:
                return None
            cols[name] = (k, t, fmt[1])
        elif name in sparse and dtype == "BYTES":
            cols[name] = (k, t, raw)
        else:
            return None
    if n is None or n > max_instances:
        return None
    return cols, n


def fast_score(serving, cols, n):
    enc, model = serving.encoder, serving.model
    if not n:
        return np.empty(0, np.float32)
    norm = serving.__dict__.get("_v2_norm")
    if norm is None:                  # (once per version)
        norm = serving._v2_norm = criteo.make_norm(model.data.get("cont_min"),
                                                   model.data.get("cont_diff"))
    got = [cols.get(name) for name in enc.dense]
    if all(c is not None and c[2] == "<f4" for c in got):    # the usual request
        x = np.frombuffer(b"".join([c[1]["raw"] for c in got]), "<f4").reshape(len(got), n)
    else:
        x = np.full((len(got), n), np.nan)          # (D, B), NaN: not given
        for j, c in enumerate(got):
            if c is not None:
                x[j] = np.frombuffer(c[1]["raw"], c[2])
    dense = np.empty((n, len(got)), np.float32)
    filled = np.empty(n, np.uint8)
    j, e = K.dense_columns(x, norm, dense, filled)
    if j >= 0:
        k, t, _ = got[j]
        raise BadInput(f"{_where(k, t)}: element {e} is not a finite number")
    starts, ends, parts, pos = [], [], [], 0
    for name in enc.sparse:
        c = cols.get(name)
        if c is None:
            starts.append(-1)
            ends.append(0)
        else:
            starts.append(pos)
            pos += len(c[2])
            ends.append(pos)
            parts.append(c[2])
    blob = np.frombuffer(b"".join(parts), np.uint8)
    ids = np.empty((n, len(starts)), np.int64)
    bucket = int(model.data.get("hash_bucket", 0) or 0)
    status, s, e = K.bytes_columns_ids(blob, np.array(starts, np.int64),
                                       np.array(ends, np.int64), n, bucket, ids, filled)
    if status != K.BYTES_OK:
        k, t, _ = cols[list(enc.sparse)[s]]
        raise BadInput(f"{_where(k, t)}: {BYTES_ERRORS[status].format(k=e)}")
    if not filled.all():
        raise BadInput(f"instances[{int(np.argmin(filled))}]: no input has a value (an empty "
                       "row is not scored)")
    return serving.instances.predict_arrays(dense, ids)


def score(serving, inputs, max_instances):
    """Scores (n,) float32 — (n, T) with T tasks — of V2 input tensors (dicts: module doc)
    by ``serving``."""
    fast = fast_columns(serving, inputs, max_instances)
    if fast is not None:
        return fast_score(serving, *fast)
    tensors = []
    for k, t in enumerate(inputs):
        if isinstance(t, dict) and "raw" in t:
            t = _as_json(t, k, max_instances)
        elif isinstance(t, dict) and isinstance(t.get("data"), list):
            t = {**t, "data": _null(t["data"])}
        tensors.append(t)
    instances = v2_instances({"inputs": tensors}, serving.encoder, max_instances)
    if not instances:
        T = serving.model.n_tasks
        return np.empty((0,) if T == 1 else (0, T), np.float32)
    lines = serving.encoder.lines(instances)
    try:
        return serving.instances.predict_lines(lines)
    except Exception as e:  # LineError: name the instance
        bad = getattr(e, "bad", None)
        if not bad:
            raise
        raise BadInput(f"instances[{bad[0][0]}]: {bad[0][1]}") from None


# ---------------------------------------------------------------------- metadata
def model_config(name, serving, max_batch):  # (one output per task: output_names)
    """The minimal Triton model configuration (inputs, outputs, max batch) tritonclient
    reads from ``GET /v2/models/{name}/config``."""
    def dims(shape):
        return {"dims": [1], "reshape": {"shape": []}} if len(shape) == 1 else \
            {"dims": shape[1:]}
    inputs = [{"name": n, "data_type": f"TYPE_{'STRING' if d == 'BYTES' else d}", **dims(s)}
              for n, d, s in serving.encoder.describe_inputs()]
    return {"name": name, "platform": "mpips", "backend": "mpips", "max_batch_size": max_batch,
            "input": inputs, "output": [{"name": o, "data_type": "TYPE_FP32", "dims": [1],
                                         "reshape": {"shape": []}}
                                        for o in output_names(serving)],
            "version_policy": {"latest": {"num_versions": 1}},
            "parameters": {"model_version": {"string_value": serving.version}}}


EXTENSIONS = ["binary_tensor_data", "model_configuration"]
