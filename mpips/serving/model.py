"""One immutable scoring model: dense network + read-only embedding table + data settings.

``ServingModel`` scores with the training forward pass (the network's ``predict``) on embeddings
looked up in a read-only ``mpips.serving.table.Table`` (a hash map of the sparse table's
layout, plus an overlay of the rows patched since it was built); ids without a row read
zeros, as in evaluation.  ``mpips.infer`` builds one from a checkpoint (``bundle.Snapshot``),
the predictor from a bundle.  Nothing in it changes after construction: a patched model is
a new object (``patched``: the same base table, a new overlay, O(rows patched)), so a
reader holding a reference always sees one whole model.  Scoring is thread-safe: each
thread gets its own network workspace (shared by the versions patched from one model).
"""
import threading

import numpy as np

import mpips.serving.bundle as bd
from mpips.config import parse_fc
from mpips.data.criteo import make_norm
from mpips.models.zoo import extra_cols, make_net, stored_network
from mpips.schema import Schema
from mpips.serving.table import Table, hash_slots  # noqa: F401 - hash_slots: mpips.infer's

CHUNK_ROWS = 8192        # rows scored per forward pass in predict (bounds memory)


class ServingModel:
    """Dense weights + embedding rows + data settings; immutable once built.

    keys (n,) int64 unique; values (n, dim) float (stored as float32), or ``table`` (a
    ``Table``) instead of both; dense (n_params,);
    model {model (--model; default dnn), embedding_dim (row width), fc, n_params};
    data {data_format, hash_bucket, cont_min, cont_diff};
    version: where it came from (a bundle's ``checkpoint`` record); schema: the feature
    schema it was trained on (a ``Schema``; default Criteo's).
    """

    def __init__(self, keys, values, dense, model, data, version=None, slots=None, schema=None,
                 table=None):
        self.dim = int(model["embedding_dim"])                   # table row width
        hidden = parse_fc(model["fc"])
        self.model_cfg, self.data, self.version = dict(model), dict(data), dict(version or {})
        self.name = self.model_cfg.get("model", "dnn")
        try:
            self._net_name, self._net_text = stored_network(self.model_cfg)
            self._hidden = hidden
            self._emb_dim = self.dim - extra_cols(self._net_text)
        except ValueError as e:
            raise bd.BundleError(f"bad model record: {e}") from None
        self.schema = schema or Schema.criteo()
        probe = self._net()
        self.n_sparse, self.n_dense, self.pooling = probe.n_sparse, probe.n_dense, probe.pooling
        self.n_tasks = probe.n_tasks                             # T: one output per task
        self.task_names = self.schema.labels if self.n_tasks > 1 else ()
        self.params = np.ascontiguousarray(dense, np.float32)
        if self.params.shape != (probe.n_params,):
            raise bd.BundleError(f"dense weights have {self.params.shape[0]} values; a "
                                 f"{self.name} with --fc {model['fc']} --embedding-dim "
                                 f"{self._emb_dim} has {probe.n_params}")
        if table is None:
            keys = np.ascontiguousarray(keys, np.int64)
            values = np.ascontiguousarray(values, np.float32)
            if values.shape != (len(keys), self.dim):
                raise bd.BundleError(f"values {values.shape} do not match {len(keys)} "
                                     f"keys of dim {self.dim}")
            table = Table(keys, values, slots)             # slots: built before, or here
        self.table = table
        self.norm = (None if data.get("cont_min") is None else    # no min-max dense value
                     make_norm(data["cont_min"], data["cont_diff"], self.n_dense))
        self.hash_bucket = int(data["hash_bucket"])
        self._local = threading.local()

    @property
    def keys(self):
        """(n,) int64: every id with a row (a folded copy when the table has an overlay)."""
        return self.table.rows()[0]

    @property
    def values(self):
        """(n, dim) float32: their rows, in the order of ``keys``."""
        return self.table.rows()[1]

    def with_table(self, table, params=None, data=None, version=None):
        """This model with another table (e.g. in shared memory, or patched), dense weights
        and settings; the network and its per-thread workspaces are shared."""
        out = object.__new__(ServingModel)
        out.__dict__.update(self.__dict__)
        out.table = table
        if params is not None:
            out.params = np.ascontiguousarray(params, np.float32)
            if out.params.shape != self.params.shape:
                raise bd.BundleError(f"dense weights have {out.params.shape[0]} values; "
                                     f"the model has {self.params.shape[0]}")
        if data is not None and data != self.data:
            out.data = dict(data)
            out.norm = (None if data.get("cont_min") is None else
                        make_norm(data["cont_min"], data["cont_diff"], self.n_dense))
            out.hash_bucket = int(data["hash_bucket"])
        if version is not None:
            out.version = dict(version)
        return out

    def __len__(self):
        return len(self.table)

    def network(self):
        """This thread's network (its workspace is not shareable between threads)."""
        net = getattr(self._local, "net", None)
        if net is None:
            net = self._local.net = self._net()
        return net

    def _net(self):
        return make_net(self._net_name, self.schema, self._emb_dim, self._hidden,
                        text=self._net_text)

    def embed(self, ids, offsets=None):
        """(B, n_sparse * dim) float32 slot embeddings: of one-hot ids (B, n_sparse), or the
        pooled bags of CSR ids (nnz,) with offsets (B*n_sparse + 1,) starting at 0."""
        flat = np.ascontiguousarray(ids, np.int64).reshape(-1)
        emb = self.table.gather(flat, np.empty((flat.shape[0], self.dim), np.float32))
        if offsets is None:
            return emb.reshape(ids.shape[0], -1)
        out = np.empty(((len(offsets) - 1) // self.n_sparse, self.n_sparse * self.dim),
                       np.float32)
        self.network().pool(emb, np.arange(len(flat)), offsets, out)
        return out

    def _check(self, dense, ids, offsets):
        n = dense.shape[0] if dense.ndim == 2 else -1
        if offsets is None:
            ok = ids.ndim == 2 and ids.shape[1] == self.n_sparse and len(ids) == n
            want = f"ids (B, {self.n_sparse})"
        else:
            ok = (ids.ndim == 1 and offsets.shape == (n * self.n_sparse + 1,) and n >= 0
                  and offsets[0] == 0 and offsets[-1] == len(ids)
                  and not np.any(offsets[1:] < offsets[:-1]))
            want = f"ids (nnz,) with offsets (B*{self.n_sparse}+1,) from 0 to nnz, non-decreasing"
        if not ok or dense.shape != (n, self.n_dense):
            raise ValueError(f"need dense (B, {self.n_dense}) and {want}; got dense "
                             f"{dense.shape}, ids {ids.shape}"
                             + ("" if offsets is None else f", offsets {offsets.shape}"))
        if ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be integers (int64 feature ids); got {ids.dtype}")

    def predict(self, dense, ids, out=None, offsets=None):
        """Probabilities (B,) float32 — (B, T) with T tasks — for normalised dense (B, D) and ids: one per slot
        (B, S), or bags in CSR form (nnz,) with ``offsets`` (B*S + 1,) (``mpips.data.reader.Batch``)."""
        dense = np.ascontiguousarray(dense, np.float32)
        ids = np.asarray(ids)
        ids = ids.view(np.int64) if ids.dtype == np.uint64 else ids
        if offsets is not None:
            offsets = np.ascontiguousarray(offsets, np.int64)
        self._check(dense, ids, offsets)
        ids = np.ascontiguousarray(ids, np.int64)
        n = len(dense)
        if out is None:
            out = np.empty((n,) if self.n_tasks == 1 else (n, self.n_tasks), np.float32)
        net = self.network()
        S = self.n_sparse
        if offsets is None and net.attn:             # one id a slot: bags of one, to attend
            ids, offsets = ids.reshape(-1), np.arange(n * S + 1, dtype=np.int64)
        for lo in range(0, n, CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, n)
            if offsets is None:
                emb = self.embed(ids[lo:hi])
            else:
                a, b = offsets[lo * S], offsets[hi * S]
                emb = self.embed(ids[a:b], offsets[lo * S:hi * S + 1] - a)
            net.predict(self.params, emb, dense[lo:hi], out[lo:hi])
        return out

    # ------------------------------------------------------------------ building
    @classmethod
    def from_arrays(cls, manifest, arrays):
        return cls(arrays["sparse/keys"], arrays["sparse/values"], arrays["dense/values"],
                   manifest["model"], manifest["data"], manifest["checkpoint"],
                   schema=bd.schema_of_manifest(manifest))

    @classmethod
    def from_snapshot(cls, snap, stats=""):
        info = bd.bundle_info(snap, stats)
        return cls(snap.keys, snap.values, snap.dense, info["model"], info["data"],
                   info["checkpoint"], schema=bd.schema_of_manifest(info))

    def patched(self, manifest, arrays):
        """A new ServingModel: this one with patch (manifest, arrays) applied."""
        since, mine = manifest["since"], self.version
        if since["name"] != mine.get("name") or manifest["checkpoint"]["lineage"] != \
                mine.get("lineage"):
            raise bd.BundleError(f"patch to {manifest['checkpoint']['name']} applies to "
                                 f"{since['name']}; this predictor holds {mine.get('name')} "
                                 f"({mine.get('lineage')})")
        if not bd.same_model(manifest["model"], self.model_cfg):
            raise bd.BundleError(f"patch model {manifest['model']} differs from {self.model_cfg}")
        diff = self.schema.diff(bd.schema_of_manifest(manifest))
        if diff:
            raise bd.BundleError(f"patch to {manifest['checkpoint']['name']} has another feature "
                                 f"schema than this predictor: {diff} (this vs the patch's)")
        if arrays["sparse/values"].shape != (len(arrays["sparse/keys"]), self.dim):
            raise bd.BundleError(f"patch values {arrays['sparse/values'].shape} do not match "
                                 f"{len(arrays['sparse/keys'])} keys of dim {self.dim}")
        table = self.table.patched(arrays["sparse/keys"], arrays["sparse/values"],
                                   arrays["sparse/evicted"])
        return self.with_table(table, arrays["dense/values"], manifest["data"],
                               manifest["checkpoint"])
