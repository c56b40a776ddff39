"""Factories: what a run is made of, built from the config.

``resolve_data`` (the file lists), ``make_reader`` (a DataReader with the config's data
settings), ``make_schema`` (the feature schema), ``make_model`` (the ``--model`` network over it) and
``make_tables`` (a sparse table, behind an admission filter when ``--entry`` is set, and a
dense slice).  Local runs, servers, workers and ``mpips.infer`` build their parts here.
"""
import atexit
import dataclasses
import math
from dataclasses import dataclass
import os
import sys

from mpips.config import AUTO_K, COWCLIP, parse_large_batch, pipe_timeout
from mpips.data.synth import ensure_default_dataset
from mpips.data.files import resolve_paths
from mpips.data.reader import DataReader
from mpips.data.binary import load_stats
from mpips.models.zoo import make_net
from mpips.schema import Schema, load_schema
from mpips.tables.admission import AdmittedTable
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.tables.staleness import SMALL_W
from mpips.tables.tiered import TieredTable
from mpips.tiering import parse_size, tier_dir


def resolve_data(cfg):
    """(train_files, test_files) from the config; the embedded synthetic set if none given."""
    if not cfg.train:
        train_dir, test_dir = ensure_default_dataset(
            os.path.expanduser(cfg.cache_dir), rows=cfg.synth_rows,
            test_rows=cfg.synth_test_rows, parts=8, seed=0)
        return resolve_paths(train_dir), resolve_paths(test_dir)
    return resolve_paths(cfg.train), (resolve_paths(cfg.test) if cfg.test else [])


def make_schema(cfg) -> Schema:
    """The run's schema: ``--schema FILE`` (default Criteo), with ``--pipe-command`` applied."""
    schema = load_schema(cfg.schema) if cfg.schema else Schema.criteo()
    if cfg.pipe_command:
        schema = dataclasses.replace(schema, pipe_command=cfg.pipe_command)
    return schema


def make_reader(cfg, files, batch_size, warn, shuffle=None, norm=None, schema=None,
                has_label=True):
    """A DataReader of `files` with the run's schema (or ``schema``: mpips.infer reads with
    the checkpoint's; ``has_label=False``: files without the label column, as
    ``mpips.infer --no-label`` reads); shuffle=(epoch, worker) shuffles rows with --shuffle;
    norm=(cont_min, cont_diff) instead of the --stats file's (the values a checkpoint
    recorded)."""
    cont_min = cont_diff = None
    schema = schema or make_schema(cfg)
    if norm is not None:
        cont_min, cont_diff = norm
    elif cfg.stats:
        cont_min, cont_diff = load_stats(cfg.stats, schema.n_dense)
    window, seed = 0, None
    if cfg.shuffle and shuffle is not None:
        window, seed = cfg.shuffle_window, [cfg.seed, *shuffle]
    return DataReader(files, batch_size, fmt=cfg.data_format, strict=cfg.strict,
                      hash_bucket=cfg.hash_bucket, prefetch=cfg.prefetch, warn=warn,
                      cont_min=cont_min, cont_diff=cont_diff, shuffle_window=window,
                      shuffle_seed=seed, max_bad_fraction=cfg.max_bad_fraction,
                      schema=schema, has_label=has_label, pipe_timeout=pipe_timeout(cfg))


@dataclass(frozen=True)
class CowClip:
    """``--large-batch cowclip`` resolved for a run of global batch G (once, by the run's
    plan: ``RunPlan.cowclip``): k = G / base, the power ``dense`` of k that scales the dense
    lr (:attr:`dense_scale`; the rate is :func:`dense_lr`'s), the clip's ratio r and floor
    zeta, the rows' L2 (``l2`` x k) and the dense warm-up in dense steps."""
    k: float
    dense: float
    r: float
    zeta: float
    l2: float
    warmup: int

    @property
    def dense_scale(self):
        """The dense lr's factor, k^dense."""
        return self.k ** self.dense


def large_batch_rule(cfg, batches):
    """The CowClip of ``cfg``'s ``--large-batch`` for a run of these worker ``batches`` (the
    global batch G is their sum), or None (off; --large-batch auto: see auto_rule_off)."""
    if cfg.large_batch == "auto":
        spec = None if auto_rule_off(cfg, batches) else dict(COWCLIP)
    else:
        spec = parse_large_batch(cfg.large_batch)
    if spec is None:
        return None
    k = sum(batches) / cfg.large_batch_base
    return CowClip(k=k, dense=spec["dense"], r=spec["r"], zeta=spec["zeta"], l2=spec["l2"] * k,
                   warmup=spec["warmup"])


