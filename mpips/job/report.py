"""What a run reports: log lines, per-epoch/pass metric records and the JSON-lines file.

``epoch_record`` builds the record of one epoch or pass (the fields DESIGN.md lists under
``--metrics-out``); ``summary_line`` / ``pass_line`` render it for the log;
``write_metrics`` appends it to the metrics file.  Only the first worker calls these.  Every
record starts with the run's identity (``mpips.job.tracking.identity``).
"""
import json
import resource
import sys

import numpy as np

from mpips.job.tracking import identity


def log_line(text):
    """One line in one write, so lines of several ranks merged by the launcher never mix."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def model_note(model):
    """', model NAME (rows of W floats: [w | v])' for the start line; empty for the
    default dnn."""
    if model.name == "dnn":
        return ""
    rows = f" (rows of {model.row_dim} floats: [w | v])" if model.row_dim > model.dim else ""
    return f", model {model.name}{rows}"


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def epoch_record(cfg, epoch, st, test_m):
    """The record of one epoch/pass from its EpochStats ``st`` (all workers') and test metrics."""
    n_ex, seconds = st.examples, st.seconds
    rec = identity(cfg) | {"epoch": epoch, "mode": cfg.mode, "train_examples": int(n_ex),
           "train_seconds": round(seconds, 4),
           "examples_per_sec": round(n_ex / seconds, 1) if seconds > 0 else 0.0,
           "train_loss": st.loss_sum / max(n_ex, 1), "train_auc": st.metrics.auc()}
    rec["batch_flag"] = "global_batch" if cfg.global_batch else "batch_size"
    if cfg.mode == "geo":
        rec["geo_steps"] = cfg.geo_steps
    if cfg.mode == "ssp":
        rec["staleness"] = cfg.staleness
    names = getattr(st.metrics, "names", None)
    if names:             # several labels: {label: {train_loss, train_auc}}, test fields below
        rec["tasks"] = {n: {"train_loss": m.logloss(), "train_auc": m.auc()}
                        for n, m in st.metrics.tasks.items()}
    rec = with_test(rec, test_fields(test_m))
    rec.update(st.extra)
    return rec


def with_test(rec, test):
    """``rec`` with the test fields ``test`` (of :func:`test_fields`), tasks merged: a
    task's record holds test_auc, test_logloss, test_mean_pred, test_ctr (ESMM's second
    task test_cvr_auc_clicked too) and train_loss, train_auc.  A task's train_loss is the
    mean cross-entropy of its training predictions (the record's train_loss is the tasks'
    weighted sum, what was minimised)."""
    out = rec | {k: v for k, v in (test or {}).items() if k != "tasks"}
    if test and "tasks" in test:
        out["tasks"] = {n: dict(test["tasks"][n], **rec.get("tasks", {}).get(n, {}))
                        for n in test["tasks"]}
    return out


def test_fields(test_m):
    """The record's test fields of evaluation metrics ``test_m`` ({} for None)."""
    if test_m is None:
        return {}
    out = dict(test_examples=int(test_m.count), test_auc=test_m.auc(),
               test_logloss=test_m.logloss(), test_mean_pred=test_m.mean_pred(),
               test_ctr=test_m.observed_ctr())
    if test_m.raw is not None:          # --dense-average: the trained weights' figures
        raw = test_m.raw
        out.update(test_auc_raw=raw.auc(), test_logloss_raw=raw.logloss(),
                   test_mean_pred_raw=raw.mean_pred())
    if hasattr(test_m, "task_fields"):
        out["tasks"] = test_m.task_fields("test_")
    return out


def noise_scale(blocks):
    """B_noise: the median over blocks (rows [|G|^2, tr(Sigma)] of ``DenseStep.noise()``,
    all shards' summed) of tr(Sigma) / |G|^2, a block without signal (|G|^2 <= 0) counting
    as infinite; None when there is no block or the median has no signal."""
    blocks = np.asarray(blocks, np.float64).reshape(-1, 2)
    if not len(blocks):
        return None
    g2, tr = blocks[:, 0], np.maximum(blocks[:, 1], 0.0)
    ratios = np.where(g2 > 0, tr / np.where(g2 > 0, g2, 1.0), np.inf)
    b = float(np.median(ratios))
    return b if np.isfinite(b) and b > 0 else None


def noise_fields(blocks, global_batch):
    """The record's ``global_batch`` (the examples of a step over all workers) and
    ``dense_noise_scale`` (examples, :func:`noise_scale`; None when the mean gradient did
    not show above the noise), the latter only when steps were counted (not with one
    batch a step, or GEO)."""
    out = {"global_batch": int(global_batch)}
    if blocks is None or not len(blocks):
        return out
    b = noise_scale(blocks)
    return {"dense_noise_scale": None if b is None else round(b, 1)} | out


ADVISE_BELOW = 0.75    # noise_line: advise a smaller batch when a step's examples do less


def noise_line(rec, batch, by_global=False):
    """A line on the dense gradient noise scale against the global batch (of workers'
    batches of ``batch``, set by ``--global-batch`` when ``by_global``, else by
    ``--batch-size``), or None."""
    if "dense_noise_scale" not in rec:
        return None
    b, B = rec["dense_noise_scale"], rec["global_batch"]
    flag = "--global-batch" if by_global else "--batch-size"
    src = (f"--global-batch, {batch} a worker" if by_global else
           f"W x --batch-size {batch}")
    if b is None:
        return (f"NOISE --> dense gradient noise scale: not measured (over the last steps "
                f"the mean gradient did not show above the noise); global batch {B} ({src})")
    # McCandlish et al.: a step of B examples does the work of B / (1 + B / b_noise)
    share = (1 + batch / b) / (1 + B / b)
    s = (f"NOISE --> dense gradient noise scale: {b:.0f} examples; global batch {B} "
         f"({B / b:.1f}x it; {src}): each example of a step does about {share:.2f} of what it "
         f"would in one process's batch of {batch}")
    if share < ADVISE_BELOW:
        s += (f"; fewer examples a step (a smaller {flag}) keep more of each "
              "(docs/modes.md, 'Scaling with W')")
    return s


def _or(x, default):
    return default if x is None else x


def write_metrics(path, rec):
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def summary_line(rec):
    s = (f"EPOCH {rec['epoch']} --> examples: {rec['train_examples']} "
         f"seconds: {rec['train_seconds']:.2f} examples/s: {rec['examples_per_sec']:.0f} "
         f"loss: {rec['train_loss']:.6f} auc: {rec['train_auc']:.6f}")
    if "test_auc" in rec:
        s += (f" | TEST examples: {rec['test_examples']} auc: {rec['test_auc']:.6f} "
              f"logloss: {rec['test_logloss']:.6f}")
    return s + tasks_part(rec)


def tasks_part(rec):
    """' | TASKS click: auc ... logloss ...; purchase: ...' of a record with several labels
    (test figures when there are, else the training loss)."""
    if "tasks" not in rec:
        return ""
    nan = float("nan")
    parts = []
    for name, t in rec["tasks"].items():
        if "test_auc" in t:
            p = f"{name}: auc {_or(t['test_auc'], nan):.6f} logloss {_or(t['test_logloss'], nan):.6f}"
            if "test_cvr_auc_clicked" in t:
                p += f" cvr auc (clicked) {_or(t['test_cvr_auc_clicked'], nan):.6f}"
        else:
            p = f"{name}: train loss {_or(t['train_loss'], nan):.6f}"
        parts.append(p)
    return " | TASKS " + "; ".join(parts)


def pass_line(rec):
    """The PASS line of a stream pass's record; a pass stopped by a signal says where (its
    record has no test fields: the pass's record after the resume has them)."""
    nan = float("nan")
    if "stopped_at_batch" in rec:
        head = (f"stopped after batch {rec['stopped_at_batch']} of the pass (the rest "
                f"after --resume auto)")
    else:
        head = (f"eval auc: {_or(rec.get('test_auc'), nan):.6f} logloss: "
                f"{_or(rec.get('test_logloss'), nan):.6f}")
    since = (f" (batches {rec['resumed_at_batch'] + 1} on)" if rec.get("resumed_at_batch")
             else "")
    s = (f"PASS {rec['pass']} --> {head} | train examples: {rec['train_examples']}{since} "
         f"loss: {rec['train_loss']:.6f} examples/s: {rec['examples_per_sec']:.0f}")
    if "table_rows" in rec:
        s += (f" | table rows: {rec['table_rows']} bytes: {rec['table_bytes']} admitted: "
              f"{rec['ids_admitted']} waiting: {rec['ids_waiting']} evicted: {rec['ids_evicted']}")
    return s + tasks_part(rec)
