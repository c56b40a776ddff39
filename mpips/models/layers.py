"""The layer vocabulary: each layer's forward and backward, written once (docs/models.md).

A layer reads the output tensors of the layers (or inputs) it names and writes one output
tensor (B, width).  Its parameters are slices of the network's one flat vector: ``params``
lists ``(name, shape, fan)`` in storage order (``fan``: (fan_in, fan_out) for a weight
drawn by the network's init, None for one that starts at 0).  Products run through BLAS
(``np.matmul(..., out=)``), the elementwise work in :mod:`mpips.kernels.layers` and
:mod:`mpips.kernels.mlp`.

Backward: ``gout`` is d(loss)/d(output) (B, width), which a layer may overwrite; each
input's gradient goes to its :class:`Sink` (None: that input needs none), which knows
whether another consumer wrote there first (then the layer adds) and, for a concat read by
one layer, hands each part its columns without building the whole gradient.

A width-1 layer keeps its weight as a vector (in,) and runs matrix-vector products.
Tensors carry a field structure for ``fm2`` and ``dot``: ``fields`` vectors of
``field_dim`` (the pooled slots: S x dim; any other tensor: one field of its width).
"""
import numpy as np

from mpips.kernels import layers as K
from mpips.kernels.mlp import bias_relu_, outer_relu_backward_colsum_, relu_backward_colsum_

ACTIVATIONS = ("relu", "identity", "sigmoid")


class SpecError(ValueError):
    """A bad network file: ``field`` names the option at fault (the caller adds where)."""

    def __init__(self, field, msg):
        super().__init__(msg)
        self.field = field


class Tensor:
    """One named output: width, field structure, whether the loss flows back into it."""

    def __init__(self, name, width, fields=1, field_dim=None, grad=True, producer=None):
        self.name, self.width, self.grad, self.producer = name, int(width), grad, producer
        self.fields = int(fields)
        self.field_dim = int(width if field_dim is None else field_dim)
        self.consumers = []
        self.source = None          # for a network input: its source (mpips.models.network)


class Sink:
    """Where one consumer's gradient of a tensor goes: ``buf`` (B, width), ``acc`` (add to
    what is there); ``done()`` after writing."""

    def __init__(self, buf, acc, on_done):
        self.buf, self.acc, self._done = buf, acc, on_done

    def matmul(self, a, bt, scratch):
        """buf (+)= a @ bt."""
        if self.acc:
            tmp = scratch[:, :self.buf.shape[1]]
            np.matmul(a, bt, out=tmp)
            self.buf += tmp
        else:
            np.matmul(a, bt, out=self.buf)
        self.done()

    def done(self):
        self._done()


class SplitSink(Sink):
    """The gradient of a concat read by one layer: a product goes straight to each part
    (``parts``: (lo, hi, Sink or None)); anything else is written to ``buf`` and split."""

    def __init__(self, buf, parts):
        super().__init__(buf, False, None)
        self.parts = parts

    def matmul(self, a, bt, scratch):
        for lo, hi, sink in self.parts:
            if sink is not None:
                sink.matmul(a, bt[:, lo:hi], scratch)

    def done(self):
        for lo, hi, sink in self.parts:
            if sink is not None:
                K.add_into_(self.buf[:, lo:hi], sink.buf, sink.acc)
                sink.done()


def _positive_int(opts, key, default=None):
    v = opts.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(key, f"must be a positive integer; got {v!r}")
    return v


