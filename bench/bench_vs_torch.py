"""mpips against the PyTorch reference (bench/torch_ref.py), alternating, on a Criteo-like set.

    python bench/bench_vs_torch.py                              # 1M/200k, x0.05, 2 rounds
    python bench/bench_vs_torch.py --rounds 3 --runs torch,local,async,sync
    python bench/bench_vs_torch.py --gen "--interactions 0.45 --signal 1.4" --runs torch,local,async
    python bench/bench_vs_torch.py --data DIR                   # any DIR/train + DIR/test
    python bench/bench_vs_torch.py --model deepfm               # Wide&Deep / DeepFM, both sides
    python bench/bench_vs_torch.py --model dcn_v2,dlrm --runs torch,local,async   # DCN-v2, DLRM
    python bench/bench_vs_torch.py --model dnn,wide_deep,deepfm --runs torch,local,async
                                                                # each, then one table of all
    python bench/bench_vs_torch.py --seeds 0,1,2,3             # a round per init seed: AUC
                                                                # mean and sd over seeds
    python bench/bench_vs_torch.py --run "async-hb=--mode async --hash-bucket 1000001"
    python bench/bench_vs_torch.py --shape wide --runs torch,local,async   # multi-hot, 300 slots
    python bench/bench_vs_torch.py --data DIR --schema DIR/schema.toml     # any data + schema

Data: ``data_prep.criteo_like`` (Criteo Kaggle cardinalities x ``--card-scale``), generated
once into bench/out/ (``--gen`` passes more generator flags).  Each round runs every entry of
``--runs`` once, in order, then the next round runs them in reverse order (so a drift of the
shared machine's speed hits every entry alike); figures are the median over rounds.

Runs: ``torch`` (the reference: one process, 2 threads, ``--hash-bucket 1000001``,
``OMP_WAIT_POLICY=PASSIVE``), ``torch-full`` (full 64-bit ids through a vocabulary),
``torch-rowadam`` (per-row lazy Adam), ``torch-spin`` (OpenMP's default spinning), and
mpips's ``local``, ``local2``, ``async``, ``sync``, ``geo``, ``ssp``
(bench_train.RUNS; 2 servers x 2 workers, ``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1``),
plus any ``--run NAME=FLAGS`` (4 ranks, or 1 with ``--local``; ``--run "1x2=-n 3 --servers 1"``
sets the ranks).  ``--extra`` goes to every mpips
run, ``--torch-extra`` to every torch run.

Per run: train ex/s (the training span, as mpips's ``train_seconds``), whole-job ex/s
(examples / wall time of the process, start-up and test pass included), test AUC, logloss,
and the ratio of both speeds to the reference (``--ref``, default ``torch``) of the same
round.  ``--json FILE`` writes every record and the medians.

Shapes: ``--shape criteo`` (above; Criteo's default schema, dim 10, 400,400,400) or
``--shape wide``: ``data_prep.multihot_synth`` (``--slots`` sparse slots of bags, ~1.5 ids
per slot, Paddle slot text), trained as PaddleRec's slot_dnn (dim 9, hidden
512,256,128,128,128), with the generator's ``schema.toml``.  ``--schema FILE`` (or a
``schema.toml`` next to ``--data``'s train/test) is passed to mpips and to the reference,
which pools each slot's bag with ``nn.EmbeddingBag``.  ``--dim``/``--fc`` override the
shape's model for both sides.  mpips runs print their PROFILE lines (``--profile``) and,
from them, where the time goes (``time_goes`` in the JSON): servers' CPU seconds per 1M
examples, workers' MB sent + received per 1k examples (pulls, pushes and the dense
exchange), and the workers' mean seconds outside forward/backward (train span - compute).

The bound: before the rounds, ``bench/bound.py`` times the model's GEMMs (forward and both
backward products, one thread) with every BLAS this Python has (NumPy's OpenBLAS, SciPy's,
PyTorch's MKL) and takes the fastest as examples/s per core.  Each run's train ex/s is then
also printed as a share of the bound of the cores it may use (``bound``: ``--local`` 1 core,
PyTorch its 2 threads, 4-rank runs every core, each capped at the machine's cores; on more
than one core the bound is what each gave with all computing at once), beside its ratio
to the reference.  ``--no-bound`` skips it.
"""
import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import RUNS, run  # noqa: E402
from bound import per_core, report as bound_report  # noqa: E402
from common import ENV, ROOT  # noqa: E402

