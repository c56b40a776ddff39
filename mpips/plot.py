"""`python -m mpips.plot METRICS.jsonl [more.jsonl ...] [--out run.png]`: plot a run.

Reads the JSON lines `--metrics-out` writes and draws, with matplotlib (the `plot`
extra: `pip install 'mpips[plot]'`):
- epoch runs: train/test AUC, train/test logloss and examples/s per epoch; with several
  labels (a ``tasks`` object) each task's test AUC too;
- stream runs (records with a `pass`): progressive AUC per pass (evaluated before the
  pass trains), table rows, ids admitted / waiting / evicted per pass, examples/s;
- several runs, in one file or several: overlaid, one colour and one labelled line each, to
  compare modes or configs.  Records carry their run's id (``run_id``): a file that several
  runs appended to (a stopped run and its resumes, or runs of other settings) is drawn as one
  line per run, labelled with the run's id and settings; records without an id (written
  before runs had one) are one run per file.
The default output is the first file with `.png` instead of its suffix.  An empty file,
a file that is not mpips metrics, or epoch and stream files mixed is an error that says
which file and line.
"""
import argparse
import json
import os
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
except ImportError:       # the optional `plot` extra
    plt = None

REQUIRED = ("epoch", "train_examples")


class PlotError(ValueError):
    pass


def load_run(path):
    """The records of one metrics file; PlotError names the file (and line) if it is not one."""
    try:
        with open(path) as fh:
            lines = fh.readlines()
    except OSError as e:
        raise PlotError(f"{path}: cannot read ({e.strerror})")
    recs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise PlotError(f"{path}:{i}: not a JSON line; mpips.plot reads the file "
                            f"`--metrics-out` writes")
        if not isinstance(rec, dict) or any(k not in rec for k in REQUIRED):
            raise PlotError(f"{path}:{i}: not an mpips metrics record (needs the fields "
                            f"{' and '.join(REQUIRED)}); mpips.plot reads the file "
                            f"`--metrics-out` writes")
        recs.append(rec)
    if not recs:
        raise PlotError(f"{path}: no metrics records (empty file; did the run finish an "
                        f"epoch or pass?)")
    kinds = {"pass" in r for r in recs}
    if len(kinds) > 1:
        raise PlotError(f"{path}: mixes epoch and stream records; plot them from separate files")
    return recs


def run_label(path, recs, paths):
    stem = os.path.splitext(os.path.basename(path))[0]
    if sum(os.path.splitext(os.path.basename(p))[0] == stem for p in paths) > 1:
        stem = path
    if "run_id" in recs[0]:
        return f"{stem}: {label_of(recs[0])}"
    modes = {r.get("mode") for r in recs} - {None}
    return f"{stem} ({modes.pop()})" if len(modes) == 1 else stem


def label_of(rec):
    """A run's short name from a record: its id's first 6 digits, model, mode, workers x
    servers (or local), batch (bB: --batch-size B a worker; GG: --global-batch G) and lr."""
    where = (f"{rec['workers']}x{rec.get('servers', 0)}" if rec.get("workers")
             else f"local x{rec.get('local_workers') or 1}")
    batch = (f"G{rec.get('global_batch', '?')}" if rec.get("batch_flag") == "global_batch"
             else f"b{rec.get('batch_size', '?')}")       # --global-batch G, or a worker's
    return (f"{str(rec['run_id'])[:6]} {rec.get('model', '')} {rec.get('mode', '')} {where} "
            f"{batch} lr{rec.get('lr', '?')}")


def split_runs(recs):
    """The records of one file as runs, in order of first appearance: by ``run_id`` (one
    run for records without one)."""
    runs = {}
    for r in recs:
        runs.setdefault(r.get("run_id"), []).append(r)
    return list(runs.values())


def _series(ax, x, recs, key, **kw):
    pts = [(xi, r[key]) for xi, r in zip(x, recs) if isinstance(r.get(key), (int, float))]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **kw)
    return bool(pts)


def _tasks(ax, x, recs, key, **kw):
    """Per-task lines of a run with several labels (records' ``tasks``): ``key`` of each
    task, one dash-dot style a task, labelled by the task's name."""
    names = [n for n in (recs[0].get("tasks") or {})]
    drew = False
    label = kw.pop("label", "")
    for k, name in enumerate(names):
        flat = [(r.get("tasks") or {}).get(name, {}) for r in recs]
        drew |= _series(ax, x, flat, key, ls=("-.", ":", (0, (5, 1)))[k % 3],
                        label=f"{label} {name}", **kw)
    return drew