class Layer:
    """Base: no parameters, no buffers.  Subclasses set ``width`` (and the field structure)
    from their inputs and options, and ``params``."""
    kind = ""
    OPTIONS = ()        # the option keys a layer takes besides type and inputs
    N_INPUTS = (1, 1)   # fewest and most inputs

    def __init__(self, name, ins, opts):
        lo, hi = self.N_INPUTS
        if not lo <= len(ins) <= (hi or len(ins)):
            want = f"{lo}" if lo == hi else f"at least {lo}" if not hi else f"{lo} to {hi}"
            raise SpecError("inputs", f"a {self.kind} layer takes {want} input(s); got "
                                      f"{len(ins)}")
        self.name, self.ins, self.params = name, list(ins), []
        self.fields, self.field_dim = 1, None

    def alloc(self, cap, dtype):
        """Allocate the layer's own buffers for batches of up to ``cap`` rows."""

    def same_widths(self):
        widths = {t.width for t in self.ins}
        if len(widths) > 1:
            got = ", ".join(f"{t.name} {t.width}" for t in self.ins)
            raise SpecError("inputs", f"a {self.kind} layer needs inputs of one width; got "
                                      f"{got}")
        return widths.pop()


class Dense(Layer):
    """``linear`` (one layer: ``width``, ``activation`` default identity) and ``mlp`` (a
    stack: ``widths``, ``activation`` default relu on every layer).  Parameters
    ``{name}.w`` (in, out), ``{name}.b`` (out,) for a linear; ``{name}{i}.w``, ``.b`` for
    the layers of an mlp."""
    OPTIONS = ("width", "widths", "activation")

    def __init__(self, name, ins, opts, kind):
        self.kind = kind
        super().__init__(name, ins, opts)
        if kind == "linear":
            self.widths = [_positive_int(opts, "width")]
        else:
            ws = opts.get("widths")
            if not isinstance(ws, list) or not ws:
                raise SpecError("widths", f"must be a non-empty list of widths; got {ws!r}")
            self.widths = [_positive_int({"widths": w}, "widths") for w in ws]
        self.act = opts.get("activation", "identity" if kind == "linear" else "relu")
        if self.act not in ACTIVATIONS:
            raise SpecError("activation", f"must be one of {', '.join(ACTIVATIONS)}; got "
                                          f"{self.act!r}")
        fan_in, self.names = ins[0].width, []
        for i, h in enumerate(self.widths):
            pre = name if kind == "linear" else f"{name}{i}"
            shape = (fan_in,) if h == 1 else (fan_in, h)
            self.params += [(f"{pre}.w", shape, (fan_in, h)), (f"{pre}.b", (h,), None)]
            self.names.append((f"{pre}.w", f"{pre}.b"))
            fan_in = h
        self.width = self.widths[-1]
        self.relu_below = None      # fused: the relu Dense whose only reader this logit is
        self.preact_grad = False    # fused: the layer above hands d(pre-activation)

    def fuse_relu_below(self, below):
        """A width-1 identity layer reading a relu layer alone writes that layer's
        d(pre-activation) and bias gradient in one pass (the CTR-DNN's output step)."""
        self.relu_below, below.preact_grad = below, True

    def last_bias(self):
        """The name of the last layer's bias."""
        return self.names[-1][1]

    def alloc(self, cap, dtype):
        self.acts = [np.empty((cap, h), dtype) for h in self.widths[:-1]]    # (B, h_i)
        self.grads = [np.empty((cap, h), dtype) for h in self.widths[:-1]]   # (B, h_i)
        self.scratch = np.empty((cap, self.ins[0].width), dtype)

    def _wb(self, P, i):
        w, b = self.names[i]
        return P[w], P[b]

    def forward(self, P, xs, out, n):
        inp = xs[0]
        last = len(self.widths) - 1
        for i in range(last + 1):
            w, b = self._wb(P, i)
            a = out if i == last else self.acts[i][:n]
            if w.ndim == 1:
                a1 = a.reshape(n)
                np.matmul(inp, w, out=a1)
            else:
                np.matmul(inp, w, out=a)
            if self.act == "relu":
                bias_relu_(a, b)
            elif self.act == "sigmoid":
                K.bias_sigmoid_(a, b)
            elif w.ndim == 1:
                a1 += b[0]
            else:
                a += b
            inp = a

    def _act_backward(self, da, a, gb):
        """d(activation) -> d(pre-activation) in place, and the bias gradient."""
        if self.act == "relu":
            relu_backward_colsum_(da, a, gb)
        elif self.act == "sigmoid":
            K.sigmoid_backward_colsum_(da, a, gb)
        elif da.shape[1] == 1:
            gb[0] = da.reshape(-1).sum()
        else:
            K.colsum_(da, gb)

    def backward(self, P, G, xs, out, gout, sinks, n):
        last = len(self.widths) - 1
        dz = gout
        if not self.preact_grad:
            self._act_backward(dz, out, self._wb(G, last)[1])
        for i in range(last, -1, -1):
            w = self._wb(P, i)[0]
            gw = self._wb(G, i)[0]
            a_prev = self.acts[i - 1][:n] if i else xs[0]
            dz1 = dz.reshape(n) if w.ndim == 1 else dz
            np.matmul(a_prev.T, dz1, out=gw)                    # dW_i = a_{i-1}^T dz_i
            if i:
                da = self.grads[i - 1][:n]
                if w.ndim == 1:
                    K.outer_(dz1, w, da, False)
                else:
                    np.matmul(dz, w.T, out=da)                  # d a_{i-1} = dz_i W_i^T
                self._act_backward(da, a_prev, self._wb(G, i - 1)[1])
                dz = da
            elif sinks[0] is not None:
                if self.relu_below is not None:
                    outer_relu_backward_colsum_(dz1, w, xs[0], sinks[0].buf,
                                                G[self.relu_below.last_bias()])
                    sinks[0].done()
                elif w.ndim == 1:
                    K.outer_(dz1, w, sinks[0].buf, sinks[0].acc)
                    sinks[0].done()
                else:
                    sinks[0].matmul(dz, w.T, self.scratch[:n])


