"""The networks as they were before networks were files (mpips 0.1's CTRDNN, WideDeep and
DeepFM classes and their first-order/FM kernels), kept unchanged as the reference that the
layer path must equal bit for bit (tests/test_networks.py).  Not used by mpips itself."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from mpips.kernels.mlp import (
    bias_relu_,
    outer_relu_backward_colsum_,
    relu_backward_colsum_,
    sigmoid_,
    sigmoid_bce_,
)


@njit(cache=True, nogil=True)
def wide_fm_forward_(emb, n_slots, use_fm, x_out, wide_out):
    """Split the pooled rows and compute the per-example first-order (+ FM) sum.

    Parameters
    ----------
    emb : float (B, S*W)       pooled ``[w | p]`` rows, slot-major
    n_slots : int              S
    use_fm : bool              add the FM term
    x_out : float (B, >= S*d)  out: columns [0, S*d) get ``p`` (the MLP input), slot-major
    wide_out : float (B,)      out: first[i] (+ fm[i])

    Returns
    -------
    None
    """
    n = emb.shape[0]
    W = emb.shape[1] // n_slots
    d = W - 1
    for i in range(n):
        first = 0.0
        for f in range(n_slots):
            first += emb[i, f * W]
            for k in range(d):
                x_out[i, f * d + k] = emb[i, f * W + 1 + k]
        fm = 0.0
        if use_fm:
            for k in range(d):
                s = 0.0
                q = 0.0
                for f in range(n_slots):
                    v = float(emb[i, f * W + 1 + k])
                    s += v
                    q += v * v
                fm += s * s - q
        wide_out[i] = first + 0.5 * fm
    return None


@njit(cache=True, nogil=True)
def wide_fm_backward_(emb, n_slots, use_fm, dlogit, grad_p, grad_out):
    """Gradient into the pooled ``[w | p]`` rows: d(first)/d(w) = 1, d(fm)/d(p_fk) =
    ``sum_g p_gk - p_fk``, plus the MLP's gradient ``grad_p`` for the ``p`` columns.

    Parameters
    ----------
    emb : float (B, S*W)        the forward's input
    n_slots : int               S
    use_fm : bool               the FM term is in the logit
    dlogit : float (B,)         d(loss)/d(logit)
    grad_p : float (B, S*d)     d(loss)/d(p) through the MLP
    grad_out : float (B, S*W)   out: d(loss)/d(emb), overwritten

    Returns
    -------
    None
    """
    n = emb.shape[0]
    W = emb.shape[1] // n_slots
    d = W - 1
    for i in range(n):
        g = dlogit[i]
        for f in range(n_slots):
            grad_out[i, f * W] = g
            for k in range(d):
                grad_out[i, f * W + 1 + k] = grad_p[i, f * d + k]
        if use_fm:
            for k in range(d):
                s = 0.0
                for f in range(n_slots):
                    s += emb[i, f * W + 1 + k]
                for f in range(n_slots):
                    grad_out[i, f * W + 1 + k] += g * (s - emb[i, f * W + 1 + k])
    return None


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


class _Workspace:
    """Preallocated activations and gradients for batches of up to ``cap`` rows."""

    def __init__(self, cap: int, n_in: int, hidden: tuple, dtype):
        self.cap = cap
        self.x = np.empty((cap, n_in), dtype)                            # (B, n_in)
        self.act = [np.empty((cap, h), dtype) for h in hidden]           # (B, h_l)
        self.grad = [np.empty((cap, h), dtype) for h in hidden]          # (B, h_l)
        self.logit = np.empty(cap, dtype)                                # (B,)
        self.dlogit = np.empty(cap, dtype)                               # (B,)
        self.probs = np.empty(cap, dtype)                                # (B,)


VIEWS_CACHE = 8      # flat arrays whose layer views are kept


class CTRDNN:
    """The CTR-DNN dense network over a flat parameter vector.

    ``name`` is its ``--model``; ``row_dim`` the width of its sparse table rows (``dim``
    here; models that learn a first-order weight per id add one column, mpips.models.zoo);
    ``emb_width`` the width of the pooled input ``emb`` (n_sparse x row_dim).

    Parameters
    ----------
    n_sparse : number of sparse slots S (``schema.n_sparse``).
    dim : embedding dimension per slot.
    n_dense : number of dense features D (``schema.n_dense``).
    hidden : widths of the ReLU layers (at least one).
    dtype : float32 for training; float64 is supported for gradient checks.
    init : weight initialisation, one of ``INITS`` (biases start at 0).
    pooling : per slot, how its bag of ids is pooled into its ``dim`` inputs (0 sum, 1 mean;
        ``schema.pooling_codes()``); default all sum.  The network itself does not use it:
        the trainer and the scorer pool with it (``mpips.kernels.pooling``).
    """
    name = "dnn"
    EXTRA_COLS = 0       # table columns before the embedding (1: the first-order weight w)

    def __init__(self, n_sparse, dim, n_dense, hidden=(400, 400, 400),
                 dtype=np.float32, init=DEFAULT_INIT, pooling=None):
        hidden = tuple(int(h) for h in hidden)
        if n_sparse < 0 or n_dense < 0 or n_sparse + n_dense == 0 or dim < 1:
            raise ValueError(f"CTRDNN needs n_sparse>=0, n_dense>=0 (not both 0) and dim>=1; "
                             f"got n_sparse={n_sparse}, n_dense={n_dense}, dim={dim}")
        if not hidden or min(hidden) < 1:
            raise ValueError(f"hidden must list at least one positive width; got {hidden}")
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; choose one of {sorted(INITS)}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64; got {self.dtype}")
        self.n_sparse, self.dim, self.n_dense = int(n_sparse), int(dim), int(n_dense)
        self.hidden, self.init = hidden, init
        self.pooling = np.zeros(self.n_sparse, np.int8) if pooling is None else \
            np.array(pooling, np.int8)                     # (S,)
        if self.pooling.shape != (self.n_sparse,) or not np.isin(self.pooling, (0, 1)).all():
            raise ValueError(f"pooling must give 0 (sum) or 1 (mean) for each of the "
                             f"{self.n_sparse} slots; got {pooling!r}")
        self.n_emb = self.n_sparse * self.dim
        self.row_dim = self.dim + self.EXTRA_COLS
        self.emb_width = self.n_sparse * self.row_dim
        self.n_in = self.n_emb + self.n_dense
        self.layout = self._build_layout()
        name, off, shape = self.layout[-1]
        self.n_params = off + int(np.prod(shape))
        self._ws = None
        self._views_cache = {}      # id(flat) -> (flat, layer views)

    @classmethod
    def for_schema(cls, schema, dim, hidden, **kw):
        """The network over a feature schema's inputs: S x dim pooled embeddings + D dense."""
        return cls(n_sparse=schema.n_sparse, dim=dim, n_dense=schema.n_dense, hidden=hidden,
                   pooling=schema.pooling_codes(), **kw)

    def _build_layout(self):
        layout, off = [], 0
        fan_in = self.n_in
        shapes = []
        for i, h in enumerate(self.hidden):
            shapes += [(f"fc{i}.w", (fan_in, h)), (f"fc{i}.b", (h,))]
            fan_in = h
        shapes += [("out.w", (fan_in,)), ("out.b", (1,))]
        for name, shape in shapes:
            layout.append((name, off, shape))
            off += int(np.prod(shape))
        return layout

    # ------------------------------------------------------------------ parameters
    def init_params(self, seed: int) -> np.ndarray:
        """A fresh parameter vector (n_params,), deterministic from ``seed``."""
        rng = np.random.default_rng(seed)
        params = np.zeros(self.n_params, self.dtype)
        sampler = INITS[self.init]
        for name, off, shape in self.layout:
            if name.endswith(".w"):
                fan_in = shape[0]
                fan_out = shape[1] if len(shape) == 2 else 1
                n = int(np.prod(shape))
                params[off:off + n] = sampler(rng, fan_in, fan_out, n)
        return params

    def views(self, params: np.ndarray) -> dict:
        """Named views into a flat vector (parameters or gradients), no copies."""
        return {name: params[off:off + int(np.prod(shape))].reshape(shape)
                for name, off, shape in self.layout}

    def _layers(self, flat):
        """[(W, b), ...] for the hidden layers, then (w_out, b_out) — views of ``flat``.

        Cached per array (the trainer reuses a few buffers; building the views took
        ~0.3 ms a call).  The cache holds the array itself, so its id cannot be reused.
        """
        hit = self._views_cache.get(id(flat))
        if hit is not None and hit[0] is flat:
            return hit[1]
        v = self.views(flat)
        hid = [(v[f"fc{i}.w"], v[f"fc{i}.b"]) for i in range(len(self.hidden))]
        out = (hid, (v["out.w"], v["out.b"]))
        if len(self._views_cache) >= VIEWS_CACHE:
            self._views_cache.pop(next(iter(self._views_cache)))
        self._views_cache[id(flat)] = (flat, out)
        return out

    # ------------------------------------------------------------------ checks
    def _workspace(self, batch: int) -> _Workspace:
        if self._ws is None or self._ws.cap < batch:
            self._ws = _Workspace(batch, self.n_in, self.hidden, self.dtype)
        return self._ws

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
                             f"row_dim); "
                             f"got {emb.shape}")
        if dense.shape != (batch, self.n_dense):
            raise ValueError(f"dense must have shape ({batch}, {self.n_dense}); got {dense.shape}")
        for arr, name in ((emb, "emb"), (dense, "dense")):
            if arr.dtype.kind != "f":
                raise ValueError(f"{name} must be a float array; got {arr.dtype}")
        return batch

    # ------------------------------------------------------------------ maths
    def _forward(self, params, emb, dense, ws, batch):
        """Forward into the workspace; returns the logit view (B,)."""
        x = ws.x[:batch]                                   # (B, n_in)
        x[:, :self.n_emb] = emb                           # the concat: one ~B*n_in copy
        x[:, self.n_emb:] = dense
        return self._mlp_forward(params, ws, batch)

    def _mlp_forward(self, params, ws, batch):
        """The MLP on the filled input ``ws.x[:batch]``; returns the logit view (B,)."""
        (hid, (w_out, b_out)) = self._layers(params)
        inp = ws.x[:batch]
        for (w, b), act in zip(hid, ws.act):
            a = act[:batch]                                # (B, h)
            np.matmul(inp, w, out=a)
            bias_relu_(a, b)
            inp = a
        logit = ws.logit[:batch]                           # (B,)
        np.matmul(inp, w_out, out=logit)
        logit += b_out[0]
        return logit

    def forward_backward(self, params, emb, dense, label, grad_out, grad_emb_out, scale=None):
        """Loss, probabilities and gradients of ``scale`` x the SUMMED loss of the batch.

        Parameters
        ----------
        params : (n_params,) model dtype.
        emb : (B, n_sparse*dim) float; pooled slot embeddings, slot-major.
        dense : (B, n_dense) float; normalised dense features.
        label : (B,) 0/1 labels (any numeric dtype).
        grad_out : (n_params,) model dtype, output; overwritten with d(loss)/d(params).
        grad_emb_out : (B, n_sparse*dim) model dtype, output; overwritten with d(loss)/d(emb).
        scale : gradient scale; default 1/B (the gradients of the mean loss); 1.0 gives the
            gradients of the summed loss, which W workers' parts add up exactly.

        Returns
        -------
        (loss, probs) : mean loss as a Python float, and sigmoid outputs (B,) — a view
        into the workspace, valid until the next call.
        """
        self._check_vec(params, "params", self.n_params)
        self._check_vec(grad_out, "grad_out", self.n_params)
        batch = self._check_inputs(emb, dense)
        if label.shape != (batch,):
            raise ValueError(f"label must have shape ({batch},); got {label.shape}")
        if grad_emb_out.shape != (batch, self.emb_width) or grad_emb_out.dtype != self.dtype \
                or not grad_emb_out.flags.c_contiguous:
            raise ValueError(f"grad_emb_out must be a C-contiguous {self.dtype} array of shape "
                             f"({batch}, {self.emb_width}); got {grad_emb_out.dtype} "
                             f"{grad_emb_out.shape}")
        ws = self._workspace(batch)
        logit = self._forward(params, emb, dense, ws, batch)
        probs, dlogit = ws.probs[:batch], ws.dlogit[:batch]
        total = sigmoid_bce_(logit, label, probs, dlogit, 1.0 / batch if scale is None else scale)
        self._backward(params, grad_out, grad_emb_out, ws, batch)
        return total / batch, probs

    def _backward(self, params, grad_out, grad_emb_out, ws, batch):
        (hid, (w_out, _)) = self._layers(params)
        (ghid, (gw_out, gb_out)) = self._layers(grad_out)
        dlogit = ws.dlogit[:batch]                          # (B,)
        last = len(hid) - 1
        a_last = ws.act[last][:batch]                       # (B, h_last)
        np.matmul(a_last.T, dlogit, out=gw_out)
        gb_out[0] = dlogit.sum()
        dz = ws.grad[last][:batch]                          # (B, h_last)
        outer_relu_backward_colsum_(dlogit, w_out, a_last, dz, ghid[last][1])
        for i in range(last, 0, -1):
            a_prev = ws.act[i - 1][:batch]                  # (B, h_{i-1})
            np.matmul(a_prev.T, dz, out=ghid[i][0])         # dW_i = a_{i-1}^T dz_i
            da = ws.grad[i - 1][:batch]
            np.matmul(dz, hid[i][0].T, out=da)              # d a_{i-1} = dz_i W_i^T
            relu_backward_colsum_(da, a_prev, ghid[i - 1][1])
            dz = da
        np.matmul(ws.x[:batch].T, dz, out=ghid[0][0])       # dW_0 = x^T dz_0
        np.matmul(dz, hid[0][0][:self.n_emb].T, out=grad_emb_out)  # d emb = dz_0 W_0e^T

    def predict(self, params, emb, dense, out) -> None:
        """Write sigmoid probabilities (B,) into ``out`` (any float dtype)."""
        self._check_vec(params, "params", self.n_params)
        batch = self._check_inputs(emb, dense)
        if out.shape != (batch,) or out.dtype.kind != "f":
            raise ValueError(f"out must be a float array of shape ({batch},); got "
                             f"{out.dtype} {out.shape}")
        chunk = max(self._ws.cap if self._ws is not None else 0, min(batch, PREDICT_CHUNK))
        ws = self._workspace(chunk)
        for start in range(0, batch, chunk):
            stop = min(start + chunk, batch)
            logit = self._forward(params, emb[start:stop], dense[start:stop], ws, stop - start)
            probs = ws.probs[:stop - start]
            sigmoid_(logit, probs)
            out[start:stop] = probs

    def loss(self, params, emb, dense, label) -> float:
        """Mean BCE loss without gradients (uses the forward workspace)."""
        self._check_vec(params, "params", self.n_params)
        batch = self._check_inputs(emb, dense)
        ws = self._workspace(batch)
        logit = self._forward(params, emb, dense, ws, batch)
        return sigmoid_bce_(logit, label, ws.probs[:batch], ws.dlogit[:batch], 1.0) / batch


