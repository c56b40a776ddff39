"""The gradient noise scale along one process's epoch, and what it predicts for W workers.

    python bench/noise_scale.py --data DATA [--probes 64] [--every 100] [--json F]
    python bench/noise_scale.py --predict F --batches 512,4096,8192,16384,32768

Why (docs/studies/scaling-with-w.md): on one epoch of 1M rows, 8 to 64 workers of batch
512 lose to one process of batch 512, sync as much as async, and one process with the
global batch as much as sync. McCandlish et al., "An empirical model of large-batch
training" (2018), say when that must happen whatever the learning-rate rule: a step with a
batch of B examples does the work of B / (1 + B / B_noise) examples taken one at a time,
where B_noise = tr(Sigma) / |G|^2 (Sigma the covariance of one example's gradient, G the
mean gradient). Below B_noise a larger batch wastes nothing; above it, the examples beyond
B_noise in each batch add little.

The run: ``--local`` (batch 512, the train defaults, extra flags after ``--``). Every
``--every`` steps (and after the first), with the weights held, it takes the gradient of
the mean loss on each of ``--probes`` batches of 512 of the test set (ids without a row
read zeros, as in evaluation) and estimates, with the unbiased pair of McCandlish et al.'s
appendix A (small batch b = 512, big batch B = probes x 512):

    |G|^2     = (B |G_B|^2 - b mean|G_b|^2) / (B - b)
    tr(Sigma) = (mean|G_b|^2 - |G_B|^2) / (1/b - 1/B)

for the dense weights, the embedding rows, and both; ``dense_adam`` weighs each dense
coordinate by Adam's 1 / (sqrt(v_hat) + eps) (the preconditioned B_simple). It also scores
the test set there (AUC, logloss), so the record holds one process's test curve against the
examples it has trained on.

``--predict F`` integrates the model: with B_noise(i) the measured scale after one process
has made ``i`` examples' worth of progress, a run of batch B advances
di/dx = 1 / (1 + B / B_noise(i)) per example x (one process at b = 512 likewise), so after
the epoch a run of global batch B has made the progress one process makes on some fraction
f of the epoch; the predicted test AUC is one process's at that fraction (interpolated on
its curve). That is the best any learning-rate rule can do at that batch, in the model.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (the repo root on sys.path)

from mpips.job.build import make_reader  # noqa: E402
from mpips.job.plan import make_plan  # noqa: E402
from mpips.config import parse_args  # noqa: E402
from mpips.kernels.embedding import sum_duplicates  # noqa: E402
from mpips.job.report import log_line  # noqa: E402
from mpips.train import local_backend  # noqa: E402
from mpips.worker.dense_sync import noise_pair  # noqa: E402


def estimate(small_sq, big_sq, b, B):
    """(|G|^2, tr(Sigma), B_noise) from mean |G_b|^2 and |G_B|^2 (B = k b): the pair a
    training job's DenseStep sums (``noise_pair``), and their ratio."""
    g2, tr = noise_pair(small_sq, big_sq, b, B)
    return g2, tr, (tr / g2 if g2 > 0 else float("inf"))


def probe(trainer, preps, b):
    """Gradients of the mean loss on each prepared batch at the current weights (no
    update, no row made); returns {group: [|G|^2, tr(Sigma), B_noise]}."""
    dense = trainer.replica
    st = dense._state
    precond = None
    if "v" in st and float(st["beta2_pow"].reshape(-1)[0]) < dense.opt.beta2:   # a step taken
        vhat = st["v"].reshape(-1) / (1.0 - float(st["beta2_pow"].reshape(-1)[0]))
        precond = 1.0 / (np.sqrt(vhat.astype(np.float64)) + dense.opt.epsilon)
    k = len(preps)
    dsum = np.zeros(trainer.model.n_params, np.float64)
    sq = {"dense": 0.0, "sparse": 0.0, "dense_adam": 0.0}
    keys, grads = [], []
    for p in preps:
        trainer.ps.pull(p.plan, p.rows, None, create=False)
        _, _, g = trainer._step_math(p, trainer.params[0])
        gd = trainer.grad_dense.astype(np.float64)
        dsum += gd
        sq["dense"] += float(gd @ gd)
        if precond is not None:
            sq["dense_adam"] += float(gd @ (gd * precond))
        sq["sparse"] += float(np.sum(g.astype(np.float64) ** 2))
        keys.append(p.plan.keys)
        grads.append(g)
    _, gs = sum_duplicates(np.concatenate(keys), np.concatenate(grads))
    dmean = dsum / k
    big = {"dense": float(dmean @ dmean),
           "sparse": float(np.sum((gs.astype(np.float64) / k) ** 2)),
           "dense_adam": float(dmean @ (dmean * precond)) if precond is not None else 0.0}
    B = k * b
    out = {}
    for name in ("dense", "sparse", "dense_adam"):
        if name == "dense_adam" and precond is None:
            continue
        out[name] = estimate(sq[name] / k, big[name], b, B)
    out["all"] = estimate((sq["dense"] + sq["sparse"]) / k, big["dense"] + big["sparse"], b, B)
    return out


