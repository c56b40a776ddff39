"""May this checkpoint be used here?  Answered in this one module, for resume, infer, export
and serving alike:

* ``check_resume``: a run continuing from a chain (its elements agree with each other, with
  the run's config on every setting that changes what the numbers mean, ``MEANING``, and
  with the run's feature schema); ``check_kind``: a stream's checkpoint for a stream, a
  batch run's for a batch run, unless ``--resume`` names it;
* ``check_elements``: a chain scored or exported (one meaning throughout, this mpips's id
  hashing);
* ``check_wanted``: the network (``--network``) and schema (``--schema``) infer and export
  were told to expect;
* ``check_model``: a checkpoint holds the named network.
"""
import dataclasses
import json
import os

from mpips.checkpoint.manifest import UNKNOWN, CheckpointError, run_settings, saved_settings
from mpips.config import Config, parse_fc
from mpips.models.zoo import model_digest, stored_name
from mpips.schema import check_same, load_schema, stored_schema

ORDER_KEYS = ("shuffle", "shuffle_window", "seed", "batch_size", "global_batch",
              "local_workers")     # a mid-epoch resume skips batches: their order must match


# Settings that change what the numbers in a checkpoint mean (a row's id, a weight's place,
# an optimizer state's kind): a checkpoint is resumed, scored and exported only with the
# values it was saved with.  (key, flag, what it decides).  A key that is a Config field
# is compared as stored in the manifest's config (a field missing there is one saved
# before the field existed, i.e. with its default); the others are derived and stored in
# the manifest's "settings" (mpips.checkpoint.run_settings).  `model` (--model) is one:
# a checkpoint saved before it existed is a dnn's (the default).
MEANING = (
    ("network", "--model", "the network the weights belong to"),
    ("hash_bucket", "--hash-bucket", "which row each feature value maps to"),
    ("ids", "feature-id hashing", "which row each feature value maps to"),
    ("norm", "--stats", "the dense inputs the weights were trained on"),
    ("embedding_dim", "--embedding-dim", "the width of every row"),
    ("fc", "--fc", "the layout of the dense weights"),
    ("optimizer", "--optimizer", "the optimizer state stored with every row"),
)
_NORMALISE = {"hash_bucket": int, "embedding_dim": int, "fc": parse_fc,
              "optimizer": str}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def _meaning(config, settings, skip=()):
    """{key: value} of the MEANING keys (but ``skip``) for a config dict and its derived
    settings."""
    out = {}
    for key, _, _ in MEANING:
        if key in skip:
            continue
        if key in settings:
            out[key] = settings[key]
        elif key == "network":      # a run, or a checkpoint saved before networks were files
            out[key] = model_digest(config.get("model", _DEFAULTS["model"]))
        else:
            value = config.get(key, _DEFAULTS.get(key))
            out[key] = _NORMALISE.get(key, lambda v: v)(value)
    return out


def saved_meaning(manifest):
    """The MEANING values a checkpoint was saved with."""
    config = dict(manifest["config"])
    config.setdefault("embedding_dim", manifest["embedding_dim"])
    config.setdefault("optimizer", manifest["optimizer"]["name"])
    return _meaning(config, saved_settings(manifest))


def run_meaning(cfg, skip=(), schema=None):
    """The MEANING values of a run config (a Config or its dict); reads its --stats file
    unless "norm" is in ``skip`` (keys in ``skip`` read UNKNOWN: never compared), with as
    many values as ``schema`` (default: the config's --schema file, else Criteo's) has
    dense inputs."""
    config = cfg if isinstance(cfg, dict) else json.loads(cfg.to_json())
    if "norm" in skip or not config.get("stats"):
        settings = run_settings(dict(config, stats=""))
    else:
        if schema is None and config.get("schema"):
            schema = load_schema(config["schema"])
        settings = run_settings(config, schema)
    return dict(_meaning(config, settings, skip), **dict.fromkeys(skip, UNKNOWN))


