"""The networks by ``--model``: a built-in name (a TOML file shipped in
``mpips/models/networks/``) or the path of the user's own FILE.toml (docs/models.md).

A checkpoint stores the network's text (manifest ``network``) and its digest (settings);
a bundle's ``model`` record holds the text too.  One saved before networks were files
holds only the name (``config.model``; none: dnn), which means the built-in file.
"""
from mpips.metrics import new_metrics
from mpips.models.network import Network
from mpips.models.spec import (BUILTIN, MULTI_TASK, NetworkError, builtin_text, digest, parse,
                               resolve)

MODELS = BUILTIN              # one task
ALL = BUILTIN + MULTI_TASK    # every shipped network
DEFAULT = "dnn"


def network_text(model):
    """The TOML text of ``--model`` (a built-in name or FILE.toml); NetworkError (one line)."""
    return resolve(model)[1]


def model_digest(model):
    """The digest of ``--model``'s network."""
    return digest(network_text(model))


def extra_cols(text):
    """Table columns before the embedding: 1 when an input reads the first-order weight."""
    return int("first_order" in parse(text)["inputs"].values())


def stored_network(record):
    """(name, text) of the network a checkpoint manifest or a bundle's model record holds."""
    if isinstance(record.get("network"), dict):
        return record["network"]["name"], record["network"]["text"]
    if "config" in record:                                     # a manifest
        name = record["config"].get("model", DEFAULT)
    else:                                                      # a bundle's model record
        name = record.get("model", DEFAULT)
    if name not in ALL:
        raise NetworkError(f"the stored network {name!r} has no text and is not a built-in "
                           f"one ({', '.join(BUILTIN)})")
    return name, builtin_text(name)


def stored_name(manifest):
    """The ``--model`` a checkpoint manifest was saved with (none recorded: dnn)."""
    return manifest.get("config", {}).get("model", DEFAULT)


def make_net(model, schema, dim, hidden, text=None, **kw):
    """The network of ``--model`` (or of its ``text``) over a feature schema's inputs with
    embeddings of ``dim`` and ``--fc`` widths ``hidden``."""
    name = model
    if text is None:
        name, text = resolve(model)
    net = Network(text, schema.n_sparse, dim, schema.n_dense, hidden,
                  pooling=schema.pooling_codes(), slot_names=schema.sparse_names,
                  attention=schema.attention(), name=name, where=f"network {model}", **kw)
    check_tasks(net, schema, model)
    net.task_names = schema.labels if net.n_tasks > 1 else ()
    return net


def metrics_for(net):
    """Empty metrics for a network's predictions: BinaryMetrics for one task, TaskMetrics
    (per label; ESMM's CVR on clicked rows too) for several."""
    T = net.n_tasks
    names = net.task_names or tuple(f"task{t}" for t in range(T))
    return new_metrics(names if T > 1 else (), net.head is not None and net.head.kind == "esmm")


def check_tasks(net, schema, model):
    """NetworkError (one line) unless the network has one logit per label of the schema."""
    labels = schema.labels
    if len(labels) > 1 and net.n_tasks == 1:
        raise NetworkError(f"network {model} has one logit but the schema names {len(labels)} "
                           f"labels ({', '.join(labels)}): use a multi-task network "
                           f"(--model {' | '.join(MULTI_TASK)}, or a file with one logit per "
                           f"label; docs/tasks.md)")
    if net.n_tasks > 1 and len(labels) != net.n_tasks:
        raise NetworkError(f"network {model} has {net.n_tasks} logits (tasks) but the schema "
                           f"names {len(labels)} label(s) ({', '.join(labels) or 'none'}): "
                           f"give label = [...] with {net.n_tasks} names (docs/tasks.md)")


__all__ = ("MODELS", "DEFAULT", "NetworkError", "digest", "network_text", "model_digest",
           "extra_cols", "stored_network", "stored_name", "make_net", "builtin", "network_record",
           "ALL", "MULTI_TASK", "check_tasks", "metrics_for")


def builtin(name, n_sparse, dim, n_dense, hidden=(400, 400, 400), **kw):
    """Built-in network ``name`` over S slots of ``dim`` and D dense features (no schema)."""
    if name not in ALL:
        raise NetworkError(f"unknown model {name!r}; choose one of {', '.join(ALL)}")
    return Network(builtin_text(name), n_sparse, dim, n_dense, hidden, name=name, **kw)


def network_record(net):
    """What a manifest or a bundle stores of a network: its name and text."""
    return {"name": net.name, "text": net.text}
