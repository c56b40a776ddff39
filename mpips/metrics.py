"""Binary-classification metrics that merge exactly across workers (Paddle-style AUC).

Predictions are counted in ``n_buckets`` equal-width buckets over [0, 1], separately for
positive and negative labels (Paddle's ``auc`` op with ``num_thresholds = n_buckets``).
The AUC is the trapezoid over the bucket thresholds, so examples in the same bucket
count as ties (half credit) — exactly sklearn's ``roc_auc_score`` when no two distinct
predictions share a bucket, and within about ``1 / n_buckets`` otherwise.

Everything is held in ONE flat float64 array (``state()``): summing the states of
several workers (``MPI.Allreduce(SUM)``) gives the state of the union, and since the
histograms hold integer counts (exact in float64 up to 2**53) the merged AUC equals the
AUC of the union bit for bit::

    local = metrics.state()
    total = np.empty_like(local)
    worker_comm.Allreduce(local, total)             # op=SUM
    merged = BinaryMetrics.from_state(total)

State layout: ``[pos (n_buckets), neg (n_buckets), n, n_pos, logloss_sum, pred_sum,
abs_err_sum, sq_err_sum, n_nan]``.

With one class only (no positives or no negatives) the AUC is undefined and
``auc()`` returns NaN (as sklearn, which raises); ``logloss()`` etc. return NaN when
no example was counted. NaN predictions are not counted but tallied in ``n_nan``.

``Stopwatch`` adds up the seconds of named phases (the trainer's TIMES line).
"""
from __future__ import annotations

import math
import time

import numpy as np

from mpips.kernels.mlp import (
    ACC_ABS,
    ACC_LOSS,
    ACC_N,
    ACC_NAN,
    ACC_NPOS,
    ACC_PRED,
    ACC_SQ,
    N_ACC,
    binary_metrics_update_,
)

DEFAULT_BUCKETS = 1 << 16


