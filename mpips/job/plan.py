"""The run worked out once: ``make_plan`` resolves a Config into a :class:`RunPlan`.

``python -m mpips.train`` makes the plan at the top (on every rank; the checkpoint to
continue from is chosen by rank 0) and passes it down: the feature schema (``--schema``
read once, ``--pipe-command`` applied), the hidden sizes (``--fc`` parsed once), the
network, the width of one process's dense step, the sync rule, the checkpoint to continue
from with its manifest and position (checked once against the run: ``mpips.checkpoint.compat``
and ``mpips.job.resume``), the data files, and the debug hooks read from the environment
at the entry point (``mpips.job.hooks``).  The parts below take the fields they read: the
trainer its :func:`trainer_settings`, the readers the plan's schema.
"""
import dataclasses
from dataclasses import dataclass, field

from mpips.checkpoint.compat import check_kind, check_resume
from mpips.comm.cluster import default_servers
from mpips.checkpoint.manifest import chain_manifests
from mpips.config import AUTO_K, Config, split_batch, stale_power
from mpips.data.files import resolve_paths
from mpips.job.build import (CowClip, auto_batch, auto_rule_off, dense_lr, large_batch_rule, make_model,
                             make_schema, resolve_data)
from mpips.job.hooks import NONE, Hooks
from mpips.job.resume import (StreamAt, checked_meta, choose_at_start, first_rank_decides, pin,
                              start_point, stream_at)
from mpips.schema import Schema
from mpips.tables.ownership import plan_keys
from mpips.tables.staleness import STALE_AUTO_W, counts_staleness, stale_rule
from mpips.worker.geo import GeoTrainer
from mpips.worker.late import LateTrainer
from mpips.worker.trainer import Trainer


@dataclass(frozen=True)
class TrainerSettings:
    """The settings a Trainer (and a GeoTrainer) reads: no more of the Config."""
    print_every: int
    entry: str                  # --entry: admission (pulls carry occurrence counts)
    row_clip: float
    row_clip_floor: float
    sync_sparse_lr: str
    optimizer: str              # GEO: the worker's local optimizer
    lr: float
    adagrad_init: float
    seed: int
    init_range: float
    geo_steps: int
    stream: str                 # GEO: rounds end at --save-every points of batch runs
    save_dir: str
    save_steps: int
    dense_average: float        # --dense-average B (GEO: evaluates the servers' average)
    cowclip: CowClip = None     # --large-batch cowclip as the plan resolved it, or None


def trainer_settings(cfg, cowclip=None) -> TrainerSettings:
    """The TrainerSettings of ``cfg``; ``cowclip``: its --large-batch rule as the run's plan
    resolved it (``RunPlan.cowclip``; None: the rule is off)."""
    if cowclip is None and cfg.large_batch not in ("none", "auto"):
        raise ValueError("trainer_settings: --large-batch is on: pass the rule the run's "
                         "plan resolved (RunPlan.cowclip)")
    return TrainerSettings(**{f.name: getattr(cfg, f.name)
                              for f in dataclasses.fields(TrainerSettings)
                              if f.name != "cowclip"}, cowclip=cowclip)


PULL_EXCHANGE_W = 4     # --pull-after auto: the pull after the dense exchange from 4 workers


def pull_choice(cfg, workers):
    """Whether an async job's pull order is a choice: async, 2+ workers, neither
    --overlap-pull nor --dense-lag (otherwise the pull goes in the push, or ahead of it)."""
    return cfg.mode == "async" and workers >= 2 and not (cfg.overlap_pull or cfg.dense_lag)


def pull_after(cfg, workers):
    """When an async worker pulls the next step's rows: "exchange" (after the dense
    exchange, so they hold every worker's push of the step) or "push" (in the message of its
    own push).  ``--pull-after auto``: push up to 3 workers, exchange from PULL_EXCHANGE_W:
    at G = 4096 the pull in the push lost 0.0017 AUC at 4 and 8 workers and 0.0005 at 2, the
    pull after the exchange 0.0005 at 4 and 8 (docs/studies/scaling-with-w.md).  Only async
    with 2+ workers and neither --overlap-pull nor --dense-lag has the choice ("push")."""
    if not pull_choice(cfg, workers) or cfg.pull_after == "push":
        return "push"
    return "exchange" if cfg.pull_after == "exchange" or workers >= PULL_EXCHANGE_W else "push"


def is_sync(cfg):
    """Do the servers apply steps BSP (sync mode, or ssp with staleness 0)?"""
    return cfg.mode == "sync" or (cfg.mode == "ssp" and cfg.staleness == 0)


