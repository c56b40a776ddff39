"""HDF5 checkpoints: full, base and delta saves, atomic commit, chains, re-sharding on load.

Layout of a checkpoint root::

    ROOT/ckpt-000001-base/shard-00000-of-00002.h5    one file per server (h5py, no pickle)
                         /shard-00001-of-00002.h5
                         /MANIFEST.json             written LAST: its presence commits
    ROOT/ckpt-000002-delta/...                      parent: ckpt-000001-base

Modes (Paddle's ``save_persistables(mode)`` 0/1/2):

* ``full``  every row with its optimizer state and metadata; change tracking untouched;
* ``base``  the same, then ``clear_dirty()``/``clear_evicted()``: tracking starts here;
* ``delta`` the rows changed (dirty) and the ids evicted since the last base/delta, then
  clear.  Its manifest names its ``parent`` so ``chain(delta)`` walks back to a base.
The dense slice of each server and its optimizer state are saved in every mode.

A shard file holds ``/sparse/<field>`` for each row field of the table but ``dirty``
(``keys`` int64 (n,), ``values`` float32 (n, dim), optimizer state, ``unseen``,
``seen_count``, ``seen_flag``), ``/sparse/evicted`` int64 (k,) and ``/dense/<name>``
(``values`` and the optimizer state of the slice at ``dense_lo``).  Datasets are
contiguous and uncompressed.  The manifest records, per shard, the file size and for
every dataset its shape, dtype and CRC-32; all are verified on load.  Any problem
raises :class:`CheckpointError` (a ``ValueError``) naming the directory or file and what
is wrong.

Saving is collective in the caller's hands: one rank makes the directory
(:func:`new_checkpoint_dir`), every server calls :func:`save_shard` on its quiesced
tables, and one rank gathers the returned dicts and calls :func:`write_manifest`.
Loading: every server calls :func:`load_shard_into` with its own index and the new
server count; ids are re-assigned by ``owner_of`` so S servers' files load into any S'.

Deltas are exact for every field: a row is dirty whenever it is seen (pulled for
training, pushed, added), so a row a delta leaves out changed only by ``shrink`` ageing
it; the delta's shard entries record how many shrinks ran since its parent
(``shrinks``), and loading ages the rows of the earlier elements by that many before
importing the delta's rows.  With admission the waiting counts (``/admission/<field>``,
``/admission/evicted``) are saved the same way, with the ``admitted`` counter.  A
delta's parent is the checkpoint the tables were loaded from or last saved as base or
delta (:class:`Lineage`), so a run resumed from an older checkpoint into the same root
never chains onto the abandoned run's deltas.  Datasets and entry keys added since
version 1 first shipped are optional on read.

Trust: the manifest is sealed by its own SHA-256 (``checksum``), so an edited manifest is
refused; a root's checkpoint is chosen only once its whole chain verifies (every CRC), and
one that does not is passed over with a warning for the next older one.
"""
from mpips.checkpoint.load import (latest, load_config, load_local, load_shard_into, resolve,
                                   verify)
from mpips.checkpoint.manifest import (MANIFEST, MODES, CheckpointError, Lineage, chain,
                                       list_checkpoints, new_checkpoint_dir, read_manifest,
                                       run_settings, saved_settings, shard_name,
                                       write_manifest)
from mpips.checkpoint.prune import prune
from mpips.checkpoint.save import save_local, save_shard, server_save_hooks

__all__ = ["MANIFEST", "MODES", "CheckpointError", "Lineage", "chain", "latest",
           "list_checkpoints",
           "load_config", "load_local", "load_shard_into", "new_checkpoint_dir", "prune",
           "read_manifest", "resolve", "run_settings", "save_local", "save_shard",
           "saved_settings", "server_save_hooks", "shard_name", "verify",
           "write_manifest"]
