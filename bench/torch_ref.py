"""PyTorch reference: the same networks as mpips, on CPU in one process, to compare against.

    python bench/torch_ref.py --train DIR/train --test DIR/test [--hash-bucket 1000001]
        [--model dnn|wide_deep|deepfm|dcn_v2|dlrm|shared_bottom|mmoe|esmm|din]

``--model`` picks the network as mpips's ``--model`` does (``WideDeep``, ``DeepFM`` below:
rows [w | v], w_0 and u from 0, the same MLP and initialisation).  ``DCNv2`` and ``DLRM``
are mpips's built-in ``dcn_v2.toml`` and ``dlrm.toml`` (mpips/models/networks/): their
parameters have mpips's names, shapes (a weight (in, out), a width-1 weight a vector) and
flat order, and start from mpips's own draw: Xavier-uniform with each weight's (fan_in,
fan_out) from ``numpy.random.default_rng(--seed)`` in the flat layout's order, biases 0,
so both sides start from the same dense weights.  ``DIN`` is mpips's ``dnn`` over a schema
with attention-pooled slots (``--model din --schema FILE``; docs/sequences.md).

Same inputs as mpips: batches come from mpips's own ``DataReader`` (same feature hashing,
same dense normalisation, same file order, last partial batch trained), so both see the
same examples in the same order.  Same model as ``mpips.models.ctr_dnn``: 26 slot
embeddings (dim 10) concatenated with the 13 dense values -> 3 x 400 ReLU -> 1 logit,
mean BCE-with-logits; Xavier-uniform weights, zero biases; embedding rows uniform in
[-init_range, init_range].  Same optimiser: Adam (lr 1e-3, betas 0.9/0.999, eps 1e-8) on
the dense weights; lazy (sparse) Adam on the embedding rows: ``torch.optim.SparseAdam`` by
default (its bias correction counts steps of the whole table), or ``--row-adam`` for the
per-row bias correction mpips (and Paddle's lazy Adam) use.

Ids: ``--hash-bucket N`` (default 1000001, Paddle's bucketing) makes the table a fixed
N-row ``nn.Embedding`` indexed by ``hash % N`` (ids collide across slots, as in Paddle and
in mpips ``--hash-bucket N``).  ``--hash-bucket 0`` keeps mpips's full 64-bit ids and maps
them to rows through a vocabulary: a sorted array of every id in the training files,
built in a pass before training (outside the training span, inside the job time) and
looked up with ``np.searchsorted``; a test id never seen in training reads a zero row, as
an unknown id reads zeros in mpips.

Timing is measured as mpips measures ``train_seconds``: from before the first batch is read
to after the last optimiser step, reading and parsing included (parsing runs in the
reader's prefetch thread, as in mpips).  Test AUC/logloss use ``mpips.metrics``.
Prints one JSON record (the keys of mpips's ``--metrics-out`` records) and writes it to
``--metrics-out`` if given.

Any schema: ``--schema FILE`` (mpips's TOML schema, issue 20) gives S sparse slots of bags
and D dense values; a batch is the Batch contract (dense (n, D), flat ids with offsets
(n*S + 1) example-major, label).  Each slot's bag is pooled by one ``nn.EmbeddingBag``
(sum, or mean as the slot's ``pooling`` says: mixed poolings are a sum with per-id weights
1/len for the mean slots; an empty bag pools to zeros and gets no gradient), the model
input is concat(pooled (n, S*dim), dense (n, D)), with the same init as mpips.  Batches come
from mpips's reader with the schema.
Without ``--schema`` (or with Criteo's) everything is as before: one-hot ``nn.Embedding``.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402,F401  (puts the repo root on sys.path)

from mpips.data.reader import DataReader  # noqa: E402
from mpips.metrics import BinaryMetrics, new_metrics  # noqa: E402
from mpips.schema import Schema, load_schema  # noqa: E402

VOCAB_MERGE = 1 << 23     # ids gathered before they are merged into the sorted vocabulary


class CTRDNN(nn.Module):
    def __init__(self, n_rows, n_sparse=26, dim=10, n_dense=13, hidden=(400, 400, 400),
                 init_range=0.05, pooling=None):
        """pooling None: one id per slot (nn.Embedding); else per slot 0 = sum, 1 = mean."""
        super().__init__()
        self._embedding(n_rows, n_sparse, dim, init_range, pooling)
        layers, fan_in = [], n_sparse * dim + n_dense
        for h in hidden:
            layers += [nn.Linear(fan_in, h), nn.ReLU()]
            fan_in = h
        layers.append(nn.Linear(fan_in, 1))
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def _embedding(self, n_rows, n_sparse, dim, init_range, pooling):
        """The table ``emb`` (rows of ``dim``, uniform in [-init_range, init_range])."""
        self.n_sparse, self.dim = n_sparse, dim
        self.mean_slots = None
        if pooling is None:
            self.emb = nn.Embedding(n_rows, dim, sparse=True)
        else:
            codes = np.asarray(pooling)
            mode = "mean" if codes.all() else "sum"
            if codes.any() and not codes.all():
                self.mean_slots = torch.from_numpy(codes.astype(bool))
            self.emb = nn.EmbeddingBag(n_rows, dim, mode=mode, sparse=True,
                                       include_last_offset=True)
        nn.init.uniform_(self.emb.weight, -init_range, init_range)

    def forward(self, rows, dense, offsets=None):
        n = dense.shape[0]
        e = self.pooled(rows, n, offsets)
        return self.mlp(torch.cat([e.reshape(n, self.n_sparse * self.dim), dense], dim=1)).squeeze(1)

    def pooled(self, rows, n, offsets=None):
        """The pooled rows of each slot (n*S or (n, S) rows of the table's width)."""
        if offsets is None and isinstance(self.emb, nn.EmbeddingBag):   # a one-hot batch
            rows = rows.reshape(-1)
            offsets = torch.arange(rows.numel() + 1)
        if offsets is None:
            e = self.emb(rows)
        else:
            w = None
            if self.mean_slots is not None:            # mixed: mean slots weigh ids 1/len
                lens = offsets[1:] - offsets[:-1]
                inv = 1.0 / lens.clamp(min=1).to(self.emb.weight.dtype)
                w = torch.repeat_interleave(torch.where(self.mean_slots.repeat(n), inv, 1.0), lens)
            e = self.emb(rows, offsets, per_sample_weights=w)
        return e

    def dense_parameters(self):
        """The weights the dense optimizer updates (all but the embedding table)."""
        return [p for name, p in self.named_parameters() if not name.startswith("emb.")]


class WideDeep(CTRDNN):
    """mpips.models.wide_deep: table rows [w | v] (dim + 1, uniform like the rest of the
    row), w_0 and u (dense first-order weights) from 0; logit = wide + MLP(p, dense)."""
    FM = False

    def __init__(self, n_rows, n_sparse=26, dim=10, n_dense=13, hidden=(400, 400, 400),
                 init_range=0.05, pooling=None):
        super().__init__(n_rows, n_sparse, dim + 1, n_dense, hidden, init_range, pooling)
        self.dim = dim
        fan_in = n_sparse * dim + n_dense
        first = self.mlp[0]                       # the MLP sees p (dim per slot), not w
        self.mlp[0] = nn.Linear(fan_in, first.out_features)
        nn.init.xavier_uniform_(self.mlp[0].weight)
        nn.init.zeros_(self.mlp[0].bias)
        self.w0 = nn.Parameter(torch.zeros(1))
        self.u = nn.Parameter(torch.zeros(n_dense))

    def forward(self, rows, dense, offsets=None):
        n = dense.shape[0]
        e = self.pooled(rows, n, offsets).reshape(n, self.n_sparse, self.dim + 1)
        w, p = e[:, :, 0], e[:, :, 1:]
        logit = self.w0 + w.sum(1) + dense @ self.u
        if self.FM:                                          # sum_{f<g} <p_f, p_g>
            logit = logit + 0.5 * (p.sum(1) ** 2 - (p ** 2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([p.reshape(n, -1), dense], dim=1)).squeeze(1)
        return logit + deep


class DeepFM(WideDeep):
    """mpips.models.deepfm: first order + FM over the slot embeddings + MLP."""
    FM = True


def xavier_flat(layout, seed):
    """mpips's dense init (mpips.models.network, init "xavier"): ``layout`` lists (name,
    shape, fan) in the flat vector's order; a weight with a fan (fan_in, fan_out) is drawn
    U(-1, 1) x sqrt(6 / (fan_in + fan_out)) from one ``default_rng(seed)`` in that order (in
    float64, then float32), a parameter without one (a bias) is 0.  name -> array."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, fan in layout:
        n = int(np.prod(shape))
        x = np.zeros(n) if fan is None else \
            rng.uniform(-1.0, 1.0, n) * np.sqrt(6.0 / (fan[0] + fan[1]))
        out[name] = x.astype(np.float32).reshape(shape)
    return out


def mlp_layout(name, fan_in, widths, linear=False):
    """mpips's ``mlp`` ``name`` (``linear``: one layer named ``name``): (name, shape, fan) of
    ``{name}{i}.w`` (in, out), or (in,) at width 1, and ``{name}{i}.b``."""
    out = []
    for i, h in enumerate(widths):
        pre = name if linear else f"{name}{i}"
        out += [(f"{pre}.w", (fan_in,) if h == 1 else (fan_in, h), (fan_in, h)),
                (f"{pre}.b", (h,), None)]
        fan_in = h
    return out


class LayerNet(CTRDNN):
    """A network whose dense parameters are mpips's: ``self.layout`` (name, shape, fan) in
    mpips's flat order, each a parameter of ``self.p`` under its name with '.' -> '_', drawn
    by :func:`xavier_flat`.  ``param(name)`` gives one by its mpips name."""

    def _params(self, layout, seed):
        self.layout = layout
        init = xavier_flat(layout, seed)
        self.p = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.from_numpy(v))
                                   for k, v in init.items()})

    def param(self, name):
        return self.p[name.replace(".", "_")]

    def mlp_forward(self, name, x, n_layers, relu=True):
        """``n_layers`` of mpips's mlp ``name``: x W_i + b_i, then ReLU."""
        for i in range(n_layers):
            x = torch.addmm(self.param(f"{name}{i}.b"), x, self.param(f"{name}{i}.w"))
            if relu:
                x = torch.relu(x)
        return x

    def logit(self, x):
        """mpips's width-1 ``linear`` ``out``: x . w + b, (n,)."""
        return torch.mv(x, self.param("out.w")) + self.param("out.b")

    def slots(self, rows, n, offsets):
        """The pooled slots (n, S*dim)."""
        return self.pooled(rows, n, offsets).reshape(n, self.n_sparse * self.dim)


class DCNv2(LayerNet):
    """mpips's ``dcn_v2.toml``: x0 = concat(pooled slots, dense) (m wide); a full-rank cross
    network of depth 3, ``x_{l+1} = x0 * (x_l W_l + b_l) + x_l`` (W_l (m, m)), and the ReLU
    MLP of ``--fc`` over x0, side by side; concat(cross, MLP) -> a linear to one logit."""
    DEPTH = 3

    def __init__(self, n_rows, n_sparse=26, dim=10, n_dense=13, hidden=(400, 400, 400),
                 init_range=0.05, pooling=None, seed=0):
        nn.Module.__init__(self)
        self._embedding(n_rows, n_sparse, dim, init_range, pooling)
        m = n_sparse * dim + n_dense
        self.hidden = tuple(hidden)
        layout = []
        for li in range(self.DEPTH):
            layout += [(f"cross{li}.w", (m, m), (m, m)), (f"cross{li}.b", (m,), None)]
        layout += mlp_layout("fc", m, self.hidden)
        layout += mlp_layout("out", m + self.hidden[-1], [1], linear=True)
        self._params(layout, seed)

    def forward(self, rows, dense, offsets=None):
        n = dense.shape[0]
        x0 = torch.cat([self.slots(rows, n, offsets), dense], dim=1)
        x = x0
        for li in range(self.DEPTH):
            x = x0 * torch.addmm(self.param(f"cross{li}.b"), x, self.param(f"cross{li}.w")) + x
        fc = self.mlp_forward("fc", x0, len(self.hidden))
        return self.logit(torch.cat([x, fc], dim=1))


class DLRM(LayerNet):
    """mpips's ``dlrm.toml``: a bottom ReLU MLP [64, dim] over the dense features; fields =
    [bottom, slot_1 .. slot_S] (F = S + 1, each of dim); their pairwise dots <e_a, e_b>,
    a < b in row-major order; concat(bottom, dots) -> the ReLU MLP of ``--fc`` -> a linear
    to one logit."""
    BOTTOM = 64

    def __init__(self, n_rows, n_sparse=26, dim=10, n_dense=13, hidden=(400, 400, 400),
                 init_range=0.05, pooling=None, seed=0):
        nn.Module.__init__(self)
        self._embedding(n_rows, n_sparse, dim, init_range, pooling)
        self.hidden = tuple(hidden)
        f = n_sparse + 1
        li, lj = torch.triu_indices(f, f, offset=1)         # row-major: a, then b > a
        self.register_buffer("pair_a", li, persistent=False)
        self.register_buffer("pair_b", lj, persistent=False)
        layout = mlp_layout("bottom", n_dense, [self.BOTTOM, dim])
        layout += mlp_layout("fc", dim + f * (f - 1) // 2, self.hidden)
        layout += mlp_layout("out", self.hidden[-1], [1], linear=True)
        self._params(layout, seed)

    def forward(self, rows, dense, offsets=None):
        n = dense.shape[0]
        bottom = self.mlp_forward("bottom", dense, 2)                          # (n, dim)
        fields = torch.cat([bottom.unsqueeze(1),
                            self.slots(rows, n, offsets).reshape(n, self.n_sparse, self.dim)],
                           dim=1)                                               # (n, F, dim)
        z = torch.bmm(fields, fields.transpose(1, 2))                           # (n, F, F)
        pairs = z[:, self.pair_a, self.pair_b]                                  # (n, F(F-1)/2)
        fc = self.mlp_forward("fc", torch.cat([bottom, pairs], dim=1), len(self.hidden))
        return self.logit(fc)


# ---- several tasks (issue 47 part A): mpips's shared_bottom.toml, mmoe.toml, esmm.toml
class MultiTask(LayerNet):
    """A network of T = 2 logits over x0 = concat(pooled slots, dense), in mpips's flat
    layout; ``forward`` gives (n, 2) logits.  ``task_loss``: the sum of the tasks' mean BCE
    (``head`` independent); ``probs``: (n, 2) sigmoids.  ESMM overrides both."""
    n_tasks = 2

    def __init__(self, n_rows, n_sparse=26, dim=10, n_dense=13, hidden=(400, 400, 400),
                 init_range=0.05, pooling=None, seed=0):
        nn.Module.__init__(self)
        self._embedding(n_rows, n_sparse, dim, init_range, pooling)
        self.hidden, self.m = tuple(hidden), n_sparse * dim + n_dense
        self._params(self.build_layout(), seed)

    def x0(self, rows, dense, offsets):
        return torch.cat([self.slots(rows, dense.shape[0], offsets), dense], dim=1)

    def linear1(self, name, x):
        """mpips's width-1 ``linear`` ``name``: (n,)."""
        return torch.mv(x, self.param(f"{name}.w")) + self.param(f"{name}.b")

    def task_loss(self, logits, y):
        f = nn.functional.binary_cross_entropy_with_logits
        return sum(f(logits[:, t], y[:, t]) for t in range(self.n_tasks))

    def probs(self, logits):
        return torch.sigmoid(logits)


class SharedBottom(MultiTask):
    """``shared_bottom.toml``: a shared ReLU MLP of ``--fc``, a [64] tower and a logit a task."""
    TOWER = 64

    def build_layout(self):
        lay = mlp_layout("bottom", self.m, self.hidden)
        for t in (1, 2):
            lay += mlp_layout(f"tower{t}", self.hidden[-1], [self.TOWER])
            lay += mlp_layout(f"out{t}", self.TOWER, [1], linear=True)
        return lay

    def forward(self, rows, dense, offsets=None):
        b = self.mlp_forward("bottom", self.x0(rows, dense, offsets), len(self.hidden))
        return torch.stack([self.linear1(f"out{t}", self.mlp_forward(f"tower{t}", b, 1))
                            for t in (1, 2)], 1)


class MMoE(MultiTask):
    """``mmoe.toml``: 3 experts (ReLU [256, 128]) over x0; per task a softmax gate
    softmax(x0 W + b) mixing them, a [64] tower and a logit."""
    EXPERTS, WIDTHS, TOWER = 3, (256, 128), 64

    def build_layout(self):
        lay = []
        for e in range(1, self.EXPERTS + 1):
            lay += mlp_layout(f"expert{e}", self.m, self.WIDTHS)
        for t in (1, 2):
            lay += [(f"gate{t}.w", (self.m, self.EXPERTS), (self.m, self.EXPERTS)),
                    (f"gate{t}.b", (self.EXPERTS,), None)]
            lay += mlp_layout(f"tower{t}", self.WIDTHS[-1], [self.TOWER])
            lay += mlp_layout(f"out{t}", self.TOWER, [1], linear=True)
        return lay

    def forward(self, rows, dense, offsets=None):
        x = self.x0(rows, dense, offsets)
        ex = torch.stack([self.mlp_forward(f"expert{e}", x, len(self.WIDTHS))
                          for e in range(1, self.EXPERTS + 1)], 1)          # (n, E, w)
        out = []
        for t in (1, 2):
            g = torch.softmax(torch.addmm(self.param(f"gate{t}.b"), x,
                                          self.param(f"gate{t}.w")), dim=1)  # (n, E)
            mix = torch.bmm(g.unsqueeze(1), ex).squeeze(1)                   # (n, w)
            out.append(self.linear1(f"out{t}", self.mlp_forward(f"tower{t}", mix, 1)))
        return torch.stack(out, 1)


class ESMM(MultiTask):
    """``esmm.toml``: a CTR and a CVR ReLU MLP of ``--fc`` over x0, a logit each;
    pCTCVR = pCTR x pCVR, losses on click (pCTR) and on click-and-purchase (pCTCVR)."""

    def build_layout(self):
        lay = []
        for name in ("ctr", "cvr"):
            lay += mlp_layout(name, self.m, self.hidden)
            lay += mlp_layout(f"{name}_logit", self.hidden[-1], [1], linear=True)
        return lay

    def forward(self, rows, dense, offsets=None):
        x = self.x0(rows, dense, offsets)
        return torch.stack([self.linear1(f"{n}_logit", self.mlp_forward(n, x, len(self.hidden)))
                            for n in ("ctr", "cvr")], 1)

    def task_loss(self, logits, y):
        a, b = logits[:, 0], logits[:, 1]
        f = nn.functional.binary_cross_entropy_with_logits
        log_p = nn.functional.logsigmoid(a) + nn.functional.logsigmoid(b)     # log pCTCVR
        log_q = torch.log(-torch.expm1(log_p).clamp(max=-1e-300))             # log(1 - p)
        ctcvr = -(y[:, 1] * log_p + (1 - y[:, 1]) * log_q).mean()
        return f(a, y[:, 0]) + ctcvr

    def probs(self, logits):
        p = torch.sigmoid(logits)
        return torch.stack([p[:, 0], p[:, 0] * p[:, 1]], 1)


MULTI_TASK = {"shared_bottom": SharedBottom, "mmoe": MMoE, "esmm": ESMM}


def task_metrics(schema, model_name):
    """mpips's metrics for the model's predictions (per task with several labels)."""
    return new_metrics(schema.labels if model_name in MULTI_TASK else (),
                       model_name == "esmm")


MODELS = {"dnn": CTRDNN, "wide_deep": WideDeep, "deepfm": DeepFM, "dcn_v2": DCNv2,
          "dlrm": DLRM, **MULTI_TASK}


class DIN(LayerNet):
    """mpips's ``dnn`` under a schema with attention-pooled slots (DIN; docs/sequences.md):
    each attention slot's bag is the sum of its rows weighted by a relu MLP of
    ``[q, k, q - k, q * k]`` (q: the pooled query slot, k: the id's row; softmax over the
    bag as the schema says); the other slots pool by sum or mean.  The dense parameters are
    mpips's network's (its names, shapes, flat order and init: the MLP's, then each unit's)."""

    def __init__(self, n_rows, n_sparse=26, dim=10, n_dense=13, hidden=(400, 400, 400),
                 init_range=0.05, pooling=None, seed=0, attention=(), layout=(), slot_names=()):
        nn.Module.__init__(self)
        self.slot_names = list(slot_names)
        codes = np.asarray(pooling)
        self._embedding(n_rows, n_sparse, dim, init_range, np.where(codes == 2, 0, codes))
        self.hidden, self.attention = tuple(hidden), list(attention)
        self._params(list(layout), seed)

    def _unit(self, s, q, units, softmax, pooled, rows, offsets):
        """The attention pool (n, dim) of slot ``s`` queried by the pooled slot ``q``."""
        n, S = pooled.shape[0], self.n_sparse
        off = offsets.numpy()
        b = np.arange(n) * S + s
        lens = off[b + 1] - off[b]
        ex = np.repeat(np.arange(n), lens)
        pos = off[b][ex] + np.arange(len(ex)) - np.repeat(np.cumsum(lens) - lens, lens)
        k = nn.functional.embedding(rows[torch.from_numpy(pos)], self.emb.weight, sparse=True)
        ext = torch.from_numpy(ex)
        qv = pooled[:, q][ext]
        h = torch.cat([qv, k, qv - k, qv * k], dim=1)
        name = f"attn_{self.slot_names[s]}"
        h = self.mlp_forward(name, h, len(units))
        score = torch.mv(h, self.param(f"{name}.out.w")) + self.param(f"{name}.out.b")
        if softmax:
            top = torch.full((n,), -torch.inf, dtype=score.dtype).scatter_reduce(
                0, ext, score.detach(), "amax")
            e = torch.exp(score - top[ext])
            w = e / torch.zeros(n, dtype=e.dtype).index_add(0, ext, e)[ext]
        else:
            w = score
        return torch.zeros(n, self.dim, dtype=k.dtype).index_add(0, ext, w[:, None] * k)

    def forward(self, rows, dense, offsets=None):
        n = dense.shape[0]
        pooled = self.pooled(rows, n, offsets).reshape(n, self.n_sparse, self.dim)
        cols = list(pooled.unbind(1))
        for s, q, units, softmax in self.attention:
            cols[s] = self._unit(s, q, units, softmax, pooled, rows, offsets)
        x = torch.cat(cols + [dense], dim=1)
        return self.logit(self.mlp_forward("fc", x, len(self.hidden)))


def din_kwargs(schema, dim, hidden):
    """DIN's extra arguments: the schema's attention slots and mpips's own flat layout."""
    from mpips.models.zoo import make_net
    net = make_net("dnn", schema, dim, hidden)
    layout = [(name, shape, net.fans[name]) for name, _, shape in net.layout]
    return {"attention": schema.attention(), "layout": layout,
            "slot_names": schema.sparse_names}


class RowAdam:
    """Lazy Adam on the rows of a sparse gradient, bias correction per row (as mpips)."""

    def __init__(self, weight, lr, betas=(0.9, 0.999), eps=1e-8):
        self.w, self.lr, (self.b1, self.b2), self.eps = weight, lr, betas, eps
        self.m = torch.zeros_like(weight)
        self.v = torch.zeros_like(weight)
        self.t = torch.zeros(weight.shape[0], dtype=torch.float64)

    @torch.no_grad()
    def step(self):
        g = self.w.grad.coalesce()
        idx, val = g.indices()[0], g.values()
        m = self.m[idx].mul_(self.b1).add_(val, alpha=1 - self.b1)
        v = self.v[idx].mul_(self.b2).addcmul_(val, val, value=1 - self.b2)
        t = self.t[idx] + 1
        self.m[idx], self.v[idx], self.t[idx] = m, v, t
        bc1 = (1 - self.b1 ** t).float().unsqueeze(1)
        bc2 = (1 - self.b2 ** t).float().unsqueeze(1)
        self.w.index_add_(0, idx, -self.lr * (m / bc1) / ((v / bc2).sqrt() + self.eps))

    def zero_grad(self):
        self.w.grad = None


MODELS["din"] = DIN      # dnn with the schema's attention pooling


def build_vocab(train, batch_size, schema=None):
    """Sorted unique int64 ids of every row of the training files (one read pass)."""
    vocab, pending, n = np.empty(0, np.int64), [], 0
    for b in batches(train, 1 << 16, 0, schema):
        pending.append(np.unique(b[3]))
        n += pending[-1].size
        if n > VOCAB_MERGE:
            vocab = np.union1d(vocab, np.concatenate(pending))
            pending, n = [], 0
    return np.union1d(vocab, np.concatenate(pending)) if pending else vocab


def batches(files, batch_size, hash_bucket, schema=None):
    """(label, dense, offsets or None, ids) per batch, from mpips's own reader."""
    for b in DataReader(files, batch_size, hash_bucket=hash_bucket, schema=schema):
        yield b.label, b.dense, b.offsets, b.sparse


class IdMap:
    """ids (B, 26) int64 -> table rows; unknown ids -> the last (zero, untrained) row."""

    def __init__(self, hash_bucket, vocab=None):
        self.hash_bucket, self.vocab = hash_bucket, vocab
        self.n_rows = hash_bucket if hash_bucket else vocab.size + 1

    def __call__(self, ids):
        if self.hash_bucket:
            return torch.from_numpy(ids)
        pos = np.searchsorted(self.vocab, ids)
        pos = np.minimum(pos, self.vocab.size - 1)
        return torch.from_numpy(np.where(self.vocab[pos] == ids, pos, self.vocab.size))


def run(a):
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    t_job = time.perf_counter()
    schema = load_schema(a.schema) if a.schema else Schema.criteo()
    print("torch_ref: " + schema.describe(), file=sys.stderr, flush=True)
    vocab_s = 0.0
    if a.hash_bucket:
        idmap = IdMap(a.hash_bucket)
    else:
        t0 = time.perf_counter()
        vocab = build_vocab(a.train, a.batch_size, schema)
        if vocab.size == 0:
            raise SystemExit(f"torch_ref: no training rows in {a.train}")
        idmap = IdMap(0, vocab)
        vocab_s = time.perf_counter() - t0
    cls = MODELS[a.model]
    model = cls(idmap.n_rows, n_sparse=schema.n_sparse, dim=a.embedding_dim,
                n_dense=schema.n_dense, hidden=tuple(int(x) for x in a.fc.split(",")),
                init_range=a.init_range,
                pooling=None if schema.is_criteo else schema.pooling_codes(),
                **({"seed": a.seed} if issubclass(cls, LayerNet) else {}),
                **(din_kwargs(schema, a.embedding_dim, tuple(int(x) for x in a.fc.split(",")))
                   if cls is DIN else {}))
    if not a.hash_bucket:
        with torch.no_grad():
            model.emb.weight[-1] = 0.0          # the unknown-id row: zeros, never trained
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    sparse_opt = (RowAdam(model.emb.weight, a.lr) if a.row_adam else
                  torch.optim.SparseAdam([model.emb.weight], lr=a.lr, betas=(0.9, 0.999),
                                         eps=1e-8))
    lossf = nn.BCEWithLogitsLoss()
    multi = a.model in MULTI_TASK
    if multi:                                   # several tasks: the model's loss and probs
        lossf, sig = model.task_loss, model.probs
    else:
        sig = torch.sigmoid
    recs = []
    for epoch in range(a.epochs):
        train_m, loss_sum, n_ex = task_metrics(schema, a.model), 0.0, 0
        t_start = time.perf_counter()
        model.train()
        for label, dense_np, offsets, ids in batches(a.train, a.batch_size, a.hash_bucket, schema):
            rows, dense, y = idmap(ids), torch.from_numpy(dense_np), torch.from_numpy(label)
            logit = model(rows, dense, None if offsets is None else torch.from_numpy(offsets))
            loss = lossf(logit, y)
            dense_opt.zero_grad(set_to_none=True)
            sparse_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
            n = len(label)
            n_ex += n
            loss_sum += loss.item() * n
            train_m.update(sig(logit.detach()).numpy(), label)
            if a.print_every and n_ex // a.batch_size % a.print_every == 0:
                print(f"torch_ref: {n_ex} examples, {n_ex / (time.perf_counter() - t_start):.0f}"
                      f" ex/s, loss {loss_sum / n_ex:.4f}", file=sys.stderr, flush=True)
        seconds = time.perf_counter() - t_start
        rec = {"epoch": epoch, "mode": "torch", "train_examples": n_ex,
               "train_seconds": round(seconds, 4), "examples_per_sec": round(n_ex / seconds, 1),
               "train_loss": loss_sum / max(n_ex, 1), "train_auc": train_m.auc(),
               "id_map": f"hash % {a.hash_bucket}" if a.hash_bucket else "vocabulary",
               "table_rows": idmap.n_rows, "vocab_seconds": round(vocab_s, 3),
               "model": a.model, "sparse_optimizer": "row-adam" if a.row_adam else "SparseAdam",
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "schema": schema.describe(), "embedding_dim": a.embedding_dim, "fc": a.fc}
        if a.test:
            test_m = task_metrics(schema, a.model)
            model.eval()
            with torch.no_grad():
                for label, dense_np, offsets, ids in batches(a.test, 4096, a.hash_bucket, schema):
                    p = sig(model(idmap(ids), torch.from_numpy(dense_np), None if
                                  offsets is None else torch.from_numpy(offsets)))
                    test_m.update(p.numpy(), label)
            rec.update(test_examples=test_m.count, test_auc=test_m.auc(),
                       test_logloss=test_m.logloss(), test_mean_pred=test_m.mean_pred(),
                       test_ctr=test_m.observed_ctr())
            if multi:
                rec["tasks"] = test_m.task_fields("test_")
        rec["job_seconds"] = round(time.perf_counter() - t_job, 3)
        recs.append(rec)
        print(json.dumps(rec), flush=True)
        if a.metrics_out:
            with open(a.metrics_out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return recs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", default="")
    ap.add_argument("--schema", default="", help="mpips schema TOML of the data (default: Criteo)")
    ap.add_argument("--hash-bucket", type=int, default=1000001,
                    help="table rows = hash %% N (default 1000001); 0 = full ids via a vocabulary")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="torch's seed; dcn_v2 and dlrm draw "
                    "their dense weights from numpy's default_rng(seed), as mpips --seed")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--embedding-dim", type=int, default=10)
    ap.add_argument("--fc", default="400,400,400")
    ap.add_argument("--model", default="dnn", choices=sorted(MODELS),
                    help="network, as mpips's --model (default dnn)")
    ap.add_argument("--init-range", type=float, default=0.05)
    ap.add_argument("--row-adam", action="store_true",
                    help="per-row bias-corrected lazy Adam (mpips's maths) instead of SparseAdam")
    ap.add_argument("--metrics-out", default="")
    ap.add_argument("--print-every", type=int, default=500, help="progress line on stderr every "
                    "N batches (0 = none)")
    a = ap.parse_args(argv)
    if a.hash_bucket < 0 or a.batch_size < 1 or a.epochs < 1 or a.threads < 1:
        ap.error("need --hash-bucket >= 0, --batch-size >= 1, --epochs >= 1, --threads >= 1")
    return a


def main(argv=None):
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