# name -> (torch_ref flags, OpenMP wait policy).  PASSIVE: an idle OpenMP thread sleeps
# instead of spinning.  On this shared 2-core machine (load ~16) the default spinning made
# the 2-thread reference 12x slower (399 vs 4829 ex/s, 40k rows, back to back): its two
# threads wait for each other at every op.  "torch-spin" keeps the default to show that.
TORCH_RUNS = {"torch": (["--hash-bucket", "1000001"], "PASSIVE"),
              "torch-full": (["--hash-bucket", "0"], "PASSIVE"),
              "torch-rowadam": (["--hash-bucket", "1000001", "--row-adam"], "PASSIVE"),
              "torch-spin": (["--hash-bucket", "1000001"], None)}
TORCH_ENV = dict(ENV, OMP_NUM_THREADS="2")


MODELS = ("dnn", "wide_deep", "deepfm", "dcn_v2", "dlrm")

SHAPES = {"criteo": {"dim": 10, "fc": "400,400,400"},
          "wide": {"dim": 9, "fc": "512,256,128,128,128"}}


def ensure_wide(out, rows, test_rows, slots, seed, gen):
    from data_prep.multihot_synth import main as gen_main
    tag = hashlib.sha1(" ".join(gen).encode()).hexdigest()[:8] if gen else "default"
    d = out / f"multihot-{rows}-{test_rows}-s{slots}-seed{seed}-{tag}"
    if not (d / "meta.json").exists():
        gen_main(["--out", str(d), "--rows", str(rows), "--test-rows", str(test_rows),
                  "--slots", str(slots), "--seed", str(seed), "--parts", "8"] + gen)
    return d


def ensure_data(out, rows, test_rows, scale, seed, gen):
    from data_prep.criteo_like import main as gen_main
    tag = hashlib.sha1(" ".join(gen).encode()).hexdigest()[:8] if gen else "default"
    d = out / f"criteo_like-{rows}-{test_rows}-x{scale:g}-s{seed}-{tag}"
    if not (d / "meta.json").exists():
        gen_main(["--out", str(d), "--rows", str(rows), "--test-rows", str(test_rows),
                  "--card-scale", str(scale), "--seed", str(seed), "--parts", "8"] + gen)
    return d


def run_torch(name, flags, wait_policy, data, out, extra):
    metrics = out / f"{name}.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [sys.executable, str(ROOT / "bench" / "torch_ref.py"), "--train", str(data / "train"),
           "--test", str(data / "test"), "--metrics-out", str(metrics)] + flags + extra
    t0 = time.time()
    env = dict(os.environ, **TORCH_ENV)
    env.pop("OMP_WAIT_POLICY", None)
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"{name}: FAILED\n{proc.stderr[-2000:]}", flush=True)
        return None
    rec = [json.loads(x) for x in metrics.read_text().splitlines()][-1]
    rec["wall_seconds"] = wall
    return rec


def where_time_goes(rec):
    """From an mpips run's PROFILE rows: servers' CPU seconds per 1M training examples,
    workers' MB sent + received (pull and push) per 1k examples, and the workers' mean
    seconds outside forward/backward (train span minus compute) with its share."""
    rows = rec.get("profile") or []
    head = next((r.split() for r in rows if " role " in r), None)
    if head is None or not rec.get("train_examples"):
        return {}
    cols = head[head.index("rank"):]
    table = [dict(zip(cols, r.split()[len(head) - len(cols):])) for r in rows if r.split() != head]
    srv = [t for t in table if t.get("role") == "server"]
    wrk = [t for t in table if t.get("role") == "worker"]
    if not wrk:
        return {}
    n, span = rec["train_examples"], rec.get("train_seconds", 0.0)
    out = {"server_cpu_s_per_1M": sum(float(t["cpu_s"]) for t in srv) / n * 1e6,
           "worker_MB_per_1k_examples": sum(float(t["MB_sent"]) + float(t["MB_recv"])
                                            for t in wrk) / n * 1e3}
    if span:
        outside = statistics.mean(span - float(t["compute_s"]) for t in wrk)
        out.update(worker_outside_fwd_bwd_s=outside, worker_outside_share=outside / span)
    return out


def parse_runs(names, custom):
    """name -> ('torch', flags, wait policy) or ('mpips', flags, ranks)."""
    table = {k: ("torch",) + v for k, v in TORCH_RUNS.items()}
    table.update({k: ("mpips", f, n) for k, (f, n) in RUNS.items()})
    for spec in custom:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--run wants NAME=FLAGS; got {spec!r}")
        f = shlex.split(flags)
        ranks = 1 if "--local" in f else 4
        if f[:1] == ["-n"]:                 # "-n N FLAGS": N ranks (a layout: 1x2 is -n 3
            try:                            # --servers 1)
                ranks, f = int(f[1]), f[2:]
            except (IndexError, ValueError):
                raise SystemExit(f"--run {name}: -n wants a number of ranks; got {flags!r}")
        table[name] = ("mpips", f, ranks)
        if name not in names:
            names.append(name)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; known: {sorted(table)}")
    return {n: table[n] for n in names}