class Concat(Layer):
    """``concat``: the inputs side by side.  Fields add up when every input has the same
    field width (e.g. a bottom MLP's output of dim beside the pooled slots)."""
    kind = "concat"
    N_INPUTS = (1, None)

    def __init__(self, name, ins, opts):
        super().__init__(name, ins, opts)
        self.width = sum(t.width for t in ins)
        self.cols, lo = [], 0
        for t in ins:
            self.cols.append((lo, lo + t.width))
            lo += t.width
        dims = {t.field_dim for t in ins}
        if len(dims) == 1:
            self.fields, self.field_dim = sum(t.fields for t in ins), dims.pop()

    def forward(self, P, xs, out, n):
        for (lo, hi), x in zip(self.cols, xs):
            out[:, lo:hi] = x

    def backward(self, P, G, xs, out, gout, sinks, n):
        for (lo, hi), sink in zip(self.cols, sinks):
            if sink is not None:
                K.add_into_(gout[:, lo:hi], sink.buf, sink.acc)
                sink.done()


class Sum(Layer):
    """``add`` (two inputs) and ``sum`` (a list): elementwise, in the order listed."""
    N_INPUTS = (1, None)

    def __init__(self, name, ins, opts, kind):
        self.kind = kind
        if kind == "add":
            self.N_INPUTS = (2, 2)
        super().__init__(name, ins, opts)
        self.width = self.same_widths()

    def forward(self, P, xs, out, n):
        if len(xs) == 1:
            out[...] = xs[0]
            return
        np.add(xs[0], xs[1], out=out)
        for x in xs[2:]:
            out += x

    def backward(self, P, G, xs, out, gout, sinks, n):
        for sink in sinks:
            if sink is not None:
                K.add_into_(gout, sink.buf, sink.acc)
                sink.done()


class Mul(Layer):
    """``mul``: the Hadamard product of two inputs of one width."""
    kind = "mul"
    N_INPUTS = (2, 2)

    def __init__(self, name, ins, opts):
        super().__init__(name, ins, opts)
        self.width = self.same_widths()

    def forward(self, P, xs, out, n):
        np.multiply(xs[0], xs[1], out=out)

    def backward(self, P, G, xs, out, gout, sinks, n):
        for k, sink in enumerate(sinks):
            if sink is not None:
                K.mul_into_(gout, xs[1 - k], sink.buf, sink.acc)
                sink.done()


