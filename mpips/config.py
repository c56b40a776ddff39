"""Typed run configuration: one dataclass, mapped onto CLI flags and an optional TOML file.

Precedence: defaults < ``--config FILE`` (TOML, keys are the flag names with ``_`` or ``-``)
< flags given on the command line.  Unknown keys and impossible values are errors that say
the fix.  The resolved config is stored in every checkpoint; ``check_compatible`` says
whether a stored one can be resumed or evaluated with this one.
"""
import argparse
import dataclasses
import difflib
import importlib.util
import json
import sys
from dataclasses import dataclass, field

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mpips.schema import load_schema
from mpips.tiering import check_tier

MODES = ("async", "sync", "geo", "ssp")
OPTIMIZERS = ("adam", "adagrad", "sgd")
FORMATS = ("auto", "tsv", "slot")
SAVE_MODES = ("full", "base", "delta")
SHRINK_EVERY = ("day", "pass", "never")
LATE_PASS = ("warn", "fail")
MODELS = ("dnn", "wide_deep", "deepfm", "dcn_v2", "dlrm", "shared_bottom", "mmoe", "esmm")
SIM_SPARSE = ("async", "sync")              # mpips.worker.simulate.SPARSE


STALE_POWER = {"none": 0.0, "sqrt": 0.5, "inverse": 1.0}   # --stale-lr: lr x (1 + s)^-P


def stale_power(rule):
    """P of a --stale-lr rule (a pushed row's lr x (1 + s)^-P): none 0, sqrt 0.5, inverse 1,
    power:P (0 <= P <= 4); else ValueError (auto: mpips.tables.staleness.stale_rule)."""
    name, _, value = str(rule).partition(":")
    try:
        p = STALE_POWER[rule] if rule in STALE_POWER else float(value) if name == "power" else -1
    except ValueError:
        p = -1
    if not 0 <= p <= 4:
        raise ValueError(f"--stale-lr must be one of none, inverse, sqrt, auto or power:P "
                         f"(0 <= P <= 4); got {rule!r}")
    return float(p)


PUSH_RULES = ("none", "count", "each")        # --sync-sparse-lr (mpips.tables.push)
MAX_COUNT = 1 << 24       # float32 counts are exact integers up to here
LARGE_BATCH = ("auto", "none", "cowclip")     # --large-batch rules
AUTO_K = 8               # --large-batch auto: cowclip from a global batch of AUTO_K x the base on
# --large-batch cowclip's parameters (CowClip, Zheng et al. 2022; the paper's DeepFM values):
# the clip ratio r, the clip floor zeta, the embeddings' L2 at the base batch, and the dense
# warm-up in dense steps (the paper warms for about one epoch; here a fixed step count),
# and the power of k that scales the dense lr: 1 (x k); the paper's sqrt(k) is dense=0.5,
# which lost AUC to x k on 1M, 4M and 16M rows (docs/studies/scaling-with-w.md)
COWCLIP = {"r": 1.0, "zeta": 1e-5, "l2": 1e-5, "warmup": 20, "dense": 1.0}


def parse_entry(spec):
    """'' | 'count:N' | 'probability:P' -> (kind, value); ValueError with the forms."""
    if not spec:
        return None, 0.0
    kind, _, raw = spec.partition(":")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if kind == "count" and value >= 1 and value == int(value):
        if value > MAX_COUNT:
            raise ValueError(f"--entry count:{raw}: at most {MAX_COUNT} (sightings are counted "
                             f"in float32, whose integers end there)")
        return "count", int(value)
    if kind == "probability" and 0.0 < value <= 1.0:
        return "probability", value
    raise ValueError(f"--entry must be count:N (N >= 1) or probability:P (0 < P <= 1); got {spec!r}")