def run(args, extra):
    cfg = parse_args(["--local", "--train", f"{args.data}/train", "--test", f"{args.data}/test",
                      "--progress-every", "0", "--print-every", "100000"] + extra)
    if cfg.mode == "geo" or cfg.local_workers > 1 or cfg.simulate_workers:
        raise SystemExit("noise_scale: one process of one batch a step only (the run the "
                         "estimates are taken along)")
    plan = make_plan(cfg).with_data()
    test_files = plan.test_files
    backend = local_backend(plan)             # what --local trains with
    trainer = backend.trainer
    reader = make_reader(cfg, test_files, cfg.batch_size, log_line)
    preps = []
    for batch in reader:
        preps.append(trainer._prepare(batch))
        if len(preps) == args.probes:
            break
    reader.close()
    records = []

    def point(done):
        t0 = time.perf_counter()
        est = probe(trainer, preps, cfg.batch_size)
        m = backend.evaluate(test_files)
        rec = {"step": done, "examples": done * cfg.batch_size, "test_auc": m.auc(),
               "test_logloss": m.logloss(), "test_mean_pred": m.mean_pred()}
        for name, (g2, tr, bn) in est.items():
            rec[f"{name}_g2"], rec[f"{name}_tr"], rec[f"{name}_bnoise"] = g2, tr, bn
        records.append(rec)
        print(f"step {done:5d}  auc {rec['test_auc']:.4f}  logloss {rec['test_logloss']:.4f}  "
              + "  ".join(f"B_noise[{n}] {v[2]:9.0f}" for n, v in est.items())
              + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)

    def hook(done, _phase):   # steps 1, 2, 4, ... (the early steps change fastest), then --every
        if (done < args.every and done & (done - 1) == 0) or done % args.every == 0:
            point(done)

    point(0)
    trainer.on_step = hook
    st = backend.train(plan.train_files, 0)
    if records[-1]["step"] != st.steps:
        point(st.steps)
    out = {"data": str(args.data), "flags": extra, "batch": cfg.batch_size,
           "probes": args.probes, "records": records}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return out


def predict(run_, batches, group="all"):
    """For each global batch B: the fraction of the epoch at which one process (batch b)
    has made the progress a run of batch B makes in the whole epoch, and one process's test
    AUC and logloss there (linear on its curve).  Where the interpolated |G|^2 is <= 0
    (noise larger than the signal) B_noise counts as 1e9 (no cost at any batch)."""
    recs = [r for r in run_["records"] if f"{group}_g2" in r]   # dense_adam: from step 1
    b = run_["batch"]
    x = np.array([r["examples"] for r in recs], np.float64)
    # |G|^2 and tr(Sigma) interpolated apart, their ratio taken after (McCandlish et al.)
    g2 = np.array([r[f"{group}_g2"] for r in recs], np.float64)
    tr = np.array([r[f"{group}_tr"] for r in recs], np.float64)
    auc = np.array([r["test_auc"] for r in recs])
    ll = np.array([r["test_logloss"] for r in recs])
    n = x[-1]
    xs = np.linspace(0.0, n, 20001)
    dx = xs[1] - xs[0]
    # one process's progress i(x) and B_noise as a function of i (measured along its run)
    g2x, trx = np.interp(xs, x, g2), np.interp(xs, x, tr)
    bn_of_x = np.where(g2x > 0, trx / np.maximum(g2x, 1e-300), 1e9).clip(1.0, 1e9)
    i_ref = np.concatenate([[0.0], np.cumsum(dx / (1.0 + b / bn_of_x[:-1]))])
    out = []
    for B in batches:
        i = 0.0
        for _ in range(len(xs) - 1):          # B_noise where one process had progress i
            i += dx / (1.0 + B / np.interp(i, i_ref, bn_of_x))
        frac = float(np.interp(i, i_ref, xs) / n)
        out.append({"batch": B, "fraction": frac,
                    "auc": float(np.interp(frac * n, x, auc)) - float(auc[-1]),
                    "logloss": float(np.interp(frac * n, x, ll)) - float(ll[-1])})
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        k = argv.index("--")
        argv, extra = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="a criteo_like directory (train/, test/)")
    ap.add_argument("--probes", type=int, default=64,
                    help="test batches (of --batch-size, 512 by default) per estimate")
    ap.add_argument("--every", type=int, default=100, help="steps between estimates")
    ap.add_argument("--json", default="", help="write the records here")
    ap.add_argument("--predict", default="", help="a --json file: predict, do not train")
    ap.add_argument("--batches", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--group", default="all", choices=("all", "dense", "sparse", "dense_adam"))
    args = ap.parse_args(argv)
    if args.data is None and not args.predict:
        ap.error("--data or --predict")
    run_ = json.loads(Path(args.predict).read_text()) if args.predict else run(args, extra)
    later = [r for r in run_["records"] if r["step"] >= 64]
    print("median B_noise from step 64 on: " + ", ".join(
        f"{g} {np.median([r[f'{g}_bnoise'] for r in later]):.0f}"
        for g in ("dense", "dense_adam", "sparse", "all")) + f" ({len(later)} estimates)")
    print(f"prediction from B_noise[{args.group}]: a run of global batch B over the epoch "
          f"makes the progress one process (batch {run_['batch']}) makes on a fraction of it")
    for p in predict(run_, [int(s) for s in args.batches.split(",")], args.group):
        print(f"  B {p['batch']:6d}: fraction {p['fraction']:.3f}  AUC {p['auc']:+.4f}  "
              f"logloss {p['logloss']:+.4f}")


if __name__ == "__main__":
    main()