def run_cores(spec):
    """Cores a run may use: PyTorch its OpenMP threads, mpips one per rank (a local run one),
    at most the machine's."""
    want = int(TORCH_ENV["OMP_NUM_THREADS"]) if spec[0] == "torch" else spec[2]
    return max(1, min(want, os.cpu_count() or 1))


def bound_share(rec, spec, bound):
    """Train ex/s over the GEMM bound of the run's cores (None without a bound)."""
    if not bound:
        return None
    cores = run_cores(spec)
    return rec["examples_per_sec"] / (per_core(bound, cores) * cores)


def line(rnd, name, rec, ref, share=None):
    ex, job = rec["examples_per_sec"], rec["train_examples"] / rec["wall_seconds"]
    s = (f"{rnd:>5} {name:14s} {ex:>9.0f} {job:>9.0f} {rec['test_auc']:>8.4f} "
         f"{rec['test_logloss']:>8.4f} {_pct(share):>6s}")
    if ref is not None:
        rj = ref["train_examples"] / ref["wall_seconds"]
        s += (f"   x{ex / ref['examples_per_sec']:.2f}   x{job / rj:.2f} "
              f"{rec['test_auc'] - ref['test_auc']:+8.4f}")
    return s


HEADER = (f"{'round':>5} {'run':14s} {'train/s':>9} {'job/s':>9} {'AUC':>8} {'logloss':>8}"
          f" {'bound':>6s}  {'train':>6} {'job':>6} {'dAUC':>8}  (bound: share of the GEMM "
          f"bound of the run's cores; ratios and dAUC vs the same round's ref)")


def _pct(x):
    return "-" if x is None else f"{x:.0%}"


def medians(results, ref, runs=None, bound=None):
    """name -> median figures over rounds (ratios taken per round, then the median)."""
    out = {}
    for name, recs in results.items():
        recs = [(r, x) for r, x in enumerate(recs) if x is not None]
        if not recs:
            continue
        m = {"rounds": len(recs)}
        for key in ("examples_per_sec", "test_auc", "test_logloss"):
            m[key] = statistics.median(x[key] for _, x in recs)
        if bound and runs and name in runs:
            m["bound_share"] = bound_share(m, runs[name], bound)
            m["bound_cores"] = run_cores(runs[name])
        m["job_examples_per_sec"] = statistics.median(
            x["train_examples"] / x["wall_seconds"] for _, x in recs)
        pairs = [(x, results[ref][r]) for r, x in recs if ref in results and results[ref][r]]
        if pairs:
            m["ratio_train"] = statistics.median(x["examples_per_sec"] / y["examples_per_sec"]
                                                 for x, y in pairs)
            m["ratio_job"] = statistics.median(
                (x["train_examples"] / x["wall_seconds"]) /
                (y["train_examples"] / y["wall_seconds"]) for x, y in pairs)
            m["dauc"] = statistics.median(x["test_auc"] - y["test_auc"] for x, y in pairs)
        out[name] = m
    return out