def parse_large_batch(spec):
    """'auto' | 'none' | 'cowclip' | 'cowclip:key=value,...' (keys of COWCLIP) -> None
    (auto, none: no parameters of their own; auto is resolved by the run's plan, from its
    global batch) or the cowclip parameters (a dict, COWCLIP's defaults filled in);
    ValueError with the forms."""
    name, _, rest = spec.partition(":")
    form = (f"--large-batch must be auto, none, cowclip or cowclip:key=value,... (keys "
            f"{', '.join(COWCLIP)}; r > 0, zeta, l2, warmup, dense >= 0; warmup an integer, "
            f"dense at most 2); got {spec!r}")
    if name not in LARGE_BATCH or (name != "cowclip" and rest):
        raise ValueError(form)
    if name != "cowclip":
        return None
    out = dict(COWCLIP)
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(form) from None
        if key not in out or not value >= 0 or (key == "r" and value == 0) or (
                key == "warmup" and value != int(value)) or (key == "dense" and value > 2):
            raise ValueError(form)
        out[key] = int(value) if key == "warmup" else value
    return out


def split_batch(total, workers):
    """The batches of ``workers`` workers that share a global batch of ``total`` examples:
    ``total // workers`` each, the first ``total % workers`` one more.  ValueError (one
    line) when a worker would get none."""
    if workers < 1 or total < workers:
        raise ValueError(f"--global-batch {total} over {workers} workers leaves a worker "
                         f"without examples: give at least {max(workers, 1)}")
    q, r = divmod(total, workers)
    return [q + 1 if i < r else q for i in range(workers)]


def _f(default, help_text, **kw):
    return field(default=default, metadata={"help": help_text, **kw})


