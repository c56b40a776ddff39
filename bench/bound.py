"""The machine's GEMM bound for the CTR-DNN's shapes, one thread, with every BLAS installed.

    python bench/bound.py                         # Criteo shape: B 512, 26 x 10 + 13 -> 400,400,400
    python bench/bound.py --fc 512,256,128,128,128 --n-sparse 300 --dim 9 --n-dense 0
    python bench/bound.py --json bound.json

A training step of the MLP is these matrix products (the model's own, ``mpips.models.network``,
with the same operand layouts: weights stored (in, out), row-major, transposes as views):

* forward, per layer:        ``a_l = a_{l-1} @ W_l``                  (B, in) x (in, out)
* backward, weights:         ``dW_l = a_{l-1}^T @ dz_l``              (in, B) x (B, out)
* backward, inputs:          ``da_{l-1} = dz_l @ W_l^T``              (B, out) x (out, in)
  (for the first layer only its embedding rows: the dense inputs take no gradient)

The output layer (one logit) is a matrix-vector product and is left out: no BLAS runs it
near peak.  Each BLAS runs the step's products in sequence; the figure of a product is its
best (minimum) time over ``--rounds`` rounds of ``--reps`` calls, each round timing every
BLAS in turn (a shared machine's speed drifts; a bound is what the machine can do, and a
busy machine only slows a call down).  Printed per BLAS: GF/s of each part and of the
whole step, and **examples/s per core**: the batch over the step's GEMM time.  That is
what one core could do if forward/backward were nothing but these products: the bound
every training figure is read against (``bench/bench_vs_torch.py`` prints each run's share
of it).  Then the best BLAS runs in one process per core at once (``--together``): the
machine's bound is that sum, less than cores x one core's when the cores share a cache,
memory bandwidth or (on a VM) a physical core.

BLAS measured, when importable: NumPy's (``np.matmul(..., out=)``; OpenBLAS in the PyPI
wheel), SciPy's (``scipy.linalg.blas.sgemm``, its own OpenBLAS build, the one numba's
``np.dot`` calls) and PyTorch's (``torch.mm(..., out=)``, MKL for float32 on x86; one
thread: ``torch.set_num_threads(1)``).  PyTorch is not a dependency of mpips: run this
with a Python that has it (``pip install -e .[bench]`` in a separate venv) to see MKL.
"""
import argparse
import json
import os
import sys
import time

if __name__ == "__main__":
    for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_v] = "1"        # one thread, before any BLAS is loaded (run as a script:
                                    # bench_vs_torch.py runs it in a process of its own)

import numpy as np  # noqa: E402

PARTS = ("forward", "backward dW", "backward dX")


def gemms(batch, n_in, n_emb, hidden):
    """The step's products: [(part, (m, k), (k, n), a transposed, b transposed)].

    A transposed operand is stored as the transpose of its shape (a ``.T`` view), as the
    model's arrays are."""
    out, fan = [], n_in
    widths = [n_in] + list(hidden)
    for i, h in enumerate(hidden):
        out.append(("forward", (batch, fan), (fan, h), False, False))          # a @ W
        fan = h
    for i in range(len(hidden) - 1, -1, -1):
        fi, h = widths[i], widths[i + 1]
        out.append(("backward dW", (fi, batch), (batch, h), True, False))      # a^T @ dz
        rows = n_emb if i == 0 else fi                                         # W_0: emb rows
        if rows:
            out.append(("backward dX", (batch, h), (h, rows), False, True))    # dz @ W^T
    return out


def flops(spec):
    """Floating-point operations of each product (2 m k n)."""
    return [2 * a[0] * a[1] * b[1] for _, a, b, _, _ in spec]


def _operands(spec, rng):
    """Float32 operands laid out as the model holds them (transposed ones as .T views of
    C-contiguous arrays) and C-contiguous outputs."""
    ops = []
    for _, (m, k), (k2, n), ta, tb in spec:
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k2) if tb else (k2, n), dtype=np.float32)
        ops.append((a.T if ta else a, b.T if tb else b, np.empty((m, n), np.float32)))
    return ops


def numpy_calls(ops):
    return [lambda a=a, b=b, c=c: np.matmul(a, b, out=c) for a, b, c in ops]


def scipy_calls(ops):
    """sgemm on the row-major arrays: C = A B is C^T = B^T A^T in column-major terms, so
    each C-contiguous array is passed as the Fortran-ordered transpose it already is."""
    from scipy.linalg.blas import sgemm
    calls = []
    for a, b, c in ops:
        at, bt, ct = a.T, b.T, c.T            # ct: (n, m) Fortran-contiguous view of c
        # bt (n, k) and at (k, m) are F-contiguous unless the operand was a .T view, in
        # which case their transpose is: pass that with the trans flag instead
        b_arg, tb = (bt, 0) if bt.flags.f_contiguous else (b, 1)
        a_arg, ta = (at, 0) if at.flags.f_contiguous else (a, 1)
        calls.append(lambda a_=a_arg, b_=b_arg, ta=ta, tb=tb, ct=ct:
                     sgemm(1.0, b_, a_, c=ct, trans_a=tb, trans_b=ta, overwrite_c=1))
    return calls