def _field_input(layer, t):
    if t.fields * t.field_dim != t.width:
        raise SpecError("inputs", f"a {layer.kind} layer needs fields of one width; input "
                                  f"{t.name!r} mixes widths (concat only fields of one dim)")
    return t.fields


class FM2(Layer):
    """``fm2``: ``0.5 * sum_k [(sum_f p_fk)^2 - sum_f p_fk^2]`` = the sum of ``<p_f, p_g>``
    over field pairs f < g (the factorization machine's pairwise term), width 1."""
    kind = "fm2"

    def __init__(self, name, ins, opts):
        super().__init__(name, ins, opts)
        self.n_fields, self.width = _field_input(self, ins[0]), 1

    def forward(self, P, xs, out, n):
        K.fm2_forward_(xs[0], self.n_fields, out.reshape(n))

    def backward(self, P, G, xs, out, gout, sinks, n):
        if sinks[0] is not None:
            K.fm2_backward_(xs[0], self.n_fields, gout.reshape(n), sinks[0].buf, sinks[0].acc)
            sinks[0].done()


class FirstOrder(Layer):
    """``first_order``: the wide term ``b + sum_f w_f + u . dense`` over the first-order
    weights ``w`` (B, S) and, optionally, the dense features; width 1.  Parameters
    ``{name}.b`` (1,) and ``{name}.u`` (D,), both from 0.  A network may fold an fm2 over
    the pooled slots into it (``fuse_fm``): the two sums then share one float64 pass."""
    kind = "first_order"
    N_INPUTS = (1, 2)

    def __init__(self, name, ins, opts):
        super().__init__(name, ins, opts)
        if ins[0].source != "first_order":
            raise SpecError("inputs", "the first input of a first_order layer must be an "
                                      "input of source \"first_order\"")
        self.width, self.n_dense, self.fm_fields = 1, (ins[1].width if len(ins) > 1 else 0), 0
        self.params = [(f"{name}.b", (1,), None)]
        if len(ins) > 1:
            self.params.append((f"{name}.u", (self.n_dense,), None))

    def fuse_fm(self, fm):
        """Take over fm2 layer ``fm``: its input becomes this layer's last input."""
        self.fm_fields = fm.n_fields
        self.ins.append(fm.ins[0])

    def alloc(self, cap, dtype):
        self.lin = np.empty(cap, dtype)

    def forward(self, P, xs, out, n):
        o = out.reshape(n)
        p = xs[-1] if self.fm_fields else xs[0]
        K.first_order_fm_forward_(xs[0], p, max(self.fm_fields, 1), self.fm_fields > 0, o)
        if self.n_dense:
            lin = self.lin[:n]
            np.matmul(xs[1], P[f"{self.name}.u"], out=lin)
            o += lin
        o += P[f"{self.name}.b"][0]

    def backward(self, P, G, xs, out, gout, sinks, n):
        g = gout.reshape(n)
        G[f"{self.name}.b"][0] = g.sum()
        if self.n_dense:
            np.matmul(xs[1].T, g, out=G[f"{self.name}.u"])
        if sinks[0] is not None:
            K.broadcast_(g, sinks[0].buf, sinks[0].acc)
            sinks[0].done()
        if self.fm_fields and sinks[-1] is not None:
            K.fm2_backward_(xs[-1], self.fm_fields, g, sinks[-1].buf, sinks[-1].acc)
            sinks[-1].done()