def _show(key, flag, value, config, other):
    """One setting's value for a message; the normalisation by its first differing value."""
    if key == "network":
        return f"{flag} {config.get('model', _DEFAULTS['model'])} (network {value})"
    if key != "norm":
        return f"{flag} {','.join(map(str, value)) if key == 'fc' else value}"
    if value is None:
        return "no --stats"
    where = config.get("stats") or "?"
    if not isinstance(other, dict):
        return f"--stats {where}"
    if len(value["cont_min"]) != len(other["cont_min"]):
        return f"--stats {where} ({len(value['cont_min'])} dense values)"
    k = next((i for i in range(len(value["cont_min"])) if (value["cont_min"][i],
              value["cont_diff"][i]) != (other["cont_min"][i], other["cont_diff"][i])), 0)
    criteo = not config.get("schema") and len(value["cont_min"]) == 13    # I1..I13
    name = f"I{k + 1}" if criteo else f"dense value {k + 1}"
    return (f"--stats {where} ({name}: cont_min {value['cont_min'][k]:g}, cont_diff "
            f"{value['cont_diff'][k]:g})")


def _fix(key, flag, value, config):
    """How to run with the saved value of a setting."""
    if key == "ids":
        return "use the mpips version that saved it, or train a new model"
    if key == "network":
        return (f"run with the network it was saved with (python -m mpips.train --print-model "
                f"{config.get('model', _DEFAULTS['model'])} prints a built-in one), or do not "
                f"resume from it")
    if key == "norm":
        use = ("run without --stats" if value is None else
               f"run with --stats {config.get('stats')} (or a file of the same values)")
    else:
        use = f"run with {_show(key, flag, value, config, None)}"
    return use + ", or do not resume from it"


def first_difference(saved, now):
    """The first MEANING row (key, flag, what) where two value dicts differ, or None."""
    for key, flag, what in MEANING:
        a, b = saved[key], now[key]
        if a != b and UNKNOWN not in (a, b):
            return key, flag, what
    return None


def check_compatible(manifest, cfg, fix=None, skip=(), schema=None):
    """Raise CheckpointError naming the first setting where ``cfg`` (a Config or a config
    dict) cannot use the checkpoint: one line with the setting, both values and ``fix``
    (default: run with the saved value, or do not resume).  ``skip``: MEANING keys not
    to compare (scoring and export use the stored normalisation values, not the file's);
    ``schema``: the one to read ``cfg``'s --stats for (default: its --schema file's)."""
    now = cfg if isinstance(cfg, dict) else json.loads(cfg.to_json())
    saved = dict(manifest["config"])
    s_val, n_val = saved_meaning(manifest), run_meaning(now, skip, schema)
    diff = first_difference(s_val, n_val)
    if diff is not None:
        key, flag, what = diff
        was = _show(key, flag, s_val[key], saved, n_val[key])
        fix = fix or _fix(key, flag, s_val[key], saved)
        raise CheckpointError(
            f"checkpoint seq {manifest['seq']} was saved with {was}; this run has "
            f"{_show(key, flag, n_val[key], now, s_val[key])} (it decides {what}): {fix}")
    if (manifest.get("meta") or {}).get("complete", True):
        return
    for key in ORDER_KEYS:      # a mid-epoch resume skips batches: their order must match
        if key in saved and key in now and saved[key] != now[key]:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(
                f"checkpoint seq {manifest['seq']} was saved mid-epoch with {flag} "
                f"{saved[key]}; this run has {flag} {now[key]}, so skipping the batches "
                f"done would skip other rows (use the same {flag})")


def check_chain(elements):
    """Raise CheckpointError if the elements [(dir, manifest)] of a base..delta chain were
    saved with different MEANING values (one would be read with the other's meaning)."""
    last_dir, last = elements[-1]
    want = saved_meaning(last)
    for d, m in elements[:-1]:
        diff = first_difference(saved_meaning(m), want)
        if diff is not None:
            key, flag, _ = diff
            raise CheckpointError(
                f"{last_dir}: its chain mixes settings: {os.path.basename(d)} was saved with "
                f"{_show(key, flag, saved_meaning(m)[key], m['config'], want[key])}, "
                f"{os.path.basename(last_dir)} with "
                f"{_show(key, flag, want[key], last['config'], saved_meaning(m)[key])} "
                "(use a checkpoint whose base and deltas come from one run)")