def bench_model(a, runs, data, out, name, model, bound=None):
    """Every run of ``runs`` for ``a.rounds`` alternated rounds with the model flags
    ``model``; returns (name -> records per round, name -> medians)."""
    results = {n: [] for n in runs}
    for rnd in range(a.rounds):
        seed = ["--seed", str(a.seeds[rnd])] if a.seeds else []
        extra = model + shlex.split(a.extra) + seed
        textra = model + shlex.split(a.torch_extra) + seed
        rout = out / f"vs_torch-{data.name}-{os.getpid()}" / f"{name}-round{rnd}"  # own dir per job
        rout.mkdir(parents=True, exist_ok=True)
        order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]
        for name in order:
            spec = runs[name]
            rec = (run_torch(name, spec[1], spec[2], data, rout, textra) if spec[0] == "torch" else
                   run(name, spec[1], spec[2], data, rout, extra))
            results[name].append(rec)
            if rec is not None:
                print(f"  ran {name} ({rec['wall_seconds']:.0f} s)", flush=True)
                if a.profile:
                    for pl in rec.get("profile", []):
                        print("    " + pl, flush=True)
                rec["time_goes"] = where_time_goes(rec)
                if rec["time_goes"]:
                    print("    " + ", ".join(f"{k} {v:.3g}" for k, v in rec["time_goes"].items()),
                          flush=True)
        ref = results[a.ref][rnd] if a.ref in results else None
        print(HEADER)
        for name in runs:
            rec = results[name][rnd]
            if rec is not None:
                print(line(rnd, name, rec, None if name == a.ref else ref,
                           bound_share(rec, runs[name], bound)))
        sys.stdout.flush()
    med = medians(results, a.ref, runs, bound)
    print(f"\nmedian of {a.rounds} round(s); ratios are per round to {a.ref!r}, then the median"
          + (f"; bound: share of {per_core(bound):.0f} ex/s per core x the run's cores"
             if bound else ""))
    print(f"{'run':14s} {'train/s':>9} {'job/s':>9} {'AUC':>8} {'logloss':>8} {'bound':>6} "
          f"{'x train':>8} {'x job':>6} {'dAUC':>8}")
    for name, m in med.items():
        print(f"{name:14s} {m['examples_per_sec']:>9.0f} {m['job_examples_per_sec']:>9.0f} "
              f"{m['test_auc']:>8.4f} {m['test_logloss']:>8.4f} {_pct(m.get('bound_share')):>6s} "
              f"{m.get('ratio_train', float('nan')):>8.2f} {m.get('ratio_job', float('nan')):>6.2f}"
              f" {m.get('dauc', float('nan')):>+8.4f}")
    if a.seeds:
        print_seeds(results, a.ref, a.seeds)
    return results, med


def print_seeds(results, ref, seeds):
    """With --seeds: each run's test AUC mean and sd over the seeds, and its AUC minus the
    reference's of the same seed (mean and sd): differences smaller than the sd between
    seeds are not differences."""
    print(f"over seeds {','.join(map(str, seeds))}: AUC mean (sd), and minus {ref!r} of the "
          f"same seed, mean (sd)")
    for name, recs in results.items():
        auc = [x["test_auc"] for x in recs if x]
        pairs = [x["test_auc"] - y["test_auc"] for x, y in zip(recs, results.get(ref, []))
                 if x and y]
        sd = statistics.stdev(auc) if len(auc) > 1 else float("nan")
        out = f"{name:14s} {statistics.mean(auc):.4f} ({sd:.4f})"
        if pairs and name != ref:
            psd = statistics.stdev(pairs) if len(pairs) > 1 else float("nan")
            out += f"   {statistics.mean(pairs):+.4f} ({psd:.4f})"
        print(out)


def _cell(m, ratio=True):
    """AUC / logloss (and the train ex/s ratio to the reference) of a median record."""
    if not m:
        return "-"
    ratio = f" ({m['ratio_train']:.2f}x)" if ratio and "ratio_train" in m else ""
    return f"{m['test_auc']:.4f} / {m['test_logloss']:.4f}{ratio}"


def print_models(done, ref):
    """One markdown row per model: the reference, --local and 2x2 async (medians, with their
    train ex/s x the reference) and async's AUC minus --local's and the reference's."""
    print(f"\n| model | {ref} AUC / logloss | `--local` (x {ref}) | 2x2 async (x {ref}) "
          f"| async AUC - local, - {ref} |")
    print("|---|---|---|---|---|")
    for name, (_, med) in done.items():
        r, lo, asy = med.get(ref), med.get("local"), med.get("async")
        diff = (f"{asy['test_auc'] - lo['test_auc']:+.4f}, {asy.get('dauc', float('nan')):+.4f}"
                if asy and lo else "-")
        print(f"| `{name}` | {_cell(r, False)} | {_cell(lo)} | {_cell(asy)} | {diff} |")


