"""Wide&Deep: the CTR-DNN's MLP plus a first-order (wide) term, on the same table rows.

Each id's table row is ``[w | v_1..v_d]`` (row width d + 1, ``row_dim``): ``w`` is its
first-order weight, ``v`` its embedding; the trainer pools whole rows per slot, so slot f
of the input ``emb`` (B, S*(d+1)) holds ``[pool(w)_f | p_f]``.  For a batch::

    wide   = w_0 + sum_f pool(w)_f + u . dense                     # (B,)
    deep   = MLP(concat(p (B, S*d), dense (B, D)))                 # the CTR-DNN, (B,)
    logit  = wide + deep

The flat parameter vector is the CTR-DNN's followed by ``wide.b`` (w_0, (1,)) and
``wide.u`` (u, (D,)); both start at 0.  The split and the sums are in
:mod:`mpips.kernels.fm`; the MLP is :class:`mpips.models.ctr_dnn.CTRDNN`'s own code.
"""
import numpy as np

from mpips.kernels.fm import wide_fm_backward_, wide_fm_forward_
from mpips.models.ctr_dnn import CTRDNN


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