class Cross(Layer):
    """``cross``: ``depth`` DCN layers over one input x0, ``x_{l+1} = x0 * (x_l W_l + b_l)
    + x_l``.  ``rank = 0`` (default): W_l full (n, n), ``{name}{l}.w``; ``rank = r``: W_l =
    V_l U_l, ``{name}{l}.v`` (n, r), ``{name}{l}.u`` (r, n); ``kind = "vector"``: DCN v1,
    ``x0 * (x_l . w_l) + b_l + x_l`` with ``{name}{l}.w`` (n,).  Biases ``{name}{l}.b``."""
    kind = "cross"
    OPTIONS = ("depth", "rank", "kind")

    def __init__(self, name, ins, opts):
        super().__init__(name, ins, opts)
        self.depth = _positive_int(opts, "depth", 1)
        self.rank = opts.get("rank", 0)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise SpecError("rank", f"must be 0 (full rank) or a positive integer; got "
                                    f"{self.rank!r}")
        self.vector = opts.get("kind", "matrix") == "vector"
        if opts.get("kind", "matrix") not in ("matrix", "vector"):
            raise SpecError("kind", f"must be \"matrix\" (DCN-v2) or \"vector\" (DCN); got "
                                    f"{opts['kind']!r}")
        m = self.width = ins[0].width
        for li in range(self.depth):
            pre = f"{name}{li}"
            if self.vector:
                self.params.append((f"{pre}.w", (m,), (m, 1)))
            elif self.rank:
                self.params += [(f"{pre}.v", (m, self.rank), (m, self.rank)),
                                (f"{pre}.u", (self.rank, m), (self.rank, m))]
            else:
                self.params.append((f"{pre}.w", (m, m), (m, m)))
            self.params.append((f"{pre}.b", (m,), None))

    def alloc(self, cap, dtype):
        m, d = self.width, self.depth
        self.xl = [np.empty((cap, m), dtype) for _ in range(d - 1)]   # x_1 .. x_{d-1}
        self.z = [np.empty((cap, 1 if self.vector else m), dtype) for _ in range(d)]
        self.h = [np.empty((cap, self.rank), dtype) for _ in range(d)] if self.rank else []
        self.g = np.empty((cap, m), dtype)
        self.gn = np.empty((cap, m), dtype)
        self.gx0 = np.empty((cap, m), dtype)
        self.dz = np.empty((cap, m), dtype)
        self.ds = np.empty(cap, dtype)
        self.dh = np.empty((cap, max(self.rank, 1)), dtype)

    def _x(self, xs, out, li, n):
        """x_l for l = 0 .. depth (x_depth is the output)."""
        if li == 0:
            return xs[0]
        return out if li == self.depth else self.xl[li - 1][:n]

    def forward(self, P, xs, out, n):
        x0 = xs[0]
        for li in range(self.depth):
            pre, xl, nxt = f"{self.name}{li}", self._x(xs, out, li, n), \
                self._x(xs, out, li + 1, n)
            z = self.z[li][:n]
            if self.vector:
                np.matmul(xl, P[f"{pre}.w"], out=z.reshape(n))
                K.cross_v1_combine_(x0, z.reshape(n), P[f"{pre}.b"], xl, nxt)
                continue
            if self.rank:
                h = self.h[li][:n]
                np.matmul(xl, P[f"{pre}.v"], out=h)
                np.matmul(h, P[f"{pre}.u"], out=z)
            else:
                np.matmul(xl, P[f"{pre}.w"], out=z)
            K.cross_combine_(x0, z, P[f"{pre}.b"], xl, nxt)

    def backward(self, P, G, xs, out, gout, sinks, n):
        x0, g, gx0 = xs[0], gout, self.gx0[:n]
        bufs = (self.gn[:n], self.g[:n])                # d x_l, two in turn
        for li in range(self.depth - 1, -1, -1):
            pre, xl, z = f"{self.name}{li}", self._x(xs, out, li, n), self.z[li][:n]
            acc = li < self.depth - 1
            gn = bufs[li % 2]
            if self.vector:
                ds = self.ds[:n]
                K.cross_v1_backward_(g, x0, z.reshape(n), ds, G[f"{pre}.b"], gx0, acc)
                np.matmul(xl.T, ds, out=G[f"{pre}.w"])
                K.outer_(ds, P[f"{pre}.w"], gn, False)
            else:
                dz = self.dz[:n]
                K.cross_backward_(g, x0, z, dz, G[f"{pre}.b"], gx0, acc)
                if self.rank:
                    h, dh = self.h[li][:n], self.dh[:n]
                    np.matmul(h.T, dz, out=G[f"{pre}.u"])
                    np.matmul(dz, P[f"{pre}.u"].T, out=dh)
                    np.matmul(xl.T, dh, out=G[f"{pre}.v"])
                    np.matmul(dh, P[f"{pre}.v"].T, out=gn)
                else:
                    np.matmul(xl.T, dz, out=G[f"{pre}.w"])
                    np.matmul(dz, P[f"{pre}.w"].T, out=gn)
            gn += g                                   # d x_l = g + (the W path)
            g = gn
        g += gx0                                      # x_0 is both x0 and x_l at l = 0
        if sinks[0] is not None:
            K.add_into_(g, sinks[0].buf, sinks[0].acc)
            sinks[0].done()