def check_resume(elements, cfg, schema):
    """Raise CheckpointError unless a run of ``cfg`` with feature ``schema`` may continue from
    the chain ``elements`` [(dir, manifest)]: one meaning throughout the chain, the run's on
    every MEANING setting (its --stats read for ``schema``'s dense width), and its schema."""
    path, manifest = elements[-1]
    check_chain(elements)
    check_compatible(manifest, cfg, schema=schema)
    check_same(stored_schema(manifest), schema, f"checkpoint {path}")


def check_elements(elements):
    """A chain [(dir, manifest)] must mean one thing throughout (every setting of
    ``MEANING``), and its ids this mpips's hashing (scoring and export take the rest from the
    stored config and settings)."""
    check_chain(elements)
    check_compatible(elements[-1][1], elements[-1][1]["config"], skip=("norm", "network"))


def check_model(manifest, want, where):
    """ValueError (one line) unless checkpoint ``manifest`` holds model ``want`` (empty:
    any)."""
    have = stored_name(manifest)
    if want and want != have:
        raise ValueError(f"{where} holds a {have} model, not {want} (drop the flag or give "
                         f"{have}, or use a {want} checkpoint)")


def check_wanted(manifest, path, network="", schema=""):
    """infer's and export's --network and --schema: fail (one line) unless checkpoint
    ``path`` (``manifest``) holds that network and was trained on that schema file's
    layout."""
    if network:
        check_model(manifest, network, f"checkpoint {path}")
    if schema:
        check_same(stored_schema(manifest), load_schema(schema), f"checkpoint {path}")


def is_stream_checkpoint(manifest):
    """Was this checkpoint saved by a stream run (it records the pass it ends with)?"""
    return "pass" in (manifest.get("meta") or {})


def where(manifest):
    """Where a checkpoint's run stood: 'after pass P', 'pass P, N batches done: stopped
    inside it, ...', 'after epoch E' or 'epoch E, N batches done'."""
    meta = manifest.get("meta") or {}
    if is_stream_checkpoint(manifest):
        if meta.get("in_pass"):
            after = f", after pass {meta['pass']}" if meta["pass"] else ""
            return (f"pass {meta['in_pass']}, {meta.get('steps', 0)} batches done: stopped "
                    f"inside it{after}")
        return f"after pass {meta['pass']}"
    if meta.get("complete", True):
        return f"after epoch {meta.get('epoch', '?')}"
    return f"epoch {meta.get('epoch', '?')}, {meta.get('steps', '?')} batches done"


def check_kind(cfg, path, manifest):
    """Raise CheckpointError if `path` is of the other kind than this run (stream / batch)
    and was picked implicitly (a stream's own --save-dir, or the newest in a --resume root):
    its tables would be trained on silently.  Naming the checkpoint in --resume allows it
    (a warm start: a stream from its first ready pass, a batch run from epoch 0 on)."""
    stream_ckpt = is_stream_checkpoint(manifest)
    if stream_ckpt == bool(cfg.stream):
        return
    if cfg.resume and os.path.normpath(cfg.resume) == os.path.normpath(path):
        return
    kind = "a stream run's" if stream_ckpt else "a batch (non-stream) run's"
    run = "stream" if cfg.stream else "batch"
    found = (f"--save-dir {cfg.save_dir} holds" if not cfg.resume
             else f"--resume {cfg.resume}: its newest checkpoint is")
    raise CheckpointError(
        f"{found} {path} ({where(manifest)}), {kind} checkpoint, and this is a {run} run; "
        f"give this run {'its own --save-dir' if not cfg.resume else 'a checkpoint of its kind'}"
        f", or start from that one on purpose with --resume {path}")