class WideDeep(CTRDNN):
    """Wide&Deep over a flat parameter vector (same arguments as :class:`CTRDNN`)."""
    name = "wide_deep"
    EXTRA_COLS = 1          # w before the embedding in every table row
    USE_FM = False

    def _build_layout(self):
        layout = super()._build_layout()
        _, off, shape = layout[-1]
        off += int(np.prod(shape))
        layout.append(("wide.b", off, (1,)))
        layout.append(("wide.u", off + 1, (self.n_dense,)))
        return layout

    def _wide(self, flat):
        """(w_0 (1,), u (D,)) views of a flat vector."""
        _, off, _ = self.layout[-2]
        return flat[off:off + 1], flat[off + 1:off + 1 + self.n_dense]

    def _workspace(self, batch):
        ws = super()._workspace(batch)
        if not hasattr(ws, "wide"):
            ws.wide = np.empty(ws.cap, self.dtype)                        # (B,)
            ws.lin = np.empty(ws.cap, self.dtype)                         # (B,) u . dense
            ws.gp = np.empty((ws.cap, self.n_emb), self.dtype)            # (B, S*d)
            ws.emb = None
        return ws

    def _forward(self, params, emb, dense, ws, batch):
        x = ws.x[:batch]                                                  # (B, n_in)
        wide = ws.wide[:batch]                                            # (B,)
        wide_fm_forward_(emb, self.n_sparse, self.USE_FM, x, wide)       # x[:, :S*d] = p
        x[:, self.n_emb:] = dense
        w0, u = self._wide(params)
        if self.n_dense:
            lin = ws.lin[:batch]
            np.matmul(x[:, self.n_emb:], u, out=lin)
            wide += lin
        wide += w0[0]
        ws.emb = emb                                                      # for the backward
        logit = self._mlp_forward(params, ws, batch)
        logit += wide
        return logit

    def _backward(self, params, grad_out, grad_emb_out, ws, batch):
        gp = ws.gp[:batch]                                                # (B, S*d)
        super()._backward(params, grad_out, gp, ws, batch)
        dlogit = ws.dlogit[:batch]
        g0, gu = self._wide(grad_out)
        g0[0] = dlogit.sum()
        if self.n_dense:
            np.matmul(ws.x[:batch, self.n_emb:].T, dlogit, out=gu)        # du = dense^T dlogit
        wide_fm_backward_(ws.emb, self.n_sparse, self.USE_FM, dlogit, gp, grad_emb_out)
        ws.emb = None


class DeepFM(WideDeep):
    """DeepFM over a flat parameter vector (same arguments as :class:`CTRDNN`)."""
    name = "deepfm"
    USE_FM = True


MODELS = {cls.name: cls for cls in (CTRDNN, WideDeep, DeepFM)}
