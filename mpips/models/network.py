"""A network built from a TOML description: layers over the pooled slots, the dense
features and the first-order weights, with one logit and sigmoid BCE (docs/models.md), or
one logit per task and a head (mpips.models.tasks; docs/tasks.md).

The trainer hands the network the pooled table rows ``emb`` (B, S x row_dim; a row is
``[v]``, or ``[w | v]`` when an input reads the first-order weights) and the dense features
(B, D); it gets back the loss, the probabilities, d(loss)/d(params) and d(loss)/d(emb).
All parameters live in ONE flat vector (``layout``: (name, offset, shape) in the file's
layer order) so servers and workers can split it into contiguous slices.

Layers run in an order that respects their inputs (among layers ready together, the later
in the file first); gradients go back in the reverse order, so when several layers read
one tensor their gradients add up in a fixed order.  An ``fm2`` and a ``first_order`` that
feed only one ``add``/``sum`` are folded into one float64 pass (the first-order and FM sums
of DeepFM).  Workspaces are allocated for the largest batch seen and re-used.  Not
thread-safe: one network object per thread.
"""
import math

import numpy as np

from mpips.kernels import layers as K
from mpips.kernels.mlp import sigmoid_, sigmoid_bce_
from mpips.kernels.pooling import pool_backward, pool_forward
from mpips.models.attention import AttentionPool
from mpips.models.layers import Concat, Dense, FirstOrder, FM2, SpecError, Sum, Tensor
from mpips.models.tasks import Head, make_layer
from mpips.models.layers import Sink, SplitSink
from mpips.models.spec import NetworkError, digest, parse, substitute

# Weight initialisations: name -> sampler(rng, fan_in, fan_out, size) in float64.
INITS = {
    # PyTorch's nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    "uniform": lambda rng, fi, fo, n: rng.uniform(-1.0, 1.0, n) / math.sqrt(fi),
    # Glorot/Xavier uniform: U(-sqrt(6/(fan_in+fan_out)), +...).
    "xavier": lambda rng, fi, fo, n: rng.uniform(-1.0, 1.0, n) * math.sqrt(6.0 / (fi + fo)),
    # PaddleRec's CTR-DNN: Normal(0, 1/sqrt(fan_in)).
    "normal": lambda rng, fi, fo, n: rng.standard_normal(n) / math.sqrt(fi),
}
# Xavier trained best or tied in a synthetic Criteo-shaped run (400x3, 200 steps of 512):
# test AUC with Adam 1e-3: uniform .7911, xavier .7915, normal .7917; with SGD 0.05:
# uniform .7743, xavier .7847, normal .7827.
DEFAULT_INIT = "xavier"
PREDICT_CHUNK = 4096  # rows per forward pass in predict() when the workspace is smaller
VIEWS_CACHE = 8       # flat arrays whose layer views are kept


def _order(layers, known, where):
    """Indices of ``layers`` [(name, type, inputs, opts)] in an order that respects their
    inputs (ready layers: the later in the file first); a one-line error for an unknown
    input or a cycle."""
    index = {name: i for i, (name, _, _, _) in enumerate(layers)}
    for name, _, refs, _ in layers:
        for r in refs:
            if r not in index and r not in known:
                raise NetworkError(f"{where}: layer {name!r}: inputs: unknown input {r!r} "
                                   f"(not an input of [inputs] nor a layer)")
    done, order = set(known), []
    while len(order) < len(layers):
        ready = [i for i, (n, _, refs, _) in enumerate(layers)
                 if n not in done and all(r in done for r in refs)]
        if not ready:
            stuck = [n for n, _, _, _ in layers if n not in done]
            raise NetworkError(f"{where}: layer {stuck[0]!r}: inputs: a cycle through "
                               f"{', '.join(stuck)}")
        i = max(ready)
        order.append(i)
        done.add(layers[i][0])
    return order


