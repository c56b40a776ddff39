"""`python -m mpips.export`: turn a checkpoint into a serving bundle or a patch.

    python -m mpips.export --checkpoint ckpts/ --out model.h5
    python -m mpips.export --checkpoint ckpts/ --out model16.h5 --dtype float16
    python -m mpips.export --checkpoint ckpts/ckpt-000005-delta --since model.h5 --out p5.h5

``--checkpoint`` (old name ``--model``, still taken, with a note) is a checkpoint directory
or a root (its latest committed checkpoint).  The
bundle holds the dense weights, the sparse ids and their embeddings (no optimizer
state), the model config, the data settings (format, ``hash_bucket``, normalisation)
and a CRC-32 per dataset (format: ``mpips.serving.bundle``).  ``--since BUNDLE`` writes a patch
instead: the rows changed and ids evicted in the delta checkpoints after the one BUNDLE
was made from.  The normalisation is the values the checkpoint recorded from its run's
``--stats``; ``--stats`` is needed only for a checkpoint from before they were recorded
(version 1) whose statistics file has moved, and must hold the recorded values when
there are some.  One line on stderr and exit 1 on failure.
"""
import argparse
import os
import sys
import time

import mpips.serving.bundle as bd
from mpips.checkpoint import read_manifest, resolve
from mpips.checkpoint.compat import check_wanted
from mpips.checkpoint.load import add_checkpoint_option, checkpoint_arg
from mpips.config import MODELS

PROG = "python -m mpips.export"


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description="Export a mpips checkpoint for serving.")
    add_checkpoint_option(p)
    p.add_argument("--out", required=True, help="bundle (or patch) file to write")
    p.add_argument("--dtype", default="float32", choices=bd.DTYPES,
                   help="storage type of the embedding values (default: float32; float16 halves "
                   "them, the dense weights stay float32)")
    p.add_argument("--since", default="", help="write a patch from this bundle or patch")
    p.add_argument("--stats", default="", help="normalisation statistics (stats.json); "
                   "default: the values the checkpoint recorded from its run's --stats, "
                   "else Paddle's constants")
    p.add_argument("--network", default="", choices=("",) + MODELS, help="the network the "
                   "checkpoint must hold: dnn, wide_deep or deepfm (default: the one stored in it)")
    p.add_argument("--schema", default="", help="feature schema TOML the predictor will read; "
                   "it must be the checkpoint's (default: the schema stored in it)")
    return p


def run(args, log=print):
    t0 = time.perf_counter()
    path = resolve(args.checkpoint)       # a root: its newest checkpoint that verifies, chosen once
    check_wanted(read_manifest(path), path, getattr(args, "network", ""), args.schema)
    if args.since:
        m = bd.export_patch(path, args.since, args.out, args.dtype, args.stats)
    else:
        m = bd.export_full(path, args.out, args.dtype, args.stats)
    what = f"patch {m['since']['name']} -> " if m["kind"] == "patch" else "bundle of "
    log(f"EXPORT --> {args.out}: {what}{m['checkpoint']['name']}, {m['rows']} rows, "
        f"{m['evicted']} evicted, {m['dtype']}, {os.path.getsize(args.out)} bytes, "
        f"{time.perf_counter() - t0:.2f} s")
    return m


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    checkpoint_arg(parser, args, lambda s: print(s, file=sys.stderr, flush=True))
    try:
        run(args, log=lambda s: print(s, flush=True))
        return 0
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - the boundary of the program
        print(f"mpips.export: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
