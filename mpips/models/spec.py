"""Networks as files: read a network's TOML text into a checked description.

A network file (docs/models.md; the built-ins are ``mpips/models/networks/*.toml``)::

    [inputs]                 # name = source
    emb = "all"              # the pooled slots, every one (or a list of slot names)
    dense = "dense"          # the dense features
    w = "first_order"        # each slot's pooled first-order weight (rows become [w | v])

    [layers.x]               # one table per layer, in the order of the flat weight vector
    type = "concat"
    inputs = ["emb", "dense"]
    ...

    [output]
    logits = ["out"]         # one width-1 layer per task (docs/tasks.md: several tasks,
                             # head = "esmm", loss_weights = [...])

``widths = "fc"`` takes the ``--fc`` flag; a width ``"dim"`` is ``--embedding-dim``.
Every error is one line naming the file, the layer and the field.
"""
import hashlib
import os
from importlib import resources

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10
    import tomli as tomllib

from mpips.models.tasks import KINDS, OPTIONS, parse_output

BUILTIN = ("dnn", "wide_deep", "deepfm", "dcn_v2", "dlrm")
MULTI_TASK = ("shared_bottom", "mmoe", "esmm")     # built-ins with several logits
SOURCES = ("all", "dense", "first_order")      # or a list of slot names
TOP_KEYS = ("name", "description", "inputs", "layers", "output")


class NetworkError(ValueError):
    """A network that cannot be read or built; the message is one line."""


def builtin_text(name):
    """The TOML text of built-in network ``name``."""
    return resources.files("mpips.models").joinpath("networks", f"{name}.toml").read_text()


def resolve(model):
    """(name, TOML text) of ``--model``: a built-in name or a path to a .toml file."""
    if model in BUILTIN + MULTI_TASK:
        return model, builtin_text(model)
    if not model.endswith(".toml"):
        raise NetworkError(f"unknown model {model!r}; choose one of "
                           f"{', '.join(BUILTIN + MULTI_TASK)}, or "
                           f"give a network file (FILE.toml; python -m mpips.train "
                           f"--print-model dnn prints one to start from)")
    try:
        with open(model, encoding="utf-8") as f:
            return os.path.basename(model)[:-5], f.read()
    except OSError as e:
        raise NetworkError(f"cannot read network file {model}: {e.strerror or e}") from None


def digest(text):
    """The network's identity, what a checkpoint and a bundle are checked by: a short hash
    of its parsed description (comments, spacing, name and description do not count, so a
    copied built-in is the same network)."""
    spec = parse(text)
    spec.pop("name")
    return hashlib.sha256(repr(sorted(spec.items())).encode("utf-8")).hexdigest()[:16]


def _fail(where, what, field, msg):
    raise NetworkError(f"{where}: {what}: {field}: {msg}")


def _str_list(v):
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _inputs(doc, where):
    ins = doc.get("inputs")
    if not isinstance(ins, dict) or not ins:
        _fail(where, "[inputs]", "inputs", "missing: name at least one input, e.g. "
              "emb = \"all\" and dense = \"dense\"")
    for name, src in ins.items():
        if not (src in SOURCES or (_str_list(src) and src)):
            _fail(where, f"input {name!r}", "source", f"must be one of {', '.join(SOURCES)} "
                  f"or a list of slot names; got {src!r}")
    return dict(ins)


def _layers(doc, where, inputs):
    layers = doc.get("layers")
    if not isinstance(layers, dict) or not layers:
        _fail(where, "[layers]", "layers", "missing: a network needs at least one layer")
    out = []
    for name, body in layers.items():
        what = f"layer {name!r}"
        if name in inputs:
            _fail(where, what, "name", "is also an input's name; rename one")
        if not isinstance(body, dict):
            _fail(where, what, "type", "must be a table ([layers.NAME] with type = ...)")
        kind = body.get("type")
        if kind not in KINDS:
            _fail(where, what, "type", f"unknown layer type {kind!r}; choose one of "
                  f"{', '.join(KINDS)}")
        refs = body.get("inputs")
        if not _str_list(refs) or not refs:
            _fail(where, what, "inputs", f"must be a non-empty list of names; got {refs!r}")
        extra = sorted(set(body) - {"type", "inputs"} - set(OPTIONS[kind]))
        if extra:
            _fail(where, what, extra[0], f"unknown option for a {kind} layer (it takes "
                  f"{', '.join(OPTIONS[kind]) or 'only type and inputs'})")
        opts = {k: v for k, v in body.items() if k not in ("type", "inputs")}
        out.append((name, kind, list(refs), opts))
    return out


def parse(text, where="network"):
    """The checked description {name, inputs, layers [(name, type, inputs, options)],
    logits} of a network's TOML text; NetworkError (one line) if it is malformed."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise NetworkError(f"{where}: not valid TOML: {e}") from None
    extra = sorted(set(doc) - set(TOP_KEYS))
    if extra:
        _fail(where, "top level", extra[0], f"unknown key (a network file has "
              f"{', '.join(TOP_KEYS)})")
    inputs = _inputs(doc, where)
    layers = _layers(doc, where, inputs)
    logits, extra = parse_output(doc.get("output"),
                                 lambda field, msg: _fail(where, "[output]", field, msg))
    return {"name": doc.get("name", ""), "inputs": inputs, "layers": layers, "logits": logits,
            **extra}


def substitute(opts, fc, dim):
    """A layer's options with ``widths = "fc"`` and widths ``"dim"`` filled in."""
    out = dict(opts)
    if out.get("widths") == "fc":
        out["widths"] = list(fc)
    if isinstance(out.get("widths"), list):
        out["widths"] = [dim if w == "dim" else w for w in out["widths"]]
    if out.get("width") == "dim":
        out["width"] = dim
    return out
