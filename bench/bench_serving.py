"""Serving benchmark: bundle size and load time against the checkpoint, predictor rows/s on
one core, the AUC cost of float16, and `mpips.infer` rows/s at N = 1, 2, 4 ranks.

    python bench/bench_serving.py                         # 2M-row table; 100k-row trained model
    python bench/bench_serving.py --rows 500000 --rounds 2 --skip-infer

1. Size and load.  A table of --rows ids (lazy Adam, every row pushed once, as in
   bench_checkpoint.py) and the 400x3 CTR-DNN, saved as a one-shard full checkpoint and
   exported as float32 and float16 bundles.  Loads, alternated and repeated --rounds
   times (median): the checkpoint into a training table (``load_local``, all optimizer
   state, what the old ``mpips.infer`` did), the checkpoint's serving values into a
   ``ServingModel`` (``bundle.Snapshot``: what ``mpips.infer`` does now, once per node),
   and each bundle into a ``Predictor``.  Then ``mpirun -n 4 python -m mpips.infer`` on
   this checkpoint: load time and memory with the table shared per node and per rank.
   Files stay in the page cache: CPU cost, not disk.
2. Accuracy and speed.  A model trained one epoch (--local) on the synthetic set
   (--train-rows), exported float32 and float16; the test set is scored from raw lines by
   both predictors (AUC, largest prediction difference); ``predict_lines`` and
   ``predict_arrays`` rows/s on one core (OMP/NUMBA/OPENBLAS threads = 1), batches of
   --batch lines.
3. Scaling.  ``mpirun -n N python -m mpips.infer`` on the same model and test set (8
   files), N = 1, 2, 4 (and 4 with --table-per-rank) alternated, --rounds rounds; scoring
   rows/s (max over ranks of the scoring time, load excluded), rows per CPU-second of
   scoring (summed over ranks: the work, whatever share of the cores the ranks got),
   wall-clock seconds of the whole command, load seconds, and memory (sum over ranks of
   the proportional set size).
Timings on a shared 2-core VM are noisy: read the ratios within one run.
"""
import os

for _v in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")                   # one core (before numpy starts BLAS)

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import build, dir_bytes  # noqa: E402
from common import ENV, ROOT, mpiexec  # noqa: E402

from mpips.serving import bundle as bd  # noqa: E402
from mpips import checkpoint as ck  # noqa: E402
from mpips.data.files import resolve_paths  # noqa: E402
from mpips.metrics import BinaryMetrics  # noqa: E402
from mpips.tables.dense import DenseTable  # noqa: E402
from mpips.tables.sparse import SparseTable  # noqa: E402
from mpips.serving.model import ServingModel  # noqa: E402
from mpips.serving import Predictor, parse_lines  # noqa: E402


def timed(fn, clock=time.perf_counter):
    t0 = clock()
    fn()
    return clock() - t0