class BinaryMetrics:
    """Bucketed AUC, logloss and calibration for 0/1 labels and predicted probabilities."""

    raw = None       # --dense-average: the trained weights' metrics beside these (or None)

    def __init__(self, n_buckets: int = DEFAULT_BUCKETS):
        n_buckets = int(n_buckets)
        if n_buckets < 1:
            raise ValueError(f"n_buckets must be >= 1; got {n_buckets}")
        self.n_buckets = n_buckets
        self._state = np.zeros(2 * n_buckets + N_ACC, np.float64)
        self._pos = self._state[:n_buckets]                   # (n_buckets,)
        self._neg = self._state[n_buckets:2 * n_buckets]      # (n_buckets,)
        self._acc = self._state[2 * n_buckets:]               # (N_ACC,)

    # ------------------------------------------------------------------ accumulation
    def update(self, probs, labels) -> None:
        """Count a batch: ``probs`` (n,) in [0, 1], ``labels`` (n,) 0/1."""
        probs, labels = np.asarray(probs), np.asarray(labels)
        if probs.ndim != 1 or labels.shape != probs.shape:
            raise ValueError(f"probs and labels must be 1-D of the same length; got "
                             f"{probs.shape} and {labels.shape}")
        if probs.dtype.kind != "f":
            raise ValueError(f"probs must be a float array; got {probs.dtype}")
        if labels.dtype.kind not in "biuf":
            raise ValueError(f"labels must be numeric; got {labels.dtype}")
        if probs.size:
            binary_metrics_update_(probs, labels, self._pos, self._neg, self._acc)

    def state(self) -> np.ndarray:
        """A copy of the flat float64 state (2 * n_buckets + 7,); sum states to merge."""
        return self._state.copy()

    @classmethod
    def from_state(cls, arr) -> "BinaryMetrics":
        """Metrics from a (possibly summed) state array."""
        arr = np.asarray(arr, dtype=np.float64)
        n_buckets, rem = divmod(arr.size - N_ACC, 2)
        if arr.ndim != 1 or rem or n_buckets < 1:
            raise ValueError(f"a BinaryMetrics state has 2 * n_buckets + {N_ACC} entries; "
                             f"got shape {arr.shape}")
        out = cls(n_buckets)
        out._state[:] = arr
        return out

    def with_state(self, arr) -> "BinaryMetrics":
        """Metrics of this kind from a (summed) state array (see TaskMetrics)."""
        return type(self).from_state(arr)

    def merge(self, other: "BinaryMetrics") -> "BinaryMetrics":
        """Add ``other``'s counts into this one (in place); returns self."""
        if other.n_buckets != self.n_buckets:
            raise ValueError(f"cannot merge metrics with {other.n_buckets} buckets into "
                             f"{self.n_buckets} buckets")
        self._state += other._state
        if other.raw is not None:              # (--dense-average: the trained weights')
            self.raw = (BinaryMetrics(self.n_buckets) if self.raw is None
                        else self.raw).merge(other.raw)
        return self

    def reset(self) -> None:
        """Forget everything counted."""
        self._state[:] = 0.0

    # ------------------------------------------------------------------ results
    @property
    def count(self) -> int:
        """Examples counted (NaN predictions excluded)."""
        return int(self._acc[ACC_N])

    @property
    def n_pos(self) -> int:
        return int(self._acc[ACC_NPOS])

    @property
    def n_nan(self) -> int:
        """NaN predictions seen (not counted anywhere else)."""
        return int(self._acc[ACC_NAN])

    def auc(self) -> float:
        """Area under the ROC curve over the bucket thresholds; NaN with one class only."""
        pos, neg = self._pos, self._neg
        tot_pos, tot_neg = pos.sum(), neg.sum()
        if tot_pos <= 0.0 or tot_neg <= 0.0:
            return math.nan
        # positives in strictly higher buckets, per bucket; ties in a bucket count half
        above = np.cumsum(pos[::-1])[::-1] - pos              # (n_buckets,)
        area = float(np.dot(neg, above + 0.5 * pos))
        return area / (tot_pos * tot_neg)

    def _mean(self, idx: int) -> float:
        n = self._acc[ACC_N]
        return float(self._acc[idx] / n) if n > 0 else math.nan

    def logloss(self) -> float:
        """Mean binary cross-entropy, predictions clipped to [1e-7, 1 - 1e-7]."""
        return self._mean(ACC_LOSS)

    def mean_pred(self) -> float:
        """Mean predicted probability."""
        return self._mean(ACC_PRED)

    def observed_ctr(self) -> float:
        """Fraction of positive labels."""
        return self._mean(ACC_NPOS)

    def copc(self) -> float:
        """Observed / predicted clicks (Paddle's COPC; 1.0 is perfectly calibrated)."""
        pred = self._acc[ACC_PRED]
        return float(self._acc[ACC_NPOS] / pred) if pred > 0 else math.nan

    def mae(self) -> float:
        return self._mean(ACC_ABS)

    def rmse(self) -> float:
        return math.sqrt(self._mean(ACC_SQ))

    def summary(self) -> dict:
        """All metrics as a dict of Python scalars (for logs and JSON lines)."""
        return {"auc": self.auc(), "logloss": self.logloss(), "mean_pred": self.mean_pred(),
                "observed_ctr": self.observed_ctr(), "copc": self.copc(), "mae": self.mae(),
                "rmse": self.rmse(), "count": self.count, "n_nan": self.n_nan}

    def __repr__(self) -> str:
        return (f"BinaryMetrics(count={self.count}, auc={self.auc():.6f}, "
                f"logloss={self.logloss():.6f})")