def gemm_bound(a, schema):
    """bench/bound.py's figures for the runs' shape (schema, --dim, --fc, batch size from
    --extra), measured in a process of its own (one BLAS thread there), printed."""
    from mpips.schema import Schema, load_schema
    sch = load_schema(schema) if schema else Schema.criteo()
    dim = a.dim or SHAPES[a.shape]["dim"]
    hidden = tuple(int(x) for x in (a.fc or SHAPES[a.shape]["fc"]).split(","))
    extra = shlex.split(a.extra)
    batch = int(extra[extra.index("--batch-size") + 1]) if "--batch-size" in extra else 512
    out = ROOT / "bench" / "out" / f"bound-{os.getpid()}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bound.py"), "--batch", str(batch),
           "--n-sparse", str(sch.n_sparse), "--dim", str(dim), "--n-dense", str(sch.n_dense),
           "--fc", ",".join(map(str, hidden)), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if proc.returncode != 0:
        print(f"bound: FAILED (going on without it)\n{proc.stderr[-1000:]}", flush=True)
        return None
    bound = json.loads(out.read_text())
    out.unlink()
    print(bound_report(bound), flush=True)
    return bound


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="", help="use DIR/train and DIR/test instead of generating")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--test-rows", type=int, default=200_000)
    ap.add_argument("--card-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen", default="", help="more generator flags (data_prep.criteo_like, or "
                    "data_prep.multihot_synth with --shape wide), one string")
    ap.add_argument("--shape", default="criteo", choices=sorted(SHAPES),
                    help="criteo (default) or wide (multi-hot, see above)")
    ap.add_argument("--slots", type=int, default=300, help="--shape wide: sparse slots")
    ap.add_argument("--schema", default="", help="schema TOML for both sides (default: the "
                    "data's schema.toml if there is one, else Criteo's)")
    ap.add_argument("--dim", type=int, default=0, help="embedding dim (default: the shape's)")
    ap.add_argument("--fc", default="", help="hidden layers (default: the shape's)")
    ap.add_argument("--profile", action="store_true", help="print mpips's PROFILE lines")
    ap.add_argument("--runs", default="torch,local,async,sync")
    ap.add_argument("--run", action="append", default=[], help="NAME=MPIPS_FLAGS (repeatable)")
    ap.add_argument("--ref", default="torch", help="the run ratios are taken to")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seeds", default="", help="comma-separated: round r runs both sides "
                    "with --seed seeds[r] (--rounds = their number) and the AUC is also "
                    "reported as mean and sd over the seeds")
    ap.add_argument("--extra", default="", help="flags for every mpips run")
    ap.add_argument("--torch-extra", default="", help="flags for every torch run")
    ap.add_argument("--model", default="dnn",
                    help="the network of every run, mpips's and torch's: dnn (default), "
                         "wide_deep, deepfm, dcn_v2, dlrm, or several, comma-separated (each in turn, then "
                         "one table of them all)")
    ap.add_argument("--json", default="", help="write records and medians to this file")
    ap.add_argument("--no-bound", action="store_true", help="do not measure the GEMM bound")
    a = ap.parse_args(argv)
    a.seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    if a.seeds:
        a.rounds = len(a.seeds)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1 (>= 2 for a figure worth quoting)")
    runs = parse_runs([n for n in a.runs.split(",") if n], a.run)
    models = [m for m in a.model.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        ap.error(f"--model: unknown {bad or a.model!r}; choose from {', '.join(MODELS)}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    if a.data:
        data = Path(a.data)
    elif a.shape == "wide":
        data = ensure_wide(out, a.rows, a.test_rows, a.slots, a.seed, shlex.split(a.gen))
    else:
        data = ensure_data(out, a.rows, a.test_rows, a.card_scale, a.seed, shlex.split(a.gen))
    schema = a.schema or (str(data / "schema.toml") if (data / "schema.toml").exists() else "")
    shape = ["--embedding-dim", str(a.dim or SHAPES[a.shape]["dim"]),
             "--fc", a.fc or SHAPES[a.shape]["fc"]] + (["--schema", schema] if schema else [])
    meta = json.loads((data / "meta.json").read_text()) if (data / "meta.json").exists() else {}
    if meta:
        tr, te = meta.get("train", {}), meta.get("test", {})
        print(f"data {data}: {tr.get('rows')} train rows ({tr.get('distinct_ids')} distinct ids),"
              f" {te.get('rows')} test rows; oracle test AUC {te.get('oracle_auc', float('nan')):.4f}"
              f" logloss {te.get('oracle_logloss', float('nan')):.4f}", flush=True)
    bound = None if a.no_bound else gemm_bound(a, schema)
    done = {}
    for name in models:
        model = shape + (["--model", name] if name != "dnn" else [])
        print(f"model and schema flags (both sides): {' '.join(model)}", flush=True)
        done[name] = bench_model(a, runs, data, out, name, model, bound)
    if len(models) > 1:
        print_models(done, a.ref)
    if a.json:
        for results, _ in done.values():
            for recs in results.values():
                for r in recs:
                    if r:
                        r.pop("profile", None)
        rec = {"data": str(data), "meta": meta, "argv": sys.argv[1:], "bound": bound}
        if len(models) == 1:
            rec.update(runs=done[models[0]][0], medians=done[models[0]][1])
        else:
            rec["models"] = {m: {"runs": r, "medians": md} for m, (r, md) in done.items()}
        Path(a.json).write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