@dataclass(frozen=True)
class RunPlan:
    cfg: Config                   # --resume pinned to the checkpoint chosen
    schema: Schema                # --schema (default Criteo), --pipe-command applied
    hidden: tuple                 # --fc
    model: object = field(compare=False, repr=False)   # the --model network over schema
    width: int = 1                # batches one process's dense step averages: W of
                                  # --simulate-workers W, else of --local-workers W
    workers: int = 1              # the run's workers: the ranks less the servers, or width
    batches: tuple = ()           # each worker's batch: its share of --global-batch, or
                                  # --batch-size (split_batches)
    sync: bool = False            # the servers apply steps BSP (is_sync)
    resume: str = None            # the checkpoint directory to continue from, or None
    manifest: dict = field(default=None, compare=False, repr=False)   # its manifest
    start: tuple = (0, 0)         # batch run: (epoch, batches of it already trained)
    stream_at: StreamAt = StreamAt()   # stream: where the checkpoint left it (the last pass
                                  # it holds; the pass it stopped in, and how far)
    train_files: list = None      # None until with_data (a stream: none)
    test_files: list = None
    hooks: Hooks = NONE
    cowclip: CowClip = None       # --large-batch cowclip at the global batch, or None: the
                                  # rule resolved once (large_batch_rule), read by all

    @property
    def global_batch(self):
        """The examples of one step over all workers: --global-batch, or W x --batch-size."""
        return sum(self.batches)

    def batch_line(self):
        """The start line: which batch flag is in force, what each worker takes, and the
        dense learning rate that follows from it."""
        cfg, W = self.cfg, len(self.batches)
        rate = f"; dense learning rate {dense_lr(cfg, W, self.cowclip):g}"
        if not cfg.global_batch:
            return (f"mpips: batch: --batch-size {cfg.batch_size} a worker x {W} "
                    f"worker(s) = global batch {self.global_batch}{rate}")
        q, r = divmod(cfg.global_batch, W)
        first = "worker 0" if r == 1 else f"workers 0-{r - 1}"
        share = f"{q} each" if not r else f"{q + 1} for {first}, {q} for the other {W - r}"
        return f"mpips: batch: --global-batch {cfg.global_batch} over {W} worker(s): {share}{rate}"

    def rule_line(self):
        """The start line of --large-batch: k and what follows, or why auto leaves the rule
        off at a global batch it would serve; None when the rule is off and that is all."""
        rule, cfg = self.cowclip, self.cfg
        if rule is None:
            why = auto_rule_off(cfg, self.batches) if cfg.large_batch == "auto" else ""
            if not why or not auto_batch(cfg, self.global_batch):
                return None
            return f"mpips: large batch: auto leaves cowclip off: {why}"
        lr = dense_lr(cfg, len(self.batches), rule)
        name = (f"cowclip (auto: the global batch is at least {AUTO_K} x "
                f"--large-batch-base)" if cfg.large_batch == "auto" else cfg.large_batch)
        return (f"mpips: large batch: {name} at k = {self.global_batch} / "
                f"{cfg.large_batch_base} = {rule.k:g}: dense lr {lr:g} (--lr x "
                f"k^{rule.dense:g}) warmed up over {rule.warmup} dense steps, rows' lr "
                f"{cfg.lr:g}, rows' L2 {rule.l2:g}, rows clipped to count x "
                f"max({rule.r:g} |row|, {rule.zeta:g})")

    @property
    def pull_order(self):
        """The run's :func:`pull_after` ("push" or "exchange"), None when there is no choice."""
        return pull_after(self.cfg, self.workers) if pull_choice(self.cfg, self.workers) \
            else None

    def pull_line(self):
        """The start line of an async job's pull order (None when there is no choice)."""
        cfg, W, order = self.cfg, self.workers, self.pull_order
        if order is None:
            return None
        why = (f"--pull-after auto at {W} workers" if cfg.pull_after == "auto"
               else f"--pull-after {cfg.pull_after}")
        what = ("after the dense exchange: the rows hold every worker's push of the step, "
                "two messages a server a step" if order == "exchange" else
                "in the push's message: one a server a step, the rows miss the pushes that "
                "arrive after it")
        return f"mpips: async pull: {what} ({why})"

    def stale_line(self):
        """The start line of the pushed rows' staleness damping (--stale-lr) when a run's
        servers (or the simulator) apply one; None when they apply none."""
        cfg = self.cfg
        rule = stale_rule(cfg.stale_lr, self.workers)
        power = stale_power(rule)
        counted = (cfg.simulate_workers and cfg.sim_sparse == "async" if cfg.local else
                   counts_staleness(cfg.mode, cfg.staleness))
        if power == 0.0 or not counted:
            return None
        why = (f"--stale-lr auto: {self.workers} workers, more than {STALE_AUTO_W}"
               if cfg.stale_lr == "auto" else f"--stale-lr {rule}")
        what = {"inverse": "1 / (1 + s)", "sqrt": "1 / sqrt(1 + s)"}.get(
            rule, f"(1 + s)^-{power:g}")
        return (f"mpips: staleness damping: each pushed row's lr x {what} for the s updates "
                f"the row took since its pull ({why})")

    def with_data(self):
        """This plan with its file lists (the embedded dataset made on first use: one rank
        makes it, the others wait for it); unchanged when they are known or a stream."""
        if self.train_files is not None:
            return self
        train, test = ([], []) if self.cfg.stream else resolve_data(self.cfg)
        start = self.start
        if self.resume and not self.cfg.stream:     # a mid-epoch position, against them
            start = start_point(self.cfg, self.resume, self.manifest, train, self.workers,
                                piped=bool(self.schema.pipe_command))
        return dataclasses.replace(self, train_files=train, test_files=test, start=start)