class TaskMetrics:
    """BinaryMetrics per task (label), for a network with T > 1 logits.  The headline
    (``auc()``, ``logloss()``, ``count`` ...) is the first task's; ``tasks`` maps each label
    to its metrics.  ``esmm``: also the CVR on the clicked rows (``cvr``: pCTCVR / pCTR
    against the second label where the first is 1), the figure ESMM's paper reports."""

    raw = None       # --dense-average: the trained weights' metrics (a TaskMetrics) or None

    def __init__(self, names, esmm: bool = False, n_buckets: int = DEFAULT_BUCKETS):
        self.names, self.esmm = tuple(names), bool(esmm)
        self.parts = [BinaryMetrics(n_buckets) for _ in range(len(self.names) + self.esmm)]
        self.tasks = dict(zip(self.names, self.parts))
        self.cvr = self.parts[-1] if self.esmm else None

    def update(self, probs, labels) -> None:
        """Count a batch: ``probs`` and ``labels`` (n, T)."""
        probs, labels = np.asarray(probs), np.asarray(labels)
        T = len(self.names)
        if probs.shape != labels.shape or probs.ndim != 2 or probs.shape[1] != T:
            raise ValueError(f"probs and labels must be (n, {T}); got {probs.shape} and "
                             f"{labels.shape}")
        for t in range(T):
            self.parts[t].update(np.ascontiguousarray(probs[:, t]),
                                 np.ascontiguousarray(labels[:, t]))
        if self.esmm:
            clicked = labels[:, 0] == 1
            if clicked.any():
                p = probs[clicked]
                self.cvr.update(np.minimum(p[:, 1] / np.maximum(p[:, 0], 1e-30), 1.0),
                                np.ascontiguousarray(labels[clicked, 1]))

    def state(self) -> np.ndarray:
        return np.concatenate([m.state() for m in self.parts])

    def with_state(self, arr) -> "TaskMetrics":
        out = TaskMetrics(self.names, self.esmm, self.parts[0].n_buckets)
        for m, a in zip(out.parts, np.split(np.asarray(arr, np.float64), len(out.parts))):
            m._state[:] = a
        return out

    def merge(self, other: "TaskMetrics") -> "TaskMetrics":
        for a, b in zip(self.parts, other.parts):
            a.merge(b)
        if other.raw is not None:              # (--dense-average: the trained weights')
            self.raw = (TaskMetrics(self.names, self.esmm, self.parts[0].n_buckets)
                        if self.raw is None else self.raw).merge(other.raw)
        return self

    def reset(self) -> None:
        for m in self.parts:
            m.reset()

    def __getattr__(self, name):          # the headline: the first task's metrics
        if name in ("parts", "tasks", "names", "esmm", "cvr"):
            raise AttributeError(name)
        return getattr(self.parts[0], name)

    def task_fields(self, prefix="test_") -> dict:
        """{label: {prefix+auc, prefix+logloss, prefix+mean_pred, prefix+ctr}} (and for
        ESMM ``cvr_auc_clicked`` under the second label)."""
        out = {}
        for name, m in self.tasks.items():
            out[name] = {f"{prefix}auc": m.auc(), f"{prefix}logloss": m.logloss(),
                         f"{prefix}mean_pred": m.mean_pred(), f"{prefix}ctr": m.observed_ctr()}
        if self.esmm:
            out[self.names[1]][f"{prefix}cvr_auc_clicked"] = self.cvr.auc()
        return out


def new_metrics(names=(), esmm=False):
    """BinaryMetrics for one task; TaskMetrics for several labels ``names``."""
    return TaskMetrics(names, esmm) if len(names) > 1 else BinaryMetrics()


class Stopwatch:
    """Seconds per named phase, summed over the blocks timed: ``with watch("read"): ...``
    adds the block's seconds to ``watch.seconds["read"]``; ``watch.last`` holds the seconds
    of the block that ended last.  Blocks may nest (an outer phase includes inner ones)."""
    __slots__ = ("seconds", "last")

    def __init__(self, names=()):
        self.seconds = dict.fromkeys(names, 0.0)     # phase -> seconds
        self.last = 0.0

    def __call__(self, name):
        return _Lap(self, name)


class _Lap:
    __slots__ = ("watch", "name", "t0")

    def __init__(self, watch, name):
        self.watch, self.name = watch, name

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t0
        w = self.watch
        w.seconds[self.name] = w.seconds.get(self.name, 0.0) + dt
        w.last = dt
        return False
