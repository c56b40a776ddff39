"""Attention pooling of one slot: DIN's local activation unit (docs/sequences.md).

Each id k of a bag gets a score from a small MLP of ``[q, k, q - k, q * k]`` (q: the pooled
embedding of the query slot of the same example, k: the id's embedding; relu hidden layers
of ``units``, then one linear output); the bag pools to the sum of its rows weighted by the
scores, or by their softmax over the bag.  An empty bag pools to zeros.

The unit's weights are dense parameters of the network (``params``: (name, shape, fan) like
a layer's, laid out after the file's layers), so they train, sync, save and export with the
rest.  The network calls ``forward`` on the pooled input before its layers (it overwrites the
slot's columns) and ``backward`` after them; ``add_row_grads`` adds the ids' gradients to the
rows' (after ``pool_backward``).  Products run through BLAS, the per-bag work in
:mod:`mpips.kernels.attention`.
"""
import numpy as np

from mpips.kernels import attention as K
from mpips.kernels.mlp import bias_relu_, outer_relu_backward_colsum_, relu_backward_colsum_


class AttentionPool:
    """The attention unit of slot ``slot`` queried by slot ``query``.

    Parameters
    ----------
    name : prefix of its parameters (``{name}{i}.w``, ``.b``; ``{name}.out.w``, ``.out.b``).
    slot, query : slot indices; n_slots : S.
    dim : embedding width d; col0 : columns before the embedding in a row (1 with a wide
        term, else 0); row_dim = col0 + d.
    units : hidden widths; softmax : weights by softmax over the bag.
    """

    def __init__(self, name, slot, query, n_slots, dim, col0, units, softmax):
        self.name, self.slot, self.query, self.S = name, int(slot), int(query), int(n_slots)
        self.d, self.col0, self.softmax = int(dim), int(col0), bool(softmax)
        row_dim = self.d + self.col0
        self.cols = slice(self.slot * row_dim + self.col0, self.slot * row_dim + row_dim)
        self.qcols = slice(self.query * row_dim + self.col0, self.query * row_dim + row_dim)
        self.params, self.names, fan_in = [], [], 4 * self.d
        for i, h in enumerate(units):
            w, b = f"{name}{i}.w", f"{name}{i}.b"
            self.params += [(w, (fan_in, int(h)), (fan_in, int(h))), (b, (int(h),), None)]
            self.names.append((w, b))
            fan_in = int(h)
        self.out_names = (f"{name}.out.w", f"{name}.out.b")
        self.params += [(self.out_names[0], (fan_in,), (fan_in, 1)),
                        (self.out_names[1], (1,), None)]

    # ------------------------------------------------------------------ forward
    def _layout(self, offsets, inverse, row0, n):
        """bounds (n+1,) of the slot's bags of rows row0..row0+n, and each id's example and
        row (the index of its pulled row)."""
        b = (row0 + np.arange(n)) * self.S + self.slot
        starts, lens = offsets[b], offsets[b + 1] - offsets[b]
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=bounds[1:])
        ex = np.repeat(np.arange(n), lens)
        pos = starts[ex] + (np.arange(bounds[-1]) - bounds[ex])
        return bounds, ex, inverse[pos]

    def forward(self, P, emb, bags, row0, n):
        """Overwrite the slot's columns of ``emb`` (n, S*row_dim) with its attention pool;
        ``bags`` = (rows (u, row_dim), inverse (nnz,), offsets (N*S+1,)) of the batch whose
        rows row0..row0+n ``emb`` holds."""
        rows, inverse, offsets = bags
        dt = emb.dtype
        self.bounds, ex, self.rows_of = self._layout(offsets, inverse, row0, n)
        m = len(ex)
        self.Kr = np.ascontiguousarray(rows[self.rows_of, self.col0:self.col0 + self.d], dt)
        self.Q = np.ascontiguousarray(emb[:, self.qcols][ex])                    # (m, d)
        self.qp = np.ascontiguousarray(emb[:, self.qcols])                     # (n, d)
        w1 = P[self.names[0][0]]                                                 # (4d, h)
        self.wq, self.wk = self._first(w1)
        F = np.empty((m, 2 * self.d), dt)
        K.attn_features(self.Q, self.Kr, F)
        h = np.matmul(F, self.wk)                                # [k, q*k] part, per id
        K.add_example_bias_relu(h, np.matmul(self.qp, self.wq), ex, P[self.names[0][1]])
        self.acts = [F, h]
        for w, b in self.names[1:]:
            h = np.matmul(self.acts[-1], P[w])
            bias_relu_(h, P[b])
            self.acts.append(h)
        scores = np.matmul(self.acts[-1], P[self.out_names[0]])                   # (m,)
        scores += P[self.out_names[1]][0]
        self.w = np.empty(m, dt)
        pooled = np.empty((n, self.d), dt)
        K.attn_pool(scores, self.Kr, self.bounds, self.softmax, self.w, pooled)
        emb[:, self.cols] = pooled

    def _first(self, w1):
        """The first layer's weights (4d, h) over [q, k, q-k, q*k] as a part for q (d, h),
        once an example, and a part for [k, q*k] (2d, h), once an id."""
        d = self.d
        return w1[:d] + w1[2 * d:3 * d], np.concatenate([w1[d:2 * d] - w1[2 * d:3 * d],
                                                        w1[3 * d:]])

    # ------------------------------------------------------------------ backward
    def backward(self, P, G, grad_emb, n):
        """From d(loss)/d(pooled) in the slot's columns of ``grad_emb`` (n, S*row_dim):
        the unit's parameter gradients into the views ``G``, the query's gradient added to
        its columns, the slot's columns zeroed, the ids' row gradients kept (``dK``)."""
        dt = grad_emb.dtype
        m = len(self.w)
        gb = np.ascontiguousarray(grad_emb[:, self.cols])
        dscore, self.dK = np.empty(m, dt), np.empty((m, self.d), dt)
        K.attn_pool_backward(gb, self.Kr, self.w, self.bounds, self.softmax, dscore, self.dK)
        wo, bo = self.out_names
        G[bo][0] = dscore.sum()
        np.matmul(dscore, self.acts[-1], out=G[wo])
        last = len(self.names) - 1
        dh = np.empty_like(self.acts[-1])                                 # (m, h_last)
        outer_relu_backward_colsum_(dscore, P[wo], self.acts[-1], dh, G[self.names[-1][1]])
        for i in range(last, -1, -1):
            w, b = self.names[i]
            if i < last:
                relu_backward_colsum_(dh, self.acts[i + 1], G[b])
            if i > 0:
                np.matmul(self.acts[i].T, dh, out=G[w])
                dh = np.matmul(dh, P[w].T)                                # (m, fan_in)
        self._first_backward(G[self.names[0][0]], dh, n)
        grad_emb[:, self.qcols] += self.dq
        grad_emb[:, self.cols] = 0

    def _first_backward(self, gw1, dh, n):
        """From dh (m, h) = d(loss)/d(first pre-activation): the first layer's weight
        gradient ``gw1`` (4d, h), the queries' gradient ``dq`` (n, d), the ids' into dK."""
        d = self.d
        ft = np.matmul(self.acts[0].T, dh)                                # (2d, h)
        da = np.empty((n, dh.shape[1]), dh.dtype)
        K.bag_sums(dh, self.bounds, da)                                   # (n, h)
        gq = np.matmul(self.qp.T, da)                                     # (d, h)
        gw1[:d], gw1[d:2 * d], gw1[3 * d:] = gq, ft[:d], ft[d:]
        np.subtract(gq, ft[:d], out=gw1[2 * d:3 * d])
        self.dq = np.matmul(da, self.wq.T)                                # (n, d)
        K.attn_features_backward(np.matmul(dh, self.wk.T), self.Q, self.Kr, self.bounds,
                                 self.dq, self.dK)

    def add_row_grads(self, grads):
        """grads (u, row_dim) += the ids' row gradients (in id order)."""
        K.add_rows_at(self.dK.astype(grads.dtype, copy=False), self.rows_of, self.col0, grads)