@dataclass
class Config:
    # --- data
    train: str = _f("", "training data: file, folder, glob or comma list; empty = the embedded "
                        "synthetic dataset (generated once into --cache-dir)")
    test: str = _f("", "test data, same forms; empty with no --train = the synthetic held-out part")
    data_format: str = _f("auto", "input format: auto (by first line), tsv (Criteo), slot (Paddle "
                                  "slot text)", choices=FORMATS)
    schema: str = _f("", "feature schema, a TOML file (format, label, dense and sparse inputs; "
                         "docs/data.md); empty = Criteo's 13 integer + 26 categorical columns")
    pipe_command: str = _f("", "feed each data file to this shell command and read its stdout "
                               "in the schema's format (overrides the schema's pipe_command)")
    pipe_timeout: float = _f(0.0, "fail the run when a pipe command sends nothing for this "
                                   "many seconds, or does not exit this long after closing "
                                   "its output (names the file and the command); 0 = 90, or "
                                   "3/4 of --peer-timeout when that is less, so that it fires "
                                   "before the servers' --peer-timeout")
    stats: str = _f("", "normalisation statistics (stats.json from data_prep.criteo); default: "
                        "Paddle's constants for text, a prepared set's own stats for binary parts")
    cache_dir: str = _f("~/.cache/mpips", "where the embedded synthetic dataset is kept")
    synth_rows: int = _f(300_000, "rows of the embedded synthetic training set")
    synth_test_rows: int = _f(60_000, "rows of the embedded synthetic test set")
    strict: bool = _f(False, "stop at the first malformed line instead of counting and skipping it")
    max_bad_fraction: float = _f(0.1, "fail on a data file whose share of malformed lines is "
                                 "above this (or that has no valid line); 1 = only the latter")
    hash_bucket: int = _f(0, "0 = full 64-bit feature ids; N>0 = Paddle-style `hash %% N` buckets "
                             "(Paddle uses 1000001)")
    # --- cluster and mode
    servers: int = _f(0, "number of server ranks (0 = half the ranks, at least 1)")
    local: bool = _f(False, "train in one process without MPI messages (the yardstick)")
    local_workers: int = _f(1, "local mode: read the data as W workers would and train on "
                               "their batches side by side (one dense step of W x B; sparse "
                               "rows: --sync-sparse-lr), to reproduce sync mode")
    # --- simulator (mpips.worker.simulate): W workers of a real run in one process
    simulate_workers: int = _f(0, "with --local: emulate W workers of a real 2-server run, "
                                  "deterministically (docs/modes.md, Simulator); 0 = off")
    sim_delay: int = _f(0, "simulator: a worker's rows miss the pushes of the last D steps "
                           "(0 = a real async worker's pull after its push; 1 = with "
                           "--overlap-pull)")
    sim_sparse: str = _f("async", "simulator: async (each worker's push applied on its own, "
                                  "in worker order) or sync (the step's pushes summed)",
                         choices=SIM_SPARSE)
    mode: str = _f("async", "training mode: async (sparse pushes applied on arrival), sync "
                            "(BSP), geo (GEO-SGD, see --geo-steps) or ssp (bounded staleness, "
                            "see --staleness)", choices=MODES)
    geo_steps: int = _f(100, "GEO-SGD: send deltas every K local steps")
    staleness: int = _f(4, "ssp: a worker may run at most this many steps ahead of the slowest")
    sync_sparse_lr: str = _f("each", "sync (and --local-workers): each worker's push is an "
                                     "optimizer step of its own, its rows averaged over that "
                                     "worker's examples, applied in worker order (each: a row "
                                     "steps once per batch holding it, as in one process); or "
                                     "the step's pushes are summed into one step at --lr "
                                     "(none: one process with the global batch) or at --lr x "
                                     "the workers whose batches held the row (count)",
                             choices=PUSH_RULES)
    overlap_pull: bool = _f(False, "async: send the next batch's pull before computing this "
                                   "one (its rows then miss this step's pushes; measured "
                                   "worse at 2-8 workers, docs/modes.md) instead of after "
                                   "the push")
    pull_after: str = _f("auto", "async, 2+ workers: push = the next batch's pull goes in this "
                                 "batch's push (one message a server a step; its rows miss "
                                 "the pushes of workers that push after it); exchange = the "
                                 "push goes before the dense exchange and the pull after it, "
                                 "so the rows hold every worker's push of the step (two "
                                 "messages); auto = push up to 3 workers, exchange from 4 "
                                 "(docs/modes.md)", choices=("push", "exchange", "auto"))
    dense_lag: int = _f(0, "async, 2+ workers: 1 = each step's dense gradients are applied "
                           "one step late, so that a step waits for the other workers once "
                           "instead of twice (docs/modes.md); 0 = the step after they are "
                           "computed", choices=(0, 1))
    stale_lr: str = _f("auto", "async/ssp: damp each pushed sparse row's lr by its staleness s "
                               "(updates the row took since the worker pulled it): none, "
                               "inverse (1/(1+s)), sqrt (1/sqrt(1+s)), power:P ((1+s)^-P) or "
                               "auto (none up to 16 workers, power:0.75 beyond)")
    row_clip: float = _f(0.0, "CowClip-style clipping of each pushed sparse row's gradient: its "
                              "mean over the row's occurrences in the batch is clipped to "
                              "norm R x max(|row|, --row-clip-floor); 0 = off")
    row_clip_floor: float = _f(1e-3, "--row-clip: the smallest row norm the threshold uses")
    large_batch: str = _f("auto", "a large-batch rule: auto, none, or cowclip (CowClip, Zheng et "
                                  "al. 2022) for k = the global batch / --large-batch-base: "
                                  "the rows' lr unchanged, the dense lr --lr x k^dense, an L2 "
                                  "of l2 x k on the pushed rows, each row's gradient (of the "
                                  "batch's mean loss) clipped to norm count x max(r |row|, "
                                  "zeta), and the dense lr warmed up linearly over the first "
                                  "warmup dense steps; cowclip:r=1,zeta=1e-5,l2=1e-5,"
                                  "warmup=20,dense=1 unless given; auto (the default): plain "
                                  "cowclip where the global batch is at least "
                                  f"{AUTO_K} x --large-batch-base, with --global-batch or one "
                                  "worker, and the run's flags allow it (the start line says "
                                  "which; docs/modes.md), none elsewhere")
    large_batch_base: int = _f(4096, "--large-batch: the global batch at which the rule's "
                                     "k is 1")
    # --- model and optimiser
    model: str = _f("dnn", "network: a built-in one, dnn (CTR-DNN), wide_deep (Wide&Deep), "
                           "deepfm (DeepFM), dcn_v2 (DCN-v2), dlrm (DLRM), or a network file "
                           "FILE.toml (--print-model NAME prints one; docs/models.md)")
    embedding_dim: int = _f(10, "embedding size per sparse slot")
    fc: str = _f("400,400,400", "hidden layer sizes, comma-separated")
    optimizer: str = _f("adam", "optimizer of the sparse rows (on the servers) and of the dense "
                                "weights (on every worker's replica; GEO: the worker's local "
                                "copy)", choices=OPTIMIZERS)
    lr: float = _f(1e-3, "learning rate of the sparse rows (the dense weights': see "
                         "--dense-lr-scale)")
    dense_lr_scale: float = _f(0.0, "dense weights learn at --lr x this; 0 = by --dense-lr-rule "
                                    "from the W batches one dense step averages (the workers, "
                                    "or --local-workers; GEO: 1)")
    dense_lr_rule: str = _f("auto", "with --dense-lr-scale 0: the dense rate is --lr x W "
                                    "(linear), x sqrt(W) (sqrt), or auto: linear up to 4 "
                                    "workers, sqrt beyond; with --global-batch G: x 1 at any "
                                    "W (a dense step averages G examples, as one process's "
                                    "of batch G)", choices=("auto", "sqrt", "linear"))
    dense_average: float = _f(0.0, "B in [0, 1): evaluate and serve avg = B avg + (1 - B) w, "
                                   "updated each dense step (docs/modes.md); 0 = off")
    adagrad_init: float = _f(0.0, "adagrad: initial accumulator (Paddle's default 0; > 0 makes "
                                  "the first steps smooth in the gradient)")
    init_range: float = _f(0.05, "new embedding rows start uniform in [-r, r] from (seed, id)")
    batch_size: int = _f(512, "examples per worker step (the global batch is W x this: "
                              "see --global-batch)")
    global_batch: int = _f(0, "examples per step over all W workers (0 = W x --batch-size): "
                              "each worker takes G / W, the first G %% W one more; the dense "
                              "rate is then --lr x 1 at any W (with --dense-lr-scale 0), so "
                              "the dense steps match --local --batch-size G and adding "
                              "workers no longer grows the global batch (docs/modes.md, "
                              "'Scaling with W'); excludes --batch-size")
    epochs: int = _f(1, "passes over the training data")
    seed: int = _f(0, "seed of all initialisation (and of --shuffle)")
    shuffle: bool = _f(False, "reshuffle every epoch, from (seed, epoch): which files or binary "
                              "parts each worker reads, and rows inside a worker's window "
                              "(default: off, file order)")
    shuffle_window: int = _f(100_000, "with --shuffle: rows shuffled together in memory inside "
                                      "a worker (0 = reshuffle only the files)")
    # --- online (streaming) training
    stream: str = _f("", "train online on the passes of this folder: DIR/YYYYMMDD/HH/ (or "
                         "DIR/YYYYMMDD/), each ready when it holds a _SUCCESS file")
    stream_timeout: float = _f(0.0, "stream: wait this many seconds for a new pass before "
                                    "finishing, saying so in a STREAM line (0 = finish when no "
                                    "pass is ready)")
    shrink_every: str = _f("day", "stream: evict rows unseen for --shrink-threshold shrinks, at "
                                  "every new day, every pass, or never", choices=SHRINK_EVERY)
    shrink_threshold: int = _f(30, "stream: rows unseen for more than this many shrink calls go")
    late_pass: str = _f("warn", "stream: a pass whose _SUCCESS appears after a later pass was "
                                "taken is never trained: warn (log it, count it as "
                                "passes_late in the metrics) or fail (stop the run)",
                        choices=LATE_PASS)
    entry: str = _f("", "feature admission: count:N (a row at an id's N-th sighting) or "
                        "probability:P (Paddle's CountFilterEntry / ProbabilityEntry); empty = "
                        "every id gets a row at its first sighting")
    table_memory: str = _f("", "cap on the bytes of sparse rows each server (or --local's "
                               "table) holds in memory, e.g. 4G or 512M; the rows beyond it "
                               "live whole on local disk under --table-dir, results unchanged "
                               "(docs/disk-tier.md); empty = every row in memory")
    table_dir: str = _f("", "with --table-memory: where each rank's disk-tier folder is made "
                            "(fresh, removed at exit); empty = $SLURM_TMPDIR, else $TMPDIR, "
                            "else /tmp")
    # --- checkpoints
    save_dir: str = _f("", "checkpoint root: checkpoints (HDF5 shards + MANIFEST.json) are "
                           "saved there as --save-every says, a stream's after every pass (and "
                           "it resumes from the newest when restarted); empty = no checkpoints")
    save_every: str = _f("epoch", "with --save-dir: 'epoch' (after every epoch) or N (every N "
                                  "batches per worker, and after the last epoch)")
    save_mode: str = _f("full", "what a save holds: full, base (and start tracking changes) or "
                                "delta (rows changed since the last base/delta)",
                        choices=SAVE_MODES)
    export_dir: str = _f("", "stream: after each saved pass, export it for serving into this "
                             "folder (a full bundle after a base, a patch after a delta)")
    resume: str = _f("", "continue from this checkpoint, or the newest valid one in this root "
                         "(a checkpoint of the other kind, stream or batch, only if named "
                         "itself); auto = the newest valid one in --save-dir if it holds "
                         "one, else start afresh (what a requeued job gives); empty = start "
                         "afresh (a stream still resumes from its --save-dir)")
    overwrite: bool = _f(False, "start afresh in a --save-dir that holds checkpoints (refused "
                                "without it): its older checkpoints are removed once this run "
                                "has saved its first")
    keep: int = _f(0, "with --save-dir: keep only the newest N checkpoints (and the bases and "
                      "deltas they are made of); 0 = keep all")
    # --- output and robustness
    print_every: int = _f(100, "log a TRAIN line every N batches (first worker)")
    progress_every: float = _f(10.0, "print a PROGRESS line (position in the epoch or pass, "
                                     "ex/s, ETA) every this many seconds (first worker; 0 = off)")
    table_every: int = _f(0, "log a TABLE line (examples, seconds, worker compute/wait, table "
                             "rows and bytes per row) every N examples (first worker; 0 = off)")
    metrics_out: str = _f("", "append JSON lines (one per epoch, or per pass of a stream) to "
                              "this file; each names its run (id, start, settings)")
    tensorboard: str = _f("", "write TensorBoard scalars (loss, AUC, logloss, examples/s, table "
                              "rows, staleness) into a folder of this run under this folder "
                              "(needs tensorboardX: pip install 'mpips[tensorboard]')")
    peer_timeout: float = _f(120.0, "seconds without an answer from a peer before failing")
    prefetch: bool = _f(True, "parse data in a background thread")
    idle_sleep: float = _f(5e-4, "longest sleep (s) of an idle server between polls; 0 = "
                                 "busy-poll (only to measure what sleeping saves)")
    max_steps: int = _f(0, "stop each epoch after N steps per worker (0 = whole epoch)")

    @property
    def save_steps(self):
        """Save every this many batches (0 = at epoch ends only)."""
        return 0 if self.save_every == "epoch" else int(self.save_every)

    @property
    def hidden(self):
        """--fc as a tuple of layer sizes (the run plan holds it, parsed once)."""
        return parse_fc(self.fc)

    def validate(self):
        """Raise ValueError with the fix for impossible values."""
        check_tier(self.table_memory, self.table_dir)
        if self.save_every != "epoch" and not (self.save_every.isdigit() and
                                               int(self.save_every) > 0):
            raise ValueError(f"--save-every must be 'epoch' or a number of batches >= 1; got "
                             f"{self.save_every!r}")
        positive = ("embedding_dim", "batch_size", "epochs", "geo_steps",
                    "print_every", "local_workers")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        for name, choices in (("shrink_every", SHRINK_EVERY), ("late_pass", LATE_PASS),
                              ("save_mode", SAVE_MODES),
                              ("mode", MODES), ("optimizer", OPTIMIZERS),
                              ("data_format", FORMATS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(choices)}; "
                                 f"got {getattr(self, name)!r}")
        if self.model not in MODELS and not self.model.endswith(".toml"):
            raise ValueError(f"--model must be one of {', '.join(MODELS)} or a network file "
                             f"FILE.toml; got {self.model!r}")
        try:
            hidden = self.hidden
        except ValueError:
            raise ValueError(f"--fc must be comma-separated integers like 400,400,400; got {self.fc!r}")
        if not hidden or min(hidden) < 1:
            raise ValueError(f"--fc needs at least one positive layer size; got {self.fc!r}")
        parse_entry(self.entry)
        if self.stale_lr != "auto":
            stale_power(self.stale_lr)          # raises with the forms it takes
        self.check_schema()
        self.check_simulate()
        if self.stream and self.train:
            raise ValueError("--stream and --train exclude each other (a stream's passes are "
                             "its training data)")
        if self.export_dir and not (self.stream and self.save_dir):
            raise ValueError("--export-dir exports the checkpoints of a stream run: give "
                             "--stream and --save-dir too")
        if self.resume == "auto" and not self.save_dir:
            raise ValueError("--resume auto continues from the newest checkpoint in --save-dir: "
                             "give --save-dir too")
        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            raise ValueError("--tensorboard needs tensorboardX: pip install "
                             "'mpips[tensorboard]' (or pip install tensorboardX)")
        if self.keep < 0:
            raise ValueError(f"--keep must be >= 0 (0 = keep every checkpoint); got {self.keep}")
        if self.stream_timeout < 0 or self.shrink_threshold < 0:
            raise ValueError("--stream-timeout and --shrink-threshold must be >= 0")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"--max-bad-fraction must be in [0, 1]; got {self.max_bad_fraction}")
        if self.idle_sleep < 0 or self.progress_every < 0 or self.shuffle_window < 0:
            raise ValueError("--idle-sleep, --progress-every and --shuffle-window must be >= 0")
        if self.lr <= 0 or self.peer_timeout <= 0 or not self.pipe_timeout >= 0:
            raise ValueError("--lr and --peer-timeout must be positive, --pipe-timeout >= 0 "
                             "(0: by --peer-timeout)")
        if self.overlap_pull and self.mode != "async":
            raise ValueError(f"--overlap-pull is for --mode async; got --mode {self.mode}")
        if self.pull_after == "exchange" and (self.mode != "async" or self.overlap_pull
                                              or self.dense_lag):
            raise ValueError(f"--pull-after {self.pull_after} is for --mode async without "
                             f"--overlap-pull or --dense-lag; got --mode {self.mode}"
                             f"{' --overlap-pull' if self.overlap_pull else ''}"
                             f"{' --dense-lag 1' if self.dense_lag else ''}")
        if self.dense_lag and (self.mode != "async" or self.overlap_pull):
            raise ValueError(f"--dense-lag 1 is for --mode async without --overlap-pull; got "
                             f"--mode {self.mode}{' --overlap-pull' if self.overlap_pull else ''}")
        if self.global_batch < 0:
            raise ValueError(f"--global-batch must be >= 0 (0 = W x --batch-size); got "
                             f"{self.global_batch}")
        if self.global_batch and self.local:
            split_batch(self.global_batch, self.simulate_workers or self.local_workers)
        if not (self.dense_lr_scale >= 0 and 0 <= self.dense_average < 1):
            raise ValueError(f"--dense-lr-scale must be >= 0 (0 = by the workers), "
                             f"--dense-average in [0, 1) (0 = off); got {self.dense_lr_scale}, "
                             f"{self.dense_average}")
        if not (self.row_clip >= 0 and self.row_clip_floor >= 0):
            raise ValueError(f"--row-clip, --row-clip-floor must be >= 0 (0 = off); got "
                             f"{self.row_clip}, {self.row_clip_floor}")
        if self.row_clip and self.mode == "geo":
            raise ValueError("--row-clip clips pushed row gradients: GEO pushes deltas; use it "
                             "with --mode async, sync or ssp")
        self.check_large_batch()
        if self.staleness < 0 or self.servers < 0 or self.hash_bucket < 0 or self.max_steps < 0:
            raise ValueError("--staleness, --servers, --hash-bucket and --max-steps must be >= 0")
        if self.train == "" and self.test != "" and not self.stream:
            raise ValueError("--test without --train: give --train too (or neither for the "
                             "embedded synthetic dataset)")
        return self

    def check_large_batch(self):
        """--large-batch: its form, and the runs it serves (its L2 and clip act on each
        push of one worker's rows, its dense rate replaces the dense-lr flags)."""
        if self.large_batch_base < 1:
            raise ValueError(f"--large-batch-base must be >= 1; got {self.large_batch_base}")
        if parse_large_batch(self.large_batch) is None:        # none, or auto: the plan's
            return
        if why := self.large_batch_conflict():
            raise ValueError(f"--large-batch {self.large_batch}: {why}")

    def large_batch_conflict(self):
        """Why this run's flags rule out a large-batch rule, or '' (--large-batch auto
        leaves the rule off for the same reasons)."""
        return ("--mode geo pushes deltas, not row gradients" if self.mode == "geo" else
                "--row-clip is a clip of its own (drop it)" if self.row_clip else
                "--dense-lr-scale sets the dense rate the rule sets (drop it)"
                if self.dense_lr_scale else
                f"--sync-sparse-lr {self.sync_sparse_lr} sums the workers' pushes (the rule "
                f"adds its L2 to each push: use each)" if self.sync_sparse_lr != "each" else "")

    def check_simulate(self):
        """--simulate-workers W runs alone in one process (docs/modes.md, Simulator)."""
        if not self.simulate_workers:
            if self.sim_delay != 0 or self.sim_sparse != "async":
                raise ValueError("--sim-delay and --sim-sparse set the simulator: give "
                                 "--local --simulate-workers W too")
            return
        if self.simulate_workers < 0 or not 0 <= self.sim_delay <= 64:
            raise ValueError(f"--simulate-workers must be >= 0 and --sim-delay in [0, 64]; "
                             f"got {self.simulate_workers}, {self.sim_delay}")
        if self.sim_sparse not in SIM_SPARSE:
            raise ValueError(f"--sim-sparse must be one of {', '.join(SIM_SPARSE)}; got "
                             f"{self.sim_sparse!r}")
        why = ("--local is missing (the simulator runs in one process)" if not self.local else
               f"--local-workers {self.local_workers} reads the data its own way (drop it)"
               if self.local_workers > 1 else
               "--mode geo trains local copies (use async or sync)" if self.mode == "geo" else
               "--stream trains passes, not epochs (use --train)" if self.stream else
               f"--save-every {self.save_every} saves mid-epoch (use 'epoch')"
               if self.save_every != "epoch" else "")
        if why:
            raise ValueError(f"--simulate-workers {self.simulate_workers}: {why}")

    def check_schema(self):
        """The --schema file loads and fits --data-format (which names the Criteo readers)."""
        if not self.schema:
            return
        schema = load_schema(self.schema)
        if self.data_format != "auto" and not schema.is_criteo:
            raise ValueError(f"--data-format {self.data_format} is for the default Criteo "
                             f"schema; --schema {self.schema} says format = "
                             f"{schema.format!r} (drop --data-format)")

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no 40-option usage), and that says
    which option an unknown one may be a typo of."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            typos = [a.split("=")[0] for a in message.split(": ", 1)[1].split()
                     if a.startswith("--")]
            hints = [(t, h) for t in typos if (h := did_you_mean(t, known))]
            if len(hints) == 1:
                message += f" (did you mean {hints[0][1]}?)"
            elif hints:
                message += " (" + "; ".join(f"{t}: did you mean {h}?" for t, h in hints) + ")"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Flag(argparse.BooleanOptionalAction):
    """--x / --no-x, its help as written (Python 3.10 would add its own default)."""

    def __init__(self, *args, help=None, **kw):
        super().__init__(*args, help=help, **kw)
        self.help = help