class Network:
    """A network over a flat parameter vector.

    Parameters
    ----------
    text : the network's TOML text (mpips.models.spec).
    n_sparse, dim, n_dense : slots S, embedding dim, dense features D.
    hidden : the ``--fc`` widths (``widths = "fc"`` in the file).
    dtype : float32 for training; float64 for gradient checks.
    init : weight initialisation, one of ``INITS`` (biases and wide weights start at 0).
    pooling : per slot 0 (sum), 1 (mean) or 2 (attention) (``schema.pooling_codes()``);
        the trainer and the scorer pool with ``pool`` and ``unpool``.
    slot_names : the schema's slot names (for inputs that list slots).
    attention : per attention slot (slot, query slot, hidden widths, softmax)
        (``schema.attention()``); their units' weights follow the file's layers.
    """

    def __init__(self, text, n_sparse, dim, n_dense, hidden=(400, 400, 400),
                 dtype=np.float32, init=DEFAULT_INIT, pooling=None, slot_names=None,
                 name="", where="network", attention=()):
        if n_sparse < 0 or n_dense < 0 or n_sparse + n_dense == 0 or dim < 1:
            raise ValueError(f"a network needs n_sparse>=0, n_dense>=0 (not both 0) and "
                             f"dim>=1; got n_sparse={n_sparse}, n_dense={n_dense}, dim={dim}")
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; choose one of {sorted(INITS)}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64; got {self.dtype}")
        self.n_sparse, self.dim, self.n_dense = int(n_sparse), int(dim), int(n_dense)
        self.hidden, self.init, self.text = tuple(int(h) for h in hidden), init, text
        self.pooling = np.zeros(self.n_sparse, np.int8) if pooling is None else \
            np.array(pooling, np.int8)                     # (S,)
        if self.pooling.shape != (self.n_sparse,) or not np.isin(self.pooling, (0, 1, 2)).all():
            raise ValueError(f"pooling must give 0 (sum), 1 (mean) or 2 (attention) for each "
                             f"of the {self.n_sparse} slots; got {pooling!r}")
        if sorted(a[0] for a in attention) != np.flatnonzero(self.pooling == 2).tolist():
            raise ValueError(f"the attention slots {[a[0] for a in attention]} are not the "
                             f"slots of pooling code 2")
        self._attention = list(attention)
        self.pool_codes = np.where(self.pooling == 2, 0, self.pooling).astype(np.int8)
        self._bags = None
        self.slot_names = list(slot_names or [f"C{i + 1}" for i in range(self.n_sparse)])
        self.task_names = ()            # the labels of T > 1 tasks (mpips.models.zoo)
        spec = parse(text, where)
        self.digest = digest(text)
        self.name = name or spec["name"] or "network"
        self._build(spec, where)
        self._ws_cap = 0
        self._views_cache = {}

    # ------------------------------------------------------------------ building
    def _source(self, name, src, where):
        S, d = self.n_sparse, self.dim
        if src == "dense":
            t = Tensor(name, self.n_dense, grad=False)
        elif src == "first_order":
            t = Tensor(name, S, S, 1)
        else:
            slots = list(range(S)) if src == "all" else []
            for s in ([] if src == "all" else src):
                if s not in self.slot_names:
                    raise NetworkError(f"{where}: input {name!r}: source: no slot {s!r} in "
                                       f"the schema (slots: {', '.join(self.slot_names[:8])}"
                                       f"{' ...' if S > 8 else ''})")
                slots.append(self.slot_names.index(s))
            t = Tensor(name, len(slots) * d, len(slots), d)
            t.slots = np.array(slots, np.int64)
            t.cols = (t.slots[:, None] * d + np.arange(d)).reshape(-1)     # columns of p
        t.source = src if isinstance(src, str) else "slots"
        return t

    def _build(self, spec, where):
        self.tensors = {n: self._source(n, src, where) for n, src in spec["inputs"].items()}
        self.inputs = list(self.tensors.values())
        self.has_w = any(t.source == "first_order" for t in self.inputs)
        self.row_dim = self.dim + int(self.has_w)
        self.emb_width = self.n_sparse * self.row_dim
        file_layers, self.layers = [], []
        for i in _order(spec["layers"], set(self.tensors), where):
            name, kind, refs, opts = spec["layers"][i]
            ins = [self.tensors[r] for r in refs]
            try:
                layer = make_layer(kind, name, ins, substitute(opts, self.hidden, self.dim))
            except SpecError as e:
                raise NetworkError(f"{where}: layer {name!r}: {e.field}: {e}") from None
            layer.file_index = i
            out = Tensor(name, layer.width, layer.fields, layer.field_dim, producer=layer)
            out.grad = bool(layer.params) or any(t.grad for t in ins)
            self.tensors[name] = layer.out = out
            for t in ins:
                t.consumers.append(layer)
            self.layers.append(layer)
        self._check_output(spec, where)
        self._fuse()
        self._fuse_relu()
        self.attn = [AttentionPool(f"attn_{self.slot_names[s]}", s, q, self.n_sparse,
                                   self.dim, int(self.has_w), units, soft)
                     for s, q, units, soft in self._attention]
        self._layout(sorted(self.layers, key=lambda L: L.file_index) + self.attn)
        self._split = {L.name for L in self.layers if isinstance(L, Concat)   # read by one:
                       and len(L.out.consumers) == 1}             # its parts get their columns

    def _check_output(self, spec, where):
        self.logits = []
        for logit in spec["logits"]:
            if logit not in self.tensors or self.tensors[logit].producer is None:
                raise NetworkError(f"{where}: [output]: logits: {logit!r} is not a layer")
            t = self.tensors[logit]
            if t.width != 1:
                raise NetworkError(f"{where}: layer {logit!r}: width: the logit must have "
                                   f"width 1; it has {t.width} (end with a linear of width 1)")
            self.logits.append(t)
        self.logit, self.n_tasks = self.logits[0], len(self.logits)
        self.head = Head(self.n_tasks, spec.get("head", "independent"),
                         spec.get("loss_weights")) if self.n_tasks > 1 else None
        logit = ", ".join(spec["logits"])
        used, todo = set(), list(self.logits)
        while todo:
            t = todo.pop()
            if t.name not in used:
                used.add(t.name)
                todo += t.producer.ins if t.producer is not None else []
        for t in list(self.inputs) + [L.out for L in self.layers]:
            if t.name not in used:
                what = "input" if t.producer is None else "layer"
                raise NetworkError(f"{where}: {what} {t.name!r}: inputs: unused (it does not "
                                   f"reach the logit {logit!r}); remove it or use it")
        covered = set()
        for t in self.inputs:
            covered |= set(getattr(t, "slots", np.zeros(0, np.int64)).tolist())
        missing = [self.slot_names[s] for s in range(self.n_sparse) if s not in covered]
        if missing:
            raise NetworkError(f"{where}: [inputs]: source: slot {missing[0]} is in no input "
                               f"(add it to one, or use \"all\")")

    def _fuse(self):
        """Fold an fm2 and a first_order that feed only the same add/sum into one float64
        pass (the FM and first-order sums of DeepFM); ``fused``: their names, or None."""
        self.fused = None
        for s in [L for L in self.layers if isinstance(L, Sum)]:
            fos = [L for L in (t.producer for t in s.ins) if isinstance(L, FirstOrder)
                   and L.out.consumers == [s] and not L.fm_fields]
            fms = [L for L in (t.producer for t in s.ins) if isinstance(L, FM2)
                   and L.out.consumers == [s]]
            if fos and fms:
                fo, fm = fos[0], fms[0]
                fo.fuse_fm(fm)
                s.ins.remove(fm.out)
                fm.ins[0].consumers[fm.ins[0].consumers.index(fm)] = fo
                self.layers.remove(fm)
                self.fused = (fo.name, fm.name)

    def _fuse_relu(self):
        """A width-1 identity linear that alone reads a relu linear/mlp writes that layer's
        d(pre-activation) and bias gradient itself: one pass instead of two (the same
        bits: the mask and the sums are the same operations)."""
        for L in self.layers:
            t = L.ins[0]
            below = t.producer
            if (isinstance(L, Dense) and L.widths == [1] and L.act == "identity"
                    and isinstance(below, Dense) and below.act == "relu"
                    and t.consumers == [L] and t not in self.logits):
                L.fuse_relu_below(below)

    def _layout(self, in_file_order):
        """``layout``: (name, offset, shape) of every parameter in the flat vector; ``fans``:
        name -> the (fan_in, fan_out) its initialiser draws with, or None (starts at zero)."""
        self.layout, self.fans, off = [], {}, 0
        for layer in in_file_order:
            for pname, shape, fan in layer.params:
                self.layout.append((pname, off, shape))
                self.fans[pname] = fan
                off += int(np.prod(shape))
        self.n_params = off
        if off == 0:
            raise NetworkError("a network needs at least one layer with weights")

    # ------------------------------------------------------------------ parameters
    def init_params(self, seed: int) -> np.ndarray:
        """A fresh parameter vector (n_params,), deterministic from ``seed``."""
        rng = np.random.default_rng(seed)
        params = np.zeros(self.n_params, self.dtype)
        sampler = INITS[self.init]
        for name, off, shape in self.layout:
            fan = self.fans[name]
            if fan is not None:
                n = int(np.prod(shape))
                params[off:off + n] = sampler(rng, fan[0], fan[1], n)
        return params

    def views(self, params: np.ndarray) -> dict:
        """Named views into a flat vector (parameters or gradients), no copies."""
        return {name: params[off:off + int(np.prod(shape))].reshape(shape)
                for name, off, shape in self.layout}

    def _views(self, flat):
        """The views of ``flat``, cached per array (the trainer reuses a few buffers)."""
        hit = self._views_cache.get(id(flat))
        if hit is not None and hit[0] is flat:
            return hit[1]
        v = self.views(flat)
        if len(self._views_cache) >= VIEWS_CACHE:
            self._views_cache.pop(next(iter(self._views_cache)))
        self._views_cache[id(flat)] = (flat, v)
        return v

    # ------------------------------------------------------------------ workspace
    def _workspace(self, n):
        if self._ws_cap >= n:
            return
        cap, dt = n, self.dtype
        self._out = {L.out.name: np.empty((cap, L.width), dt) for L in self.layers}
        self._grad = {t.name: np.empty((cap, t.width), dt) for t in self.tensors.values()
                      if t.grad}
        if self.has_w:
            self._p = np.empty((cap, self.n_sparse * self.dim), dt)     # (B, S*d) split rows
            self._gp = np.empty((cap, self.n_sparse * self.dim), dt)
            self._w = np.empty((cap, self.n_sparse), dt)                # (B, S) first order
            self._gw = np.empty((cap, self.n_sparse), dt)
        for t in self.inputs:
            if t.source == "slots":
                self._out[t.name] = np.empty((cap, t.width), dt)
        for L in self.layers:
            L.alloc(cap, dt)
        self.probs = np.empty(cap, dt)
        if self.head is not None:
            self.head.alloc(cap, dt)
        self._ws_cap = cap

    def _check_vec(self, arr, name, n):
        if not isinstance(arr, np.ndarray) or arr.dtype != self.dtype or arr.shape != (n,) \
                or not arr.flags.c_contiguous:
            got = (getattr(arr, "dtype", type(arr)), getattr(arr, "shape", None))
            raise ValueError(f"{name} must be a C-contiguous {self.dtype} array of shape "
                             f"({n},); got {got}")

    def _check_inputs(self, emb, dense):
        batch = emb.shape[0] if emb.ndim == 2 else -1
        if emb.shape != (batch, self.emb_width) or batch < 1:
            raise ValueError(f"emb must have shape (B>=1, {self.emb_width}) = (B, n_sparse*"
                             f"row_dim); got {emb.shape}")
        if dense.shape != (batch, self.n_dense):
            raise ValueError(f"dense must have shape ({batch}, {self.n_dense}); got {dense.shape}")
        for arr, name in ((emb, "emb"), (dense, "dense")):
            if arr.dtype.kind != "f":
                raise ValueError(f"{name} must be a float array; got {arr.dtype}")
        return batch

    # ------------------------------------------------------------------ pooling
    def pool(self, rows, inverse, offsets, out):
        """Pool a CSR batch's bags into the network's input ``out`` (B, S*row_dim): sum or
        mean (``mpips.kernels.pooling``; an attention slot's columns are finished by the
        forward pass, which needs the weights).  ``rows`` (u, row_dim) the pulled rows,
        ``inverse`` (nnz,) each id's row, ``offsets`` (B*S+1,)."""
        pool_forward(rows, inverse, offsets, self.pool_codes, out)
        self._bags = (rows, inverse, offsets, out.shape[0]) if self.attn else None

    def unpool(self, grad_emb, inverse, offsets, grads):
        """The rows' gradients ``grads`` (u, row_dim) from d(loss)/d(input) (B, S*row_dim)
        of the last ``forward_backward`` (attention slots: the ids' gradients it kept)."""
        pool_backward(grad_emb, inverse, offsets, self.pool_codes, grads)
        for a in self.attn:
            a.add_row_grads(grads)

    def _attend(self, P, emb, n, row0):
        """Attention slots: their columns of ``emb`` (rows row0.. of the pooled batch)."""
        if self._bags is None or row0 + n > self._bags[3]:
            raise ValueError("attention pooling needs the batch's bags: pool() it first "
                             "(CSR ids with offsets; one-hot batches cannot attend)")
        for a in self.attn:
            a.forward(P, emb, self._bags[:3], row0, n)

    # ------------------------------------------------------------------ maths
    def _forward(self, params, emb, dense, n, row0=0):
        """Every layer's output for a batch of ``n``; returns the logit view (n,)."""
        self._workspace(n)
        vals = {}
        if self.attn:
            self._attend(self._views(params), emb, n, row0)
        p = emb
        if self.has_w:
            p = self._p[:n]
            K.split_rows_(emb, self.n_sparse, self._w[:n], p)
        for t in self.inputs:
            if t.source == "dense":
                vals[t.name] = dense
            elif t.source == "first_order":
                vals[t.name] = self._w[:n]
            elif t.source == "all":
                vals[t.name] = p
            else:
                vals[t.name] = np.take(p, t.cols, axis=1, out=self._out[t.name][:n])
        P = self._views(params)
        for L in self.layers:
            out = self._out[L.out.name][:n]
            L.forward(P, [vals[t.name] for t in L.ins], out, n)
            vals[L.out.name] = out
        self._vals = vals
        if self.head is not None:
            return [vals[t.name].reshape(n) for t in self.logits]
        return vals[self.logit.name].reshape(n)

    def _sink(self, t, n, counts):
        if not t.grad:
            return None
        if t.producer is not None and t.producer.name in self._split:
            parts = [(lo, hi, self._sink(x, n, counts))
                     for (lo, hi), x in zip(t.producer.cols, t.producer.ins)]
            return SplitSink(self._grad[t.name][:n], parts)

        key = {"all": "__p", "first_order": "__w"}.get(t.source, t.name)

        def done():
            counts[key] = counts.get(key, 0) + 1
        return Sink(self._gbuf(key, n), counts.get(key, 0) > 0, done)

    def _gbuf(self, key, n):
        """The gradient buffer of a tensor (every "all" input shares the rows' one)."""
        if key == "__p":
            return self._gp[:n] if self.has_w else self._gemb
        return self._gw[:n] if key == "__w" else self._grad[key][:n]

    def _backward(self, params, grad_out, grad_emb_out, n):
        """Gradients of the loss whose d/d(logit) is already in the logit's grad buffer."""
        P, G = self._views(params), self._views(grad_out)
        self._gemb = grad_emb_out
        counts = {t.name: 1 for t in self.logits}
        vals = self._vals
        for L in reversed(self.layers):
            if L.name in self._split or not L.out.grad or L.out.name not in counts:
                continue
            sinks = [self._sink(t, n, counts) for t in L.ins]
            L.backward(P, G, [vals[t.name] for t in L.ins], vals[L.out.name],
                       self._grad[L.out.name][:n], sinks, n)
        self._gather_inputs(grad_emb_out, counts, n)
        for a in reversed(self.attn):
            a.backward(P, G, grad_emb_out, n)

    def _gather_inputs(self, grad_emb_out, counts, n):
        """The inputs' gradients into d(loss)/d(emb) (B, S x row_dim)."""
        gp = self._gp[:n] if self.has_w else grad_emb_out
        if not counts.get("__p"):
            gp[...] = 0
        for t in self.inputs:
            if t.source == "slots" and counts.get(t.name):
                gp[:, t.cols] += self._grad[t.name][:n]
        if self.has_w:
            if not counts.get("__w"):
                self._gw[:n] = 0
            K.merge_rows_(self._gw[:n], gp, self.n_sparse, grad_emb_out)

    def forward_backward(self, params, emb, dense, label, grad_out, grad_emb_out, scale=None):
        """Loss, probabilities and gradients of ``scale`` x the SUMMED loss of the batch.

        Parameters
        ----------
        params : (n_params,) model dtype.
        emb : (B, n_sparse*row_dim) float; pooled slot rows, slot-major.
        dense : (B, n_dense) float; normalised dense features.
        label : (B,) 0/1 labels (any numeric dtype); (B, T) with T tasks.
        grad_out : (n_params,) model dtype, output; overwritten with d(loss)/d(params).
        grad_emb_out : (B, n_sparse*row_dim) model dtype, output; d(loss)/d(emb).
        scale : gradient scale; default 1/B (the gradients of the mean loss); 1.0 gives the
            gradients of the summed loss, which W workers' parts add up exactly.

        Returns
        -------
        (loss, probs) : mean loss as a Python float (the tasks' weighted sum), and sigmoid
        outputs (B,), or (B, T) with T tasks — a view into the workspace, valid until the
        next call.
        """
        self._check_vec(params, "params", self.n_params)
        self._check_vec(grad_out, "grad_out", self.n_params)
        batch = self._check_inputs(emb, dense)
        want = (batch,) if self.head is None else (batch, self.n_tasks)
        if label.shape != want:
            raise ValueError(f"label must have shape {want}; got {label.shape}")
        if grad_emb_out.shape != (batch, self.emb_width) or grad_emb_out.dtype != self.dtype \
                or not grad_emb_out.flags.c_contiguous:
            raise ValueError(f"grad_emb_out must be a C-contiguous {self.dtype} array of shape "
                             f"({batch}, {self.emb_width}); got {grad_emb_out.dtype} "
                             f"{grad_emb_out.shape}")
        logit = self._forward(params, emb, dense, batch)
        total, probs = self._loss(logit, label, 1.0 / batch if scale is None else scale, batch)
        self._backward(params, grad_out, grad_emb_out, batch)
        return total / batch, probs

    def _loss(self, logit, label, scale, n):
        """(summed loss, probabilities) of the forward's logit(s); d(loss)/d(logits) into
        their gradient buffers."""
        if self.head is None:
            probs = self.probs[:n]
            dlogit = self._grad[self.logit.name][:n].reshape(n)
            return sigmoid_bce_(logit, label, probs, dlogit, scale), probs
        dlogits = [self._grad[t.name][:n].reshape(n) for t in self.logits]
        total = self.head.loss(logit, label, dlogits, scale, n)
        return total, self.head.probs[:n]

    def predict(self, params, emb, dense, out) -> None:
        """Write sigmoid probabilities (B,) — (B, T) with T tasks — into ``out`` (any float
        dtype)."""
        self._check_vec(params, "params", self.n_params)
        batch = self._check_inputs(emb, dense)
        want = (batch,) if self.head is None else (batch, self.n_tasks)
        if out.shape != want or out.dtype.kind != "f":
            raise ValueError(f"out must be a float array of shape {want}; got "
                             f"{out.dtype} {out.shape}")
        chunk = max(self._ws_cap, min(batch, PREDICT_CHUNK))
        for start in range(0, batch, chunk):
            stop = min(start + chunk, batch)
            logit = self._forward(params, emb[start:stop], dense[start:stop], stop - start,
                                  start)
            if self.head is not None:
                self.head.predict(logit, out[start:stop], stop - start)
                continue
            probs = self.probs[:stop - start]
            sigmoid_(logit, probs)
            out[start:stop] = probs

    def loss(self, params, emb, dense, label) -> float:
        """Mean BCE loss without gradients (uses the forward workspace)."""
        self._check_vec(params, "params", self.n_params)
        batch = self._check_inputs(emb, dense)
        logit = self._forward(params, emb, dense, batch)
        return self._loss(logit, label, 1.0, batch)[0] / batch
