"""The networks by ``--model`` name, and what the name means for the sparse table.

dnn: :class:`CTRDNN` (rows ``[v]``, width dim); wide_deep, deepfm: rows ``[w | v]`` of
width dim + 1 (docs/models.md).  A checkpoint or bundle stores the name (``config.model``,
bundle ``model.model``); one written before models had names is a dnn.
"""
from mpips.models.ctr_dnn import CTRDNN
from mpips.models.deepfm import DeepFM
from mpips.models.wide_deep import WideDeep

MODELS = {cls.name: cls for cls in (CTRDNN, WideDeep, DeepFM)}
DEFAULT = "dnn"


def model_class(name):
    """The network class of ``--model name``; ValueError (one line) for an unknown name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]


def row_dim(name, dim):
    """Width of a sparse table row of model ``name`` with embeddings of ``dim``."""
    return dim + model_class(name).EXTRA_COLS


def emb_dim(name, row_width):
    """The embedding dim of model ``name`` whose table rows are ``row_width`` wide."""
    return row_width - model_class(name).EXTRA_COLS


def stored_name(manifest):
    """The ``--model`` a checkpoint manifest was saved with (none recorded: dnn)."""
    return manifest.get("config", {}).get("model", DEFAULT)


def make_net(name, schema, dim, hidden, **kw):
    """Model ``name`` over a feature schema's inputs with embeddings of ``dim``."""
    return model_class(name).for_schema(schema, dim, hidden, **kw)