def torch_calls(ops):
    import torch
    torch.set_num_threads(1)
    calls = []
    for a, b, c in ops:
        ta = torch.from_numpy(a.T).t() if not a.flags.c_contiguous else torch.from_numpy(a)
        tb = torch.from_numpy(b.T).t() if not b.flags.c_contiguous else torch.from_numpy(b)
        tc = torch.from_numpy(c)
        calls.append(lambda ta=ta, tb=tb, tc=tc: torch.mm(ta, tb, out=tc))
    return calls


def torch_name():
    import torch
    cfg = torch.__config__.show()
    blas = "MKL" if "BLAS_INFO=mkl" in cfg else "its BLAS"
    return f"torch {torch.__version__.split('+')[0]} ({blas})"


def numpy_name():
    try:
        from threadpoolctl import threadpool_info
        for lib in threadpool_info():
            if lib.get("user_api") == "blas" and "numpy" in lib.get("filepath", ""):
                return f"numpy {np.__version__} ({lib['internal_api']} " \
                       f"{lib.get('version')}, {lib.get('architecture')})"
    except ImportError:
        pass
    return f"numpy {np.__version__}"


def scipy_name():
    import scipy
    return f"scipy {scipy.__version__} (OpenBLAS)"


# name -> (importable check, label, calls factory)
BACKENDS = {"numpy": ("numpy", numpy_name, numpy_calls),
            "scipy": ("scipy.linalg.blas", scipy_name, scipy_calls),
            "torch": ("torch", torch_name, torch_calls)}


def available(names=None):
    """The BLAS of BACKENDS that import here (in order)."""
    import importlib
    out = []
    for name in names or BACKENDS:
        try:
            importlib.import_module(BACKENDS[name][0])
        except ImportError:
            continue
        out.append(name)
    return out