def make_plan(cfg, comm=None, hooks=NONE):
    """The RunPlan of ``cfg`` (see the module docstring).  The checkpoint to continue from is
    chosen once, on rank 0 of ``comm`` (the newest in a root whose whole chain verifies),
    and pinned as ``--resume`` so that every rank loads that one; its chain must agree with
    itself and with this run on every setting that changes what its numbers mean, and its
    position must lie in this run (and in its data, when they are given).  Raises
    ValueError (CheckpointError, SchemaError) with the fix."""
    schema = make_schema(cfg)            # a bad --schema file fails here, before any work
    if not schema.label:
        raise ValueError(f"{cfg.schema or 'the schema'}: label = \"\" (no label): training "
                         f"needs each example's 0/1 label; name its column or slot (scoring "
                         f"without labels is for python -m mpips.infer and serving)")
    path = first_rank_decides(comm, lambda: choose_at_start(cfg))
    elements = manifest = None
    if path:
        elements = chain_manifests(path)          # read once: its last is path's manifest
        manifest = elements[-1][1]
        check_kind(cfg, path, manifest)           # before pinning: --resume naming it allows it
    cfg = pin(cfg, path)
    train, test = _given_files(cfg)
    width = cfg.simulate_workers or cfg.local_workers
    workers = width
    if comm is not None and comm.size > 1:
        workers = comm.size - (cfg.servers or default_servers(comm.size))
    batches = split_batches(cfg, workers)          # G < W: the one-line error, here
    start, at = (0, 0), StreamAt()
    if cfg.resume:
        check_resume(elements, cfg, schema)
        at = stream_at(checked_meta(path, manifest, cfg))
        start = start_point(cfg, path, manifest, train, workers, piped=bool(schema.pipe_command))
    hidden = cfg.hidden
    return RunPlan(cfg=cfg, schema=schema, hidden=hidden,
                   model=make_model(cfg, schema, hidden),
                   width=width, workers=workers, batches=batches, sync=is_sync(cfg),
                   resume=path, manifest=manifest, start=start, stream_at=at,
                   train_files=train, test_files=test, hooks=hooks,
                   cowclip=large_batch_rule(cfg, batches))


def split_batches(cfg, workers):
    """Each of ``workers`` workers' batch: its share of ``--global-batch G`` (G // W, the
    first G % W one more: ``config.split_batch``), else ``--batch-size``."""
    if cfg.global_batch:
        return tuple(split_batch(cfg.global_batch, workers))
    return (cfg.batch_size,) * workers


def _given_files(cfg):
    """(--train files, --test files) when --train names files that resolve, else (None, None):
    the embedded dataset (made at the run's start), a stream, or paths the run reports."""
    if cfg.stream or not cfg.train:
        return None, None
    try:
        return resolve_paths(cfg.train), (resolve_paths(cfg.test) if cfg.test else [])
    except OSError:
        return None, None


def make_trainer(cfg, model, ps, n_servers, log=None, replica=None, n_workers=1,
                 dense_sync=None, client=False, cowclip=None):
    """The Trainer of ``cfg``'s run (GEO: a GeoTrainer of ``n_workers``' deltas) of ``model``
    against parameter store ``ps``, its ids planned over ``n_servers``; ``replica``: the
    dense weights it trains (GEO: none, it keeps its own).  ``client``: ``ps`` is the
    servers (a PSClient), so --overlap-pull and the servers' sync rule apply, and async and
    ssp send a step's push and the next step's pull as one message a server; in one process
    (a LocalPS) they do not.  ``cowclip``: the run's --large-batch rule (``RunPlan.cowclip``)."""
    settings = trainer_settings(cfg, cowclip)

    def plan_fn(ids):
        return plan_keys(ids, n_servers)

    if cfg.mode == "geo":
        return GeoTrainer(settings, model, ps, plan_fn, log=log, n_workers=n_workers)
    overlap = client and cfg.mode == "async" and cfg.overlap_pull
    sync = client and is_sync(cfg)
    late = client and cfg.dense_lag and dense_sync is not None   # --dense-lag 1: async
    pull_late = (client and dense_sync is not None
                 and pull_after(cfg, n_workers) == "exchange")
    return (LateTrainer if late else Trainer)(
        settings, model, ps, plan_fn, log=log, replica=replica, overlap=overlap,
        dense_sync=dense_sync, sync=sync, coalesce=client and not (overlap or sync or pull_late),
        pull_late=pull_late)
