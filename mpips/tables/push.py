"""The push rules: how a step's sparse row gradients, in parts, become updates of the table.

A step's row gradients come in *parts*, in worker order: one per worker (a sync server
gets one push from each), or the W batches that one process takes for W workers
(``--local-workers W``, the simulator).  Each part holds the gradients of its batch's
summed loss over its own unique keys.  ``--sync-sparse-lr`` says how they are applied:

- ``each``: every part is scaled by 1 / its own examples and applied as a push of its own,
  in part order (a row in two parts takes two optimizer steps; what async servers do with
  the workers' pushes as they arrive);
- ``none``: every part is scaled by 1 / the step's examples, the parts are summed per id in
  part order, and the sum is one push (one process with the global batch);
- ``count``: as ``none``, and each row's learning rate is multiplied by the number of parts
  that held it.

The workers scale (:func:`scale`: the trainer, the simulator); whoever holds all the parts
merges them (:func:`merge`: the sync servers, or the one process).  The same two functions
serve the servers (``mpips.server.loop``), the trainer (``mpips.worker.trainer``) and the
simulator (``mpips.worker.simulate``), so the three compute the same updates.
"""
import numpy as np

from mpips.config import PUSH_RULES
from mpips.kernels.embedding import sum_duplicates

RULES = PUSH_RULES                      # --sync-sparse-lr


def apart(rule):
    """Whether the parts are pushed one by one (``each``) rather than summed into one push."""
    return rule == "each"


def scale(rule, grads, own, examples):
    """Scale one part's row gradients ``grads`` (u, dim), of its ``own`` examples' summed
    loss, in place to the gradient of a mean: over ``own`` under ``each``, else over the
    step's ``examples``.  Returns the examples divided by (the --row-clip count)."""
    n = own if apart(rule) else examples
    grads *= np.float32(1.0 / n)
    return n


def parts_holding(every, keys):
    """float32 (u,): of each of the sorted unique ``keys``, how many of the concatenated
    parts' unique key lists ``every`` hold it (the workers whose batches held the row)."""
    return np.bincount(np.searchsorted(keys, every), minlength=len(keys)).astype(np.float32)


def merge(rule, parts):
    """The pushes a step's scaled ``parts`` [(keys (u,) unique, grads (u, dim))] make, in
    the order to apply them: [(keys, grads, lr_scale float32 (u,) or None)].  ``each``: the
    parts as they are; otherwise one push of the sum per id (sorted unique keys; summed in
    part order), with lr_scale the parts holding each row under ``count``."""
    if apart(rule):
        return [(k, g, None) for k, g in parts]
    if not parts:
        return []
    every = np.concatenate([k for k, _ in parts])
    keys, grads = sum_duplicates(every, np.concatenate([g for _, g in parts]))
    return [(keys, grads, parts_holding(every, keys) if rule == "count" else None)]
