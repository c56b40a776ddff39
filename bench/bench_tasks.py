"""Several labels (issue 47 part A): the bars, on a two-label set from data_prep.two_labels.

    python bench/bench_tasks.py --out /tmp/tasks --rows 200000 --test-rows 50000

Runs, one epoch each, Adam (--lr), batch --batch-size, --fc, all on the same files:
  * dnn on click alone and on purchase alone (the single-task baselines; the CSV's other
    label column is skipped);
  * shared_bottom, mmoe and esmm with label = [click, purchase], --local;
  * the same three 2x2 async (mpiexec -n 4: 2 servers, 2 workers);
  * (--torch) bench/torch_ref.py on the same network, one process, 2 threads
    (OMP_WAIT_POLICY=PASSIVE, its default table hash % 1000001 and SparseAdam, as
    docs/studies/networks.md ran it).
Prints one line a run and the bars: each task's AUC against its single-task run (within
0.002), esmm's pCTCVR AUC against the purchase-only run, 2x2 async against --local (within
0.003) per task, and mpips 2x2 async examples/s over the PyTorch reference's.  The oracle
AUCs of the set (true probabilities) are printed with them.
"""
import argparse
import json
import os
import subprocess
import sys
import time

from common import ENV, ROOT, mpiexec

MULTI = ("shared_bottom", "mmoe", "esmm")


REUSE = []    # --reuse: a run whose metrics file exists is not run again


def run(cmd, out, env=None):
    """Run ``cmd``; return its last metrics record (``out``) and the wall seconds."""
    if REUSE and os.path.exists(out):
        with open(out) as f:
            return [json.loads(x) for x in f][-1], 0.0
    if os.path.exists(out):
        os.remove(out)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT),
                          env=dict(os.environ, **{**ENV, **(env or {})}))
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    with open(out) as f:
        return [json.loads(x) for x in f][-1], time.perf_counter() - t0


def single_schema(src, label, dst):
    text = open(src).read().replace('label = ["click", "purchase"]', f'label = "{label}"')
    with open(dst, "w") as f:
        f.write(text)
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=200000)
    ap.add_argument("--test-rows", type=int, default=50000)
    ap.add_argument("--fc", default="128,64")
    ap.add_argument("--lr", default="0.001")
    ap.add_argument("--batch-size", default="512")
    ap.add_argument("--models", default=",".join(MULTI))
    ap.add_argument("--no-async", action="store_true")
    ap.add_argument("--torch", action="store_true", help="also bench/torch_ref.py per model")
    ap.add_argument("--reuse", action="store_true", help="keep the records of runs done before")
    a = ap.parse_args(argv)
    REUSE[:] = [True] if a.reuse else []
    d = a.out
    if not os.path.exists(os.path.join(d, "oracle.json")):
        subprocess.run([sys.executable, "-m", "data_prep.two_labels", "--out", d, "--rows",
                        str(a.rows), "--test-rows", str(a.test_rows)], check=True,
                       cwd=str(ROOT), env=dict(os.environ, **ENV))
    oracle = json.load(open(os.path.join(d, "oracle.json")))["test"]
    print(f"oracle test AUC: click {oracle['click']:.4f} purchase {oracle['purchase']:.4f} "
          f"cvr on clicked {oracle['cvr_clicked']:.4f}", flush=True)
    schema = os.path.join(d, "schema.toml")
    base = ["--train", os.path.join(d, "train.csv"), "--test", os.path.join(d, "test.csv"),
            "--epochs", "1", "--lr", a.lr, "--batch-size", a.batch_size, "--fc", a.fc,
            "--print-every", "1000000", "--progress-every", "0"]
    res = {}
    for label in ("click", "purchase"):
        s = single_schema(schema, label, os.path.join(d, f"schema_{label}.toml"))
        out = os.path.join(d, f"dnn_{label}.jsonl")
        rec, sec = run([sys.executable, "-m", "mpips.train", "--local", "--model", "dnn",
                        "--schema", s, "--metrics-out", out] + base, out)
        res[f"dnn_{label}"] = rec
        print(f"dnn on {label}: test AUC {rec['test_auc']:.4f} ({rec['examples_per_sec']:.0f} "
              f"ex/s, {sec:.0f} s)", flush=True)
    models = [m for m in a.models.split(",") if m]
    for model in models:
        kinds = [("local", ["--local"])] + ([] if a.no_async else [("async", ["--mode", "async"])])
        for kind, flags in kinds:
            out = os.path.join(d, f"{model}_{kind}.jsonl")
            cmd = [sys.executable, "-m", "mpips.train", "--model", model, "--schema", schema,
                   "--metrics-out", out] + flags + base
            if kind == "async":
                cmd = [mpiexec(), "-n", "4"] + cmd
            rec, sec = run(cmd, out)
            res[f"{model}_{kind}"] = rec
            t = rec["tasks"]
            extra = (f" cvr-on-clicked {t['purchase']['test_cvr_auc_clicked']:.4f}"
                     if model == "esmm" else "")
            print(f"{model} {kind}: click {t['click']['test_auc']:.4f} purchase "
                  f"{t['purchase']['test_auc']:.4f}{extra} ({rec['examples_per_sec']:.0f} "
                  f"ex/s, {sec:.0f} s)", flush=True)
        if a.torch:
            out = os.path.join(d, f"{model}_torch.jsonl")
            rec, sec = run([sys.executable, "bench/torch_ref.py", "--model", model, "--schema",
                            schema, "--train", os.path.join(d, "train.csv"), "--test",
                            os.path.join(d, "test.csv"), "--lr", a.lr,
                            "--batch-size", a.batch_size, "--fc", a.fc,
                            "--metrics-out", out, "--print-every", "0"], out,
                           env={"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"})
            res[f"{model}_torch"] = rec
            t = rec["tasks"]
            print(f"{model} torch: click {t['click']['test_auc']:.4f} purchase "
                  f"{t['purchase']['test_auc']:.4f} ({rec['examples_per_sec']:.0f} ex/s)",
                  flush=True)
    print("bars:")
    single = {n: res[f"dnn_{n}"]["test_auc"] for n in ("click", "purchase")}
    for model in models:
        t = res[f"{model}_local"]["tasks"]
        for n in ("click", "purchase"):
            if model == "esmm" and n == "click":
                continue
            d_auc = t[n]["test_auc"] - single[n]
            print(f"  {model} {n} - dnn on {n}: {d_auc:+.4f} (bar >= -0.002: "
                  f"{'met' if d_auc >= -0.002 else 'NOT met'})")
        if not a.no_async:
            ta = res[f"{model}_async"]["tasks"]
            for n in ("click", "purchase"):
                d_auc = ta[n]["test_auc"] - t[n]["test_auc"]
                print(f"  {model} 2x2 async - local, {n}: {d_auc:+.4f} (bar |d| <= 0.003: "
                      f"{'met' if abs(d_auc) <= 0.003 else 'NOT met'})")
        if a.torch and not a.no_async:
            r = res[f"{model}_async"]["examples_per_sec"] / res[f"{model}_torch"]["examples_per_sec"]
            print(f"  {model} speed 2x2 async / torch: {r:.2f}x (bar >= 1.5x: "
                  f"{'met' if r >= 1.5 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