class Dot(Layer):
    """``dot``: DLRM's pairwise interaction over the fields of one input (e.g. a concat of
    a bottom MLP's output of dim and the pooled slots): ``<e_a, e_b>`` for a < b, width
    F(F-1)/2, pairs in row-major order.  Both passes are batched products, (F, d) x (d, F)
    and (F, F) x (F, d) an example, through BLAS."""
    kind = "dot"

    def __init__(self, name, ins, opts):
        super().__init__(name, ins, opts)
        self.n_fields = F = _field_input(self, ins[0])
        if F < 2:
            raise SpecError("inputs", f"a dot layer needs at least 2 fields; input "
                                      f"{ins[0].name!r} has {F}")
        self.width = F * (F - 1) // 2
        a, b = np.triu_indices(F, 1)                  # the pairs, row-major
        self.upper, self.lower = a * F + b, b * F + a  # their places in (F, F)
        self.diag = np.arange(F) * (F + 1)

    def alloc(self, cap, dtype):
        F, d = self.n_fields, self.ins[0].field_dim
        self.m = np.empty((cap, F, F), dtype)         # E E^T, then d out / d(E E^T)
        self.ge = np.empty((cap, F, d), dtype)

    def forward(self, P, xs, out, n):
        F = self.n_fields
        e = xs[0].reshape(n, F, -1)                                   # (B, F, d)
        m = self.m[:n]
        np.matmul(e, e.transpose(0, 2, 1), out=m)                     # (B, F, F)
        np.take(m.reshape(n, F * F), self.upper, axis=1, out=out)

    def backward(self, P, G, xs, out, gout, sinks, n):
        if sinks[0] is None:
            return
        F = self.n_fields
        m = self.m[:n].reshape(n, F * F)
        m[:, self.upper] = gout                        # d out / d(E E^T): symmetric, 0 on
        m[:, self.lower] = gout                        # the diagonal
        m[:, self.diag] = 0
        ge = self.ge[:n]
        np.matmul(self.m[:n], xs[0].reshape(n, F, -1), out=ge)       # dE = G E
        K.add_into_(ge.reshape(n, -1), sinks[0].buf, sinks[0].acc)
        sinks[0].done()


def make_layer(kind, name, ins, opts):
    """The layer of ``kind`` over input tensors ``ins``; SpecError for a bad option."""
    if kind in ("linear", "mlp"):
        return Dense(name, ins, opts, kind)
    if kind in ("add", "sum"):
        return Sum(name, ins, opts, kind)
    cls = SIMPLE.get(kind)
    if cls is None:
        raise SpecError("type", f"unknown layer type {kind!r}; choose one of "
                                f"{', '.join(KINDS)}")
    return cls(name, ins, opts)


SIMPLE = {c.kind: c for c in (Concat, Mul, FM2, FirstOrder, Cross, Dot)}
KINDS = ("linear", "mlp", "concat", "add", "sum", "mul", "fm2", "first_order", "cross", "dot")
OPTIONS = dict({k: Dense.OPTIONS for k in ("linear", "mlp")},
               **{k: () for k in ("concat", "add", "sum", "mul", "fm2", "first_order", "dot")},
               cross=Cross.OPTIONS)