def auto_batch(cfg, global_batch):
    """Whether ``global_batch`` is one ``--large-batch auto`` serves: AUTO_K x the base on."""
    return global_batch >= AUTO_K * cfg.large_batch_base


def auto_rule_off(cfg, batches):
    """Why ``--large-batch auto`` leaves CowClip off for a run of these worker batches, or
    '' when it applies it: from a global batch G of AUTO_K x --large-batch-base on, where the
    rule was measured to gain (one worker, or W workers sharing --global-batch G: docs/
    studies/scaling-with-w.md, 'A large-batch rule'), and the run's flags allow it."""
    G, W = sum(batches), len(batches)
    if not auto_batch(cfg, G):
        return f"the global batch {G} is below {AUTO_K} x --large-batch-base {cfg.large_batch_base}"
    if W > 1 and not cfg.global_batch:
        return (f"{W} workers x --batch-size {cfg.batch_size} (the rule was measured with "
                f"--global-batch or one worker: give --large-batch cowclip to apply it)")
    return cfg.large_batch_conflict()


def dense_lr(cfg, n_batches, cowclip=None):
    """The dense weights' learning rate: ``--lr`` x ``--dense-lr-scale``, or by
    ``--dense-lr-rule`` from W, the batches one dense step averages (W workers', or
    ``--local-workers W``; GEO: each worker's own, so 1): x W (linear), x sqrt(W) (sqrt), or
    auto (the default): x W up to SMALL_W = 4, x sqrt(W) beyond, where x W diverges.  A
    dense step of W x B examples comes W times less often than one process's; Adam's steps
    do not grow with the batch's gradient, so its rate needs scaling (docs/modes.md).
    With ``--global-batch G`` the rule follows G, not W: a dense step averages G examples
    at any W, as one process's step of batch G does, so the rate is that process's,
    ``--lr`` (x 1): the dense steps of W workers at G match ``--local --batch-size G``.
    With ``--large-batch cowclip``: ``--lr`` x (G / --large-batch-base)^dense, G the global
    batch: ``cowclip``, the run's rule as its plan resolved it (``RunPlan.cowclip``)."""
    if cowclip is not None:
        return cfg.lr * cowclip.dense_scale
    if cfg.large_batch not in ("none", "auto"):
        raise ValueError("dense_lr: --large-batch is on: pass the rule the run's plan "
                         "resolved (RunPlan.cowclip)")
    if cfg.dense_lr_scale:
        return cfg.lr * cfg.dense_lr_scale
    if cfg.mode == "geo" or n_batches <= 1 or cfg.global_batch:
        return cfg.lr
    rule = cfg.dense_lr_rule
    if rule == "auto":
        rule = "linear" if n_batches <= SMALL_W else "sqrt"
    return cfg.lr * (n_batches if rule == "linear" else math.sqrt(n_batches))


def make_tables(cfg, model, lo=0, hi=None, dense_batches=1, cowclip=None, tag="local"):
    """The sparse table and the dense slice [lo:hi) of the initial parameters, its optimizer
    at :func:`dense_lr` for a dense step over ``dense_batches`` batches (``cowclip``: the
    plan's --large-batch rule).  With --table-memory the sparse table is a TieredTable
    whose store folder (named after ``tag``, e.g. the rank) is removed at exit."""
    opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr, initial_accumulator=cfg.adagrad_init)
    sparse = SparseTable(model.row_dim, opt, seed=cfg.seed, init_range=cfg.init_range)
    if cfg.table_memory:
        sparse = TieredTable(sparse, parse_size(cfg.table_memory), tier_dir(cfg.table_dir),
                             tag=tag)
        atexit.register(sparse.close)
        if sparse.store.swept:
            print(f"mpips: removed {len(sparse.store.swept)} disk-tier folder(s) left by a "
                  f"killed run: {' '.join(sparse.store.swept)}", file=sys.stderr, flush=True)
    if cfg.entry:
        sparse = AdmittedTable(sparse, cfg.entry, cfg.seed)
    dense = DenseTable(model.init_params(cfg.seed)[lo:hi].copy(),
                       dataclasses.replace(opt, lr=dense_lr(cfg, dense_batches, cowclip)),
                       cfg.dense_average)
    return sparse, dense


def make_model(cfg, schema=None, hidden=None):
    """The ``--model`` network over the schema's inputs (default: the config's schema) with
    hidden layers of ``hidden`` sizes (default: the config's --fc)."""
    return make_net(cfg.model, schema or make_schema(cfg), cfg.embedding_dim,
                    cfg.hidden if hidden is None else hidden)