def median_times(fns, rounds, clock=time.perf_counter):
    """{name: median seconds} of the callables, run alternately ``rounds`` times."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(timed(fn, clock))
    return {k: float(np.median(v)) for k, v in times.items()}


def infer_run(path, data, n, extra, tmp, key):
    """(record, wall seconds) of one `mpirun -n n python -m mpips.infer` run."""
    out = os.path.join(tmp, "infer.json")
    pred = os.path.join(tmp, f"p{key.replace(' ', '')}.txt")
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpips.infer", "--checkpoint", path,
           "--data", data, "--metrics-out", out, "--predictions-out", pred] + extra
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, **ENV), cwd=str(ROOT),
                   stdout=subprocess.DEVNULL)
    return json.loads(open(out).read()), time.perf_counter() - t0


def size_and_load(args, tmp, data):
    sparse, dense, _, opt = build(args.rows, 10, 0)
    root = os.path.join(tmp, "ck")
    path = ck.save_local(root, sparse, dense, "full", config={"fc": "400,400,400"})
    del sparse
    b32, b16 = os.path.join(tmp, "b32.h5"), os.path.join(tmp, "b16.h5")
    t32 = timed(lambda: bd.export_full(path, b32))
    t16 = timed(lambda: bd.export_full(path, b16, "float16"))

    def load_ckpt():
        s = SparseTable(10, opt, 0, capacity=args.rows)
        ck.load_local(path, s, DenseTable(np.zeros(len(dense), np.float32), opt))

    t = median_times({"ckpt": load_ckpt, "snap": lambda: ServingModel.from_snapshot(bd.Snapshot(path)),
                      "b32": lambda: Predictor(b32), "b16": lambda: Predictor(b16)}, args.rounds)
    size = {"ckpt": dir_bytes(path), "snap": dir_bytes(path), "b32": os.path.getsize(b32),
            "b16": os.path.getsize(b16)}
    print(f"\n1. {args.rows:,} rows, dim 10, Adam; export {t32:.2f} s (float32), {t16:.2f} s "
          f"(float16); median of {args.rounds} alternated loads")
    print(f"{'what':<44} {'MB':>8} {'x ckpt':>7} {'load s':>8} {'x ckpt':>7}")
    names = {"ckpt": "checkpoint -> training table (load_local)",
             "snap": "checkpoint -> ServingModel (infer)",
             "b32": "bundle float32 -> Predictor", "b16": "bundle float16 -> Predictor"}
    for k, label in names.items():
        print(f"{label:<44} {size[k] / 1e6:>8.1f} {size[k] / size['ckpt']:>7.2f} "
              f"{t[k]:>8.2f} {t[k] / t['ckpt']:>7.2f}")
    one_file = resolve_paths(f"{data}/test")[:4]
    print(f"mpirun -n 4 python -m mpips.infer on this checkpoint ({len(one_file)} small files), "
          f"median of {args.rounds}:")
    for key, extra in (("shared", []), ("per-rank", ["--table-per-rank"])):
        rs = [infer_run(path, ",".join(one_file), 4, extra, tmp, key)[0]
              for _ in range(args.rounds)]
        print(f"  table {key:<9} load {np.median([r['load_seconds'] for r in rs]):6.2f} s  "
              f"memory {np.median([r['memory_mb'] for r in rs]):7.0f} MB (sum of PSS, 4 ranks)")


def make_data(args, tmp):
    from data_prep.synth import generate
    data = os.path.join(tmp, "data")
    generate(data, rows=args.train_rows, parts=8, seed=1, test_rows=args.test_rows)
    return data


def train_model(args, tmp, data):
    cmd = [sys.executable, "-m", "mpips.train", "--local", "--train", f"{data}/train",
           "--test", f"{data}/test", "--save-dir", f"{tmp}/model", "--print-every", "100000"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, **ENV), cwd=str(ROOT),
                   stdout=subprocess.DEVNULL)
    print(f"\n2. model: 1 epoch on {args.train_rows:,} synthetic rows ({time.perf_counter() - t0:.0f}"
          f" s), test set {args.test_rows:,} rows")


def lines_of(test_dir):
    out = []
    for f in resolve_paths(test_dir):
        out += open(f, "rb").read().splitlines()
    return out


def accuracy_and_speed(args, tmp, data):
    path = ck.latest(f"{tmp}/model")
    b32, b16 = os.path.join(tmp, "m32.h5"), os.path.join(tmp, "m16.h5")
    bd.export_full(path, b32)
    bd.export_full(path, b16, "float16")
    p32, p16 = Predictor(b32), Predictor(b16)
    lines = lines_of(f"{data}/test")
    labels = np.array([float(x[:1]) for x in lines], np.float32)
    res = {}
    for name, p in (("float32", p32), ("float16", p16)):
        probs = np.concatenate([p.predict_lines(lines[i:i + args.batch])
                                for i in range(0, len(lines), args.batch)])
        m = BinaryMetrics()
        m.update(probs, labels)
        res[name] = (m.auc(), m.logloss(), probs)
    d_auc = res["float16"][0] - res["float32"][0]
    print(f"AUC float32 {res['float32'][0]:.6f}  float16 {res['float16'][0]:.6f}  difference "
          f"{d_auc:+.2e}; logloss difference {res['float16'][1] - res['float32'][1]:+.2e}; "
          f"largest |p16 - p32| {np.abs(res['float16'][2] - res['float32'][2]).max():.2e}")
    batches = [lines[i:i + args.batch] for i in range(0, len(lines), args.batch)]
    parsed = [parse_lines(b, p32.model.data)[:2] for b in batches]
    fns = {"lines": lambda: [p32.predict_lines(b) for b in batches],
           "arrays": lambda: [p32.predict_arrays(d, i) for d, i in parsed]}
    n = len(lines)
    for clock, what in ((time.perf_counter, "rows/s"), (time.process_time, "rows/CPU-s")):
        t = median_times(fns, args.rounds, clock)
        print(f"predictor, one thread, batches of {args.batch}: predict_lines "
              f"{n / t['lines']:,.0f} {what}, predict_arrays {n / t['arrays']:,.0f} {what} "
              f"(parsing is {100 * (1 - t['arrays'] / t['lines']):.0f}% of predict_lines)")


def scaling(args, tmp, data):
    path = ck.latest(f"{tmp}/model")
    runs = {"1": (1, []), "2": (2, []), "4": (4, []), "4 per-rank": (4, ["--table-per-rank"])}
    recs = {k: [] for k in runs}
    for _ in range(args.rounds):
        for key, (n, extra) in runs.items():
            rec, wall = infer_run(path, f"{data}/test", n, extra, tmp, key)
            recs[key].append((rec["examples_per_sec"], wall, rec["load_seconds"], rec["memory_mb"],
                              rec["test_examples"] / rec["cpu_seconds"], rec["test_auc"]))
    same = len({open(os.path.join(tmp, f"p{k.replace(' ', '')}.txt"), "rb").read()
                for k in runs}) == 1
    print(f"\n3. mpirun -n N python -m mpips.infer, {args.test_rows:,} rows in 8 files, median of "
          f"{args.rounds}; predictions files identical for all N: {same}")
    print(f"{'N':>12} {'scoring rows/s':>15} {'x N=1':>6} {'rows/CPU-s':>11} {'x N=1':>6} "
          f"{'wall s':>7} {'load s':>7} {'memory MB':>10} {'AUC':>10}")
    base = [np.median([r[i] for r in recs["1"]]) for i in range(5)]
    for key, rs in recs.items():
        med = [np.median([r[i] for r in rs]) for i in range(5)]
        print(f"{key:>12} {med[0]:>15,.0f} {med[0] / base[0]:>6.2f} {med[4]:>11,.0f} "
              f"{med[4] / base[4]:>6.2f} {med[1]:>7.2f} {med[2]:>7.2f} {med[3]:>10.0f} "
              f"{rs[-1][5]:>10.6f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="table rows for part 1")
    p.add_argument("--train-rows", type=int, default=100_000)
    p.add_argument("--test-rows", type=int, default=80_000)
    p.add_argument("--batch", type=int, default=4096, help="lines per predictor call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-infer", action="store_true", help="skip part 3 (mpirun)")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="mpips-bench-serving-")
    try:
        data = make_data(args, tmp)
        size_and_load(args, tmp, data)
        train_model(args, tmp, data)
        accuracy_and_speed(args, tmp, data)
        if not args.skip_infer:
            scaling(args, tmp, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