def _best(call, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def time_calls(calls, reps, rounds):
    """Each product's best seconds over ``rounds`` x ``reps`` calls (a bound: what the
    machine can do; a busy machine only slows a call down)."""
    return time_sets([calls], reps, rounds)[0]


def time_sets(sets, reps, rounds):
    """:func:`time_calls` of several lists of calls (one per BLAS), interleaved: each round
    times every list in turn, so a drift of a shared machine's speed hits them alike."""
    for calls in sets:
        for c in calls:                   # warm up (first call allocates, pages in)
            c()
            c()
    best = [[float("inf")] * len(calls) for calls in sets]
    for _ in range(rounds):
        for k, calls in enumerate(sets):
            for i, c in enumerate(calls):
                best[k][i] = min(best[k][i], _best(c, reps))
    return best


def measure(batch=512, n_in=273, n_emb=260, hidden=(400, 400, 400), reps=30, rounds=3,
            names=None, seed=0):
    """{blas name: record} with each part's seconds and GF/s, the step's GEMM seconds and
    the examples/s per core they allow (``ex_per_s_core``); ``best`` names the fastest."""
    spec = gemms(batch, n_in, n_emb, hidden)
    fl = flops(spec)
    ops = _operands(spec, np.random.default_rng(seed))
    ref = [a @ b for a, b, _ in ops]
    out = {}
    todo = []
    for name in available(names):
        calls = BACKENDS[name][2](ops)
        for c, (_, _, cbuf), r in zip(calls, ops, ref):     # same products, same answers
            cbuf[:] = np.nan
            c()
            if not np.allclose(cbuf, r, rtol=1e-3, atol=1e-3 * float(np.abs(r).max())):
                raise SystemExit(f"{name}: a product differs from numpy's; not timing it")
        todo.append((name, calls))
    timed = time_sets([calls for _, calls in todo], reps, rounds)
    for (name, _), secs in zip(todo, timed):
        rec = {"blas": BACKENDS[name][1](), "parts": {}}
        for part in PARTS:
            idx = [i for i, s in enumerate(spec) if s[0] == part]
            s = sum(secs[i] for i in idx)
            f = sum(fl[i] for i in idx)
            rec["parts"][part] = {"seconds": s, "gflops": f / s / 1e9 if s else 0.0}
        total = sum(secs)
        rec.update(seconds=total, gflops=sum(fl) / total / 1e9, ex_per_s_core=batch / total)
        out[name] = rec
    if out:
        out_best = max(out, key=lambda k: out[k]["ex_per_s_core"])
        return {"batch": batch, "shape": [n_in, n_emb, list(hidden)],
                "load_average": os.getloadavg()[0], "cpus": os.cpu_count() or 1,
                "flops_per_example": sum(fl) / batch, "blas": out, "best": out_best}
    raise SystemExit("no BLAS to time (numpy is not importable?)")


def _together_child(name, spec, reps, rounds, barrier, queue):
    ops = _operands(spec, np.random.default_rng(1))
    calls = BACKENDS[name][2](ops)
    for c in calls:
        c()
    barrier.wait()
    queue.put(sum(time_calls(calls, reps, rounds)))


def together(bound, procs, reps=30, rounds=3):
    """The best BLAS's step in ``procs`` single-thread processes at once (started together):
    what the cores give when all compute, cache, memory and a host's sharing of the cores
    included.  Adds ``together`` to ``bound``: procs, examples/s summed, and per process."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    n_in, n_emb, hidden = bound["shape"]
    spec = gemms(bound["batch"], n_in, n_emb, hidden)
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    kids = [ctx.Process(target=_together_child, args=(bound["best"], spec, reps, rounds,
                                                      barrier, queue)) for _ in range(procs)]
    for k in kids:
        k.start()
    secs = [queue.get(timeout=600) for _ in kids]
    for k in kids:
        k.join()
    total = sum(bound["batch"] / s for s in secs)
    bound["together"] = {"procs": procs, "ex_per_s": total, "ex_per_s_core": total / procs}
    return bound


def per_core(bound, cores=1):
    """Examples/s per core of a :func:`measure` result: the best BLAS alone, or with
    ``cores`` > 1 and a :func:`together` figure, what each core gave when all ran."""
    t = bound.get("together")
    if cores > 1 and t:
        return t["ex_per_s_core"]
    return bound["blas"][bound["best"]]["ex_per_s_core"]


def report(bound):
    lines = [f"GEMM bound, one thread: batch {bound['batch']}, inputs {bound['shape'][0]} "
             f"({bound['shape'][1]} embedding), hidden {','.join(map(str, bound['shape'][2]))}; "
             f"{bound['flops_per_example'] / 1e6:.2f} MFLOP per example "
             f"(forward + both backward products)",
             f"{'BLAS':44s} " + " ".join(f"{p + ' GF/s':>16s}" for p in PARTS) +
             f" {'step GF/s':>10s} {'step ms':>8s} {'ex/s/core':>10s}"]
    for name, r in bound["blas"].items():
        mark = " *" if name == bound["best"] else ""
        lines.append(f"{r['blas'][:44]:44s} " +
                     " ".join(f"{r['parts'][p]['gflops']:>16.1f}" for p in PARTS) +
                     f" {r['gflops']:>10.1f} {r['seconds'] * 1e3:>8.3f} "
                     f"{r['ex_per_s_core']:>10.0f}{mark}")
    ncpu = bound["cpus"]
    lines.append(f"* best: {per_core(bound):.0f} ex/s per core; x {ncpu} cores = "
                 f"{per_core(bound) * ncpu:.0f} ex/s for this machine "
                 f"(load average {bound['load_average']:.2f} after measuring)")
    t = bound.get("together")
    if t:
        lines.append(f"  {t['procs']} processes at once ({bound['best']}): "
                     f"{t['ex_per_s']:.0f} ex/s in all, {t['ex_per_s_core']:.0f} per core "
                     f"({t['ex_per_s_core'] / per_core(bound):.0%} of one alone)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--n-sparse", type=int, default=26)
    ap.add_argument("--dim", type=int, default=10)
    ap.add_argument("--n-dense", type=int, default=13)
    ap.add_argument("--fc", default="400,400,400")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per round (min)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each BLAS in turn; the best over all)")
    ap.add_argument("--blas", default="", help="comma-separated subset of "
                    f"{','.join(BACKENDS)} (default: every one that imports)")
    ap.add_argument("--together", type=int, default=-1, help="then run the best BLAS in "
                    "this many processes at once (default: one per core; 0: skip)")
    ap.add_argument("--json", default="", help="write the result to this file")
    a = ap.parse_args(argv)
    hidden = tuple(int(x) for x in a.fc.split(","))
    names = [n for n in a.blas.split(",") if n] or None
    if names and set(names) - set(BACKENDS):
        ap.error(f"--blas: unknown {sorted(set(names) - set(BACKENDS))}")
    n_emb = a.n_sparse * a.dim
    bound = measure(a.batch, n_emb + a.n_dense, n_emb, hidden, a.reps, a.rounds, names)
    procs = bound["cpus"] if a.together < 0 else a.together
    if procs > 1:
        together(bound, procs, a.reps, a.rounds)
    print(report(bound))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(bound, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
