"""Per-kernel profile of one training step against the GEMM time it contains.

    python bench/bench_step.py                      # Criteo shape, batch 512, one thread
    python bench/bench_step.py --workers 2          # the dense optimizer on a 1/2 shard
    python bench/bench_step.py --dense-average 0.97 # + the cost of --dense-average

One process, one thread, the model's own code: the dnn network's ``forward_backward`` (the
layer path, ``mpips.models.network``) runs with its layers' ``np.matmul`` and kernels wrapped
in timers, so every product and every kernel
call of a step is timed where the model makes it: each call site's best over ``--reps``
steps, and the best time of a step outside those calls.  The step's other pieces (dedup,
gather, scatter, metrics, the dense Adam step) are the trainer's calls on the same batch.
Printed: microseconds per call site, its share of forward/backward (the sum of the bests),
the GEMMs' total against it (the share of the GEMM bound that forward/backward reaches:
``bench/bound.py``), and the rest of the step.  Bests of many repetitions are the figure
that holds on a shared machine (the load average is printed).  With ``--dense-average B``
the dense step is timed with and without the moving average, alternately on the same
gradients (medians and bests of each), and the difference is given as a share of the step.
"""
import argparse
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_v] = "1"        # one thread, before numpy loads its BLAS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402,F401  (the repo root on sys.path)

import numpy as np  # noqa: E402

import mpips.models.layers as layers  # noqa: E402
import mpips.models.network as network  # noqa: E402
from mpips.models.zoo import builtin  # noqa: E402
from mpips.kernels.embedding import gather_rows, scatter_add_rows, unique_inverse  # noqa: E402
from mpips.metrics import BinaryMetrics  # noqa: E402
from mpips.tables.dense import DenseTable  # noqa: E402
from mpips.tables.optim import OptimizerConfig  # noqa: E402


class _Sites:
    """Per call site (its order in a step) the label and the best seconds seen."""

    def __init__(self):
        self.labels, self.best, self.last, self.i = [], [], [], 0

    def start_step(self):
        self.i = 0

    def add(self, label_of, args, kw, dt):
        if self.i == len(self.labels):
            self.labels.append(label_of(*args, **kw))      # named once: not in the timing
            self.best.append(dt)
            self.last.append(dt)
        else:
            self.best[self.i] = min(self.best[self.i], dt)
            self.last[self.i] = dt
        self.i += 1


def _timed(fn, label_of, sites):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        r = fn(*a, **k)
        sites.add(label_of, a, k, time.perf_counter() - t0)
        return r
    return wrapper


class _TimedNumpy:
    """numpy, with matmul timed (what the layers' ``np`` becomes during the profile)."""

    def __init__(self, sites):
        def label(a, b, out=None):
            sa = "x".join(map(str, a.shape)) + ("^T" if not a.flags.c_contiguous else "")
            sb = "x".join(map(str, b.shape)) + ("^T" if not b.flags.c_contiguous else "")
            return f"gemm {sa} @ {sb}" if b.ndim == 2 else f"gemv {sa} @ {sb}"
        self.matmul = _timed(np.matmul, label, sites)

    def __getattr__(self, name):
        return getattr(np, name)


# (module, name) of every kernel a dnn step calls, timed where it is called
KERNELS = ((layers, "bias_relu_"), (layers, "outer_relu_backward_colsum_"),
           (layers, "relu_backward_colsum_"), (network, "sigmoid_bce_"))


def profile_model(model, params, emb, dense, label, reps):
    """[(label, best seconds)] per call site of forward_backward, and the best seconds of a
    step outside those calls (slicing, checks, Python).  The step's figure is their sum: on
    a loaded machine a whole 15 ms step is rarely left alone, its pieces often are."""
    grad, gemb = np.zeros_like(params), np.empty_like(emb)
    sites = _Sites()
    saved = {(m, k): getattr(m, k) for m, k in KERNELS + ((layers, "np"),)}
    try:
        layers.np = _TimedNumpy(sites)
        for m, k in KERNELS:
            setattr(m, k, _timed(saved[m, k], lambda *a, k=k: k, sites))
        outside = float("inf")
        for _ in range(reps):
            sites.start_step()
            t0 = time.perf_counter()
            model.forward_backward(params, emb, dense, label, grad, gemb, 1.0)
            step = time.perf_counter() - t0
            outside = min(outside, step - sum(sites.last[:sites.i]))
    finally:
        for (m, k), v in saved.items():
            setattr(m, k, v)
    return list(zip(sites.labels, sites.best)), outside


