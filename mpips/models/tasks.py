"""Several tasks (labels) in one network: the MMoE ``gate`` layer and the output heads
(docs/tasks.md).

A network with T > 1 logits trains T labels (the schema's ``label = [...]``, in order):

* ``head = "independent"`` (the default): task t's probability is ``sigmoid(logit_t)``, its
  loss the binary cross-entropy on label t;
* ``head = "esmm"`` (two logits, CTR then CVR): pCTR = sigmoid(a), pCTCVR = sigmoid(a) x
  sigmoid(b); the losses are on the click label (pCTR) and on the click-and-purchase label
  (pCTCVR), over all impressions.  Task 1's probability is pCTCVR; pCVR = pCTCVR / pCTR.

``loss_weights`` (one number per task, default 1) weigh the tasks' losses in the sum.

This module also holds the layer registry: the vocabulary of mpips.models.layers plus
``gate``.
"""
import numpy as np

from mpips.kernels import tasks as KT
from mpips.kernels.mlp import sigmoid_, sigmoid_bce_
from mpips.models import layers as L

HEADS = ("independent", "esmm")
OUTPUT_KEYS = ("logits", "head", "loss_weights")


class Gate(L.Layer):
    """``gate``: MMoE's mixture of experts for one task.  Inputs: the gate's input x
    (B, n) first, then E >= 2 experts of one width m.  ``g = softmax(x W + b)`` (B, E) and
    the output is ``sum_e g_e * expert_e`` (B, m).  Parameters ``{name}.w`` (n, E) and
    ``{name}.b`` (E,) (from 0)."""
    kind = "gate"
    N_INPUTS = (3, None)

    def __init__(self, name, ins, opts):
        super().__init__(name, ins, opts)
        experts = ins[1:]
        widths = {t.width for t in experts}
        if len(widths) > 1:
            got = ", ".join(f"{t.name} {t.width}" for t in experts)
            raise L.SpecError("inputs", f"a gate's experts (its inputs after the first) need "
                                        f"one width; got {got}")
        self.n_in, self.n_experts, self.width = ins[0].width, len(experts), widths.pop()
        self.params = [(f"{name}.w", (self.n_in, self.n_experts), (self.n_in, self.n_experts)),
                       (f"{name}.b", (self.n_experts,), None)]

    def alloc(self, cap, dtype):
        self.g = np.empty((cap, self.n_experts), dtype)       # (B, E) gate weights
        self.dg = np.empty((cap, self.n_experts), dtype)      # (B, E) their gradient
        self.scratch = np.empty((cap, self.n_in), dtype)

    def forward(self, P, xs, out, n):
        g = self.g[:n]
        np.matmul(xs[0], P[f"{self.name}.w"], out=g)
        g += P[f"{self.name}.b"]
        KT.softmax_rows_(g)
        for k, x in enumerate(xs[1:]):
            KT.mix_(g, k, x, out, k > 0)

    def backward(self, P, G, xs, out, gout, sinks, n):
        g, dg = self.g[:n], self.dg[:n]
        for k, (x, sink) in enumerate(zip(xs[1:], sinks[1:])):
            KT.rowdot_(gout, x, k, dg)                        # d g_k = <d out, expert_k>
            if sink is not None:
                KT.mix_(g, k, gout, sink.buf, sink.acc)       # d expert_k = g_k d out
                sink.done()
        KT.softmax_backward_(g, dg, G[f"{self.name}.b"])      # dg <- d(x W + b)
        np.matmul(xs[0].T, dg, out=G[f"{self.name}.w"])
        if sinks[0] is not None:
            sinks[0].matmul(dg, P[f"{self.name}.w"].T, self.scratch[:n])


KINDS = L.KINDS + ("gate",)
OPTIONS = dict(L.OPTIONS, gate=())


def make_layer(kind, name, ins, opts):
    """The layer of ``kind`` over input tensors ``ins``; SpecError for a bad option."""
    if kind == "gate":
        return Gate(name, ins, opts)
    if kind not in KINDS:
        raise L.SpecError("type", f"unknown layer type {kind!r}; choose one of "
                                  f"{', '.join(KINDS)}")
    return L.make_layer(kind, name, ins, opts)


def parse_output(output, fail):
    """The checked ``[output]`` table: (logits, extra) where ``extra`` holds ``head`` and
    ``loss_weights`` only when the file gives them (a one-task file's description, and so
    its digest, is what it was before tasks); ``fail(field, msg)`` raises."""
    logits = output.get("logits") if isinstance(output, dict) else None
    if not (isinstance(logits, list) and logits and all(isinstance(x, str) for x in logits)):
        fail("logits", "missing: name the layer that gives the logit, e.g. [output] "
             "logits = [\"out\"] (one width-1 layer per task)")
    if len(set(logits)) != len(logits):
        fail("logits", f"a layer is named twice: {logits}")
    extra = {}
    for k in sorted(set(output) - set(OUTPUT_KEYS)):
        fail(k, f"unknown key (an [output] table has {', '.join(OUTPUT_KEYS)})")
    if "head" in output:
        head = output["head"]
        if head not in HEADS:
            fail("head", f"must be one of {', '.join(HEADS)}; got {head!r}")
        if head == "esmm" and len(logits) != 2:
            fail("head", f"esmm takes two logits (CTR, then CVR); got {len(logits)}")
        extra["head"] = head
    if "loss_weights" in output:
        w = output["loss_weights"]
        if not (isinstance(w, list) and len(w) == len(logits) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in w)):
            fail("loss_weights", f"must be {len(logits)} numbers >= 0, one per logit; got {w!r}")
        extra["loss_weights"] = [float(x) for x in w]
    return logits, extra


class Head:
    """The loss and probabilities of T > 1 logits (one task a logit)."""

    def __init__(self, n_tasks, head="independent", loss_weights=None):
        self.T, self.kind = n_tasks, head
        self.weights = np.array(loss_weights or [1.0] * n_tasks, np.float64)   # (T,)
        self._loss = np.zeros(2, np.float64)

    def alloc(self, cap, dtype):
        self.probs = np.empty((cap, self.T), dtype)          # (B, T)
        self.p1 = np.empty(cap, dtype)                        # one task's probabilities
        self.y1 = np.empty(cap, dtype)                        # one task's labels

    def loss(self, logits, label, dlogits, scale, n):
        """Weighted summed loss; probabilities into ``self.probs[:n]`` (B, T); d(scale x
        loss)/d(logit_t) into ``dlogits[t]`` (B,).  ``label`` (B, T)."""
        probs = self.probs[:n]
        if self.kind == "esmm":
            KT.esmm_bce_(logits[0], logits[1], label, probs, dlogits[0], dlogits[1],
                         self.weights * scale, self._loss)
            return float(self.weights @ self._loss)
        total = 0.0
        p, y = self.p1[:n], self.y1[:n]
        for t in range(self.T):
            y[:] = label[:, t]
            total += self.weights[t] * sigmoid_bce_(logits[t], y, p, dlogits[t],
                                                    self.weights[t] * scale)
            probs[:, t] = p
        return total

    def predict(self, logits, out, n):
        """Probabilities (B, T) into ``out``."""
        p = self.p1[:n]
        for t in range(self.T):
            sigmoid_(logits[t], p)
            out[:, t] = p
        if self.kind == "esmm":
            out[:, 1] *= out[:, 0]                            # pCTCVR = pCTR x pCVR