def did_you_mean(name, known):
    """The closest of `known` to a mistyped `name` (difflib), or None."""
    return next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.6)), None)


def _help(f):
    """A field's help with its default, unless the text already says it or it is empty."""
    text = f.metadata["help"]
    if "default" in text or f.default == "":
        return text
    shown = ("on" if f.default else "off") if f.type is bool else f.default
    return f"{text} (default: {shown})"


def build_parser(prog="python -m mpips.train"):
    p = _Parser(prog=prog, description="Parameter-server training of CTR-DNN over MPI.")
    p.add_argument("--config", default="", help="TOML file whose keys mirror these flags "
                   "(flags given on the command line win)")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kw = dict(default=f.default, help=_help(f))
        if f.type is bool:
            kw["action"] = _Flag
        else:
            kw["type"] = f.type
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        p.add_argument(flag, **kw)
    return p


def _from_toml(path):
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file")
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML ({e})")
    names = {f.name: f for f in dataclasses.fields(Config)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in names:
            hint = did_you_mean(name, list(names))
            hint = hint.replace("_", "-") if hint and "-" in key else hint
            raise ValueError(f"--config {path}: unknown key {key!r}" + (
                f" (did you mean {hint!r}?)" if hint else
                f" (known: {', '.join(sorted(names))})"))
        typ = names[name].type
        want = (int, float) if typ is float else typ
        if not isinstance(value, want) or (typ is not bool and isinstance(value, bool)):
            raise ValueError(f"--config {path}: key {key!r} must be {typ.__name__}; got {value!r}")
        out[name] = float(value) if typ is float else value
    return out


def _given_flags(argv, prog):
    """Names of the options written on the command line (even when equal to the default)."""
    quiet = build_parser(prog)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def parse_args(argv=None, prog="python -m mpips.train"):
    """Parse flags (and the TOML file they name) into a validated Config."""
    parser = build_parser(prog)
    if any(a.split("=")[0] == "--dense-every" for a in (argv or [])):
        raise ValueError("--dense-every is retired: dense weights are replicated on the "
                         "workers and updated every step (docs/modes.md); drop the flag")
    args = parser.parse_args(argv)
    given = _given_flags(argv, prog)
    values = {}
    if args.config:
        values.update(_from_toml(args.config))
    if ((args.global_batch if "global_batch" in given else values.get("global_batch"))
            and ("batch_size" in given or "batch_size" in values)):
        raise ValueError("--global-batch G and --batch-size B exclude each other (G sets each "
                         "worker's batch to G / W): give one")
    for f in dataclasses.fields(Config):
        if f.name in given or f.name not in values:
            values[f.name] = getattr(args, f.name)
    return Config(**values).validate()


PIPE_TIMEOUT = 90.0     # --pipe-timeout 0: this, or PIPE_SHARE x --peer-timeout when less
PIPE_SHARE = 0.75


def pipe_timeout(cfg):
    """The seconds a --pipe-command may send nothing: --pipe-timeout, or (0) PIPE_TIMEOUT s,
    below --peer-timeout (PIPE_SHARE of it) when that is shorter: the pipe's own line, which
    names the file and the command, comes before the servers' silence timeout."""
    return cfg.pipe_timeout or min(PIPE_TIMEOUT, PIPE_SHARE * cfg.peer_timeout)


def parse_fc(value):
    """Hidden layer sizes from --fc ("400,400,400"), or from a stored list of them."""
    if isinstance(value, str):
        return tuple(int(x) for x in value.split(",") if x.strip())
    return tuple(int(x) for x in value)