def best_of(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def paired(fa, fb, reps):
    """Medians and bests of ``fa`` and ``fb`` run alternately ``reps`` times each (a load
    that comes and goes touches both): ((median a, best a), (median b, best b)) seconds."""
    fa(), fb()
    ta, tb = [], []
    for _ in range(reps):
        for fn, out in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return tuple((float(np.median(t)), min(t)) for t in (ta, tb))


def average_cost(params, workers, reps, B, rng):
    """(plain, averaged) dense steps' (median, best) seconds on a 1/W shard: Adam, and Adam
    then the moving average of --dense-average B (its one pass over the shard)."""
    from mpips.worker.dense_sync import DenseStep, shard_bounds
    lo, hi = shard_bounds(len(params), workers)[:2]
    g = rng.standard_normal(hi - lo, dtype=np.float32) * 1e-3
    steps = [DenseStep(DenseTable(params, OptimizerConfig(), b), lo, hi) for b in (0.0, B)]

    def step(acc):
        def run():
            acc.reset()
            acc.add(512, g)
            acc.apply()
        return run
    return paired(step(steps[0]), step(steps[1]), reps)


def zipf_ids(rng, batch, slots):
    z = rng.zipf(1.3, size=(batch, slots)).astype(np.int64)
    return (z * 1000003 + np.arange(slots) * 7919) * 0x9E3779B1


def step_rest(model, params, batch, slots, workers, reps, rng):
    """Best seconds of the step's other pieces (one-hot slots, Adam on a 1/W shard)."""
    from mpips.worker.dense_sync import DenseStep, shard_bounds   # (imports mpi4py.MPI)
    ids = zipf_ids(rng, batch, slots).reshape(-1)
    keys, inv = unique_inverse(ids)
    dim = model.dim
    rows = rng.standard_normal((len(keys), dim), dtype=np.float32) * 0.01
    emb = np.empty((batch * slots, dim), np.float32)
    gemb = rng.standard_normal((batch * slots, dim), dtype=np.float32)
    probs = rng.random(batch, dtype=np.float32)
    label = (rng.random(batch) < 0.25).astype(np.float32)
    metrics = BinaryMetrics()
    table = DenseTable(params, OptimizerConfig())
    lo, hi = shard_bounds(model.n_params, workers)[:2]
    acc = DenseStep(table, lo, hi)
    g = rng.standard_normal(hi - lo, dtype=np.float32) * 1e-3

    def dense_step():
        acc.reset()
        for _ in range(workers):
            acc.add(batch, g)
        acc.apply()

    def scatter():
        out = np.empty_like(rows)
        scatter_add_rows(gemb, inv, out)

    return [(f"dedup ({len(ids)} ids -> {len(keys)} keys)", best_of(lambda: unique_inverse(ids),
                                                                     reps)),
            ("gather rows", best_of(lambda: gather_rows(rows, inv, emb), reps)),
            ("scatter-add row grads", best_of(scatter, reps)),
            ("metrics (AUC buckets)", best_of(lambda: metrics.update(probs, label), reps)),
            (f"dense Adam step ({hi - lo} of {model.n_params} weights, {workers} part(s))",
             best_of(dense_step, reps))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--n-sparse", type=int, default=26)
    ap.add_argument("--dim", type=int, default=10)
    ap.add_argument("--n-dense", type=int, default=13)
    ap.add_argument("--fc", default="400,400,400")
    ap.add_argument("--workers", type=int, default=1, help="W: the dense Adam step runs on "
                    "a 1/W shard and adds W parts (1: --local)")
    ap.add_argument("--reps", type=int, default=200, help="steps timed (each site's best)")
    ap.add_argument("--dense-average", type=float, default=0.0, help="B > 0: time the dense "
                    "step with the moving average of --dense-average B against without")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    hidden = tuple(int(x) for x in a.fc.split(","))
    model = builtin("dnn", a.n_sparse, a.dim, a.n_dense, hidden)
    params = model.init_params(0)
    B = a.batch
    emb = rng.standard_normal((B, model.emb_width), dtype=np.float32) * 0.1
    dense = rng.random((B, model.n_dense), dtype=np.float32)
    label = (rng.random(B) < 0.25).astype(np.float32)
    load0 = os.getloadavg()[0]
    sites, outside = profile_model(model, params, emb, dense, label, a.reps)
    rest = step_rest(model, params, B, a.n_sparse, a.workers, a.reps, rng)
    gemm = sum(s for lab, s in sites if lab.startswith("gemm"))
    whole = sum(s for _, s in sites) + outside
    print(f"forward/backward of batch {B}, CTR-DNN {a.n_sparse}x{a.dim}+{a.n_dense} -> "
          f"{a.fc}, one thread; best of {a.reps} per call site (us)")
    print(f"{'call site':44s} {'us':>8s} {'share':>6s}")
    for lab, s in sites:
        print(f"{lab:44s} {s * 1e6:>8.1f} {s / whole:>6.1%}")
    print(f"{'(outside the timed calls)':44s} {outside * 1e6:>8.1f} {outside / whole:>6.1%}")
    print(f"forward/backward (the sum): {whole * 1e6:.0f} us = {B / whole:.0f} ex/s; its GEMMs "
          f"{gemm * 1e6:.0f} us ({gemm / whole:.1%} of it: forward/backward runs at that "
          f"share of this BLAS's GEMM bound)")
    print("the step's other pieces (us):")
    for lab, s in rest:
        print(f"  {lab:60s} {s * 1e6:>8.1f}")
    step = whole + sum(s for _, s in rest)
    print(f"step total (without reading, pulls and pushes): {step * 1e6:.0f} us = "
          f"{B / step:.0f} ex/s; GEMMs are {gemm / step:.1%} of it")
    if a.dense_average:
        (pm, pb), (am, ab) = average_cost(params, a.workers, a.reps, a.dense_average, rng)
        print(f"dense step without / with --dense-average {a.dense_average:g} (us, median "
              f"and best of {a.reps} alternate runs): {pm * 1e6:.1f} / {am * 1e6:.1f} "
              f"(best {pb * 1e6:.1f} / {ab * 1e6:.1f}); the average costs {(am - pm) * 1e6:.1f} "
              f"us median, {(ab - pb) * 1e6:.1f} best = {(am - pm) / step:.2%} / "
              f"{(ab - pb) / step:.2%} of the step total; ratio of the dense steps "
              f"{am / pm:.3f} (median)")
    print(f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