def _finish(ax, title, xlabel, drew):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not drew:
        ax.text(0.5, 0.5, "not in these records", ha="center", va="center",
                transform=ax.transAxes, color="gray")


def plot_epochs(runs):
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    drew = [False] * 3
    for i, (label, recs) in enumerate(runs):
        c = f"C{i}"
        x = [r["epoch"] for r in recs]
        m = "o" if len(recs) < 30 else None
        drew[0] |= _series(axes[0], x, recs, "test_auc", color=c, marker=m, label=f"{label} test")
        drew[0] |= _series(axes[0], x, recs, "train_auc", color=c, marker=m, ls="--",
                           label=f"{label} train")
        drew[0] |= _tasks(axes[0], x, recs, "test_auc", color=c, marker=m, label=label)
        drew[1] |= _series(axes[1], x, recs, "test_logloss", color=c, marker=m,
                           label=f"{label} test")
        drew[1] |= _series(axes[1], x, recs, "train_loss", color=c, marker=m, ls="--",
                           label=f"{label} train")
        drew[2] |= _series(axes[2], x, recs, "examples_per_sec", color=c, marker=m, label=label)
    for ax, title, d in zip(axes, ("AUC", "logloss", "train examples/s"), drew):
        _finish(ax, title, "epoch", d)
    axes[0].legend(fontsize=7)
    return fig


def plot_stream(runs):
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    ax = axes.ravel()
    drew = [False] * 4
    for i, (label, recs) in enumerate(runs):
        c = f"C{i}"
        x = list(range(len(recs)))
        drew[0] |= _series(ax[0], x, recs, "test_auc", color=c, label=label)
        drew[0] |= _tasks(ax[0], x, recs, "test_auc", color=c, label=label)
        drew[1] |= _series(ax[1], x, recs, "table_rows", color=c, label=label)
        for key, ls in (("ids_admitted", "-"), ("ids_waiting", "--"), ("ids_evicted", ":")):
            drew[2] |= _series(ax[2], x, recs, key, color=c, ls=ls)
        drew[3] |= _series(ax[3], x, recs, "examples_per_sec", color=c, label=label)
    titles = ("progressive AUC (before training on the pass)", "table rows",
              "ids admitted (-) / waiting (--) / evicted (:)", "train examples/s")
    for a, title, d in zip(ax, titles, drew):
        _finish(a, title, "pass", d)
    ax[0].legend(fontsize=7)
    return fig


def plot_files(paths, out, title="", labels=None):
    """Draw the runs in `paths` into `out` (PNG), named `labels` (default: the file
    names); return out."""
    if plt is None:
        raise PlotError("mpips.plot needs matplotlib: pip install 'mpips[plot]' "
                        "(or pip install matplotlib)")
    loaded = [(p, run) for p in paths for run in split_runs(load_run(p))]
    kinds = {"pass" in recs[0] for _, recs in loaded}
    if len(kinds) > 1:
        raise PlotError("cannot overlay epoch runs and stream runs: "
                        + ", ".join(f"{p} ({'stream' if 'pass' in r[0] else 'epochs'})"
                                    for p, r in loaded))
    if labels and len(labels) != len(loaded):
        raise PlotError(f"{len(labels)} labels for {len(loaded)} runs (in {len(paths)} "
                        f"file(s))")
    runs = [(labels[i] if labels else run_label(p, recs, paths), recs)
            for i, (p, recs) in enumerate(loaded)]
    fig = plot_stream(runs) if kinds.pop() else plot_epochs(runs)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpips.plot",
                                description="Plot the --metrics-out JSON lines of runs.")
    p.add_argument("metrics", nargs="+", help="metrics JSONL files; several are overlaid")
    p.add_argument("--out", default="", help="PNG to write (default: the first file's name "
                                             "with .png)")
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("--labels", default="", help="comma-separated names of the runs "
                                                "(default: the file names and mode)")
    a = p.parse_args(argv)
    out = a.out or os.path.splitext(a.metrics[0])[0] + ".png"
    labels = [x.strip() for x in a.labels.split(",")] if a.labels else None
    try:
        plot_files(a.metrics, out, a.title, labels)
    except PlotError as e:
        print(f"mpips.plot: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
