"""Text of any schema -> binary data parts (bags of ids), read back memory-mapped.

    python -m data_prep.parts --schema S.toml --input DATA --out OUT [--rows-per-part N]
        [--hash-bucket B] [--stats FILE] [--pipe-command CMD]

reads ``DATA`` (a file, folder, glob or comma list; gzip and ``--pipe-command`` as the
trainer reads them) with the schema's reader and writes one split directory ``OUT``
(``mpips.data.bagparts``: the schema, dense values as read, ids and bag offsets).  Train
with ``--train OUT --schema S.toml``: the parts give the same batches as the text.  Bad
lines are skipped, counted and reported as the trainer does.  Criteo's raw layout with
statistics and a validation split is ``data_prep.criteo``.
"""
import argparse
import dataclasses
import os
import sys

from mpips.data import bagparts
from mpips.data.binary import load_stats
from mpips.data.reader import DataReader
from mpips.schema import load_schema

READ_ROWS = 1 << 16  # rows per piece taken from the reader


def prepare(inputs, out: str, schema, *, rows_per_part: int = 1 << 20, hash_bucket: int = 0,
            stats: str = "", warn=None) -> dict:
    """Write ``inputs`` as a bags split in ``out``; returns the manifest."""
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"--out {out} exists and is not empty (give a new directory)")
    if rows_per_part < 1:
        raise ValueError(f"--rows-per-part must be >= 1; got {rows_per_part}")
    lo = diff = None
    if stats:
        lo, diff = load_stats(stats, schema.n_dense)
    rd = DataReader(inputs, READ_ROWS, schema=schema, hash_bucket=hash_bucket, prefetch=False,
                    cont_min=lo, cont_diff=diff, warn=warn)
    pieces = ((b.dense, b.sparse, b.label, b.offsets) for b in rd)
    man = bagparts.write_split(out, pieces, schema, rows_per_part=rows_per_part,
                               has_label=bool(schema.label), hash_bucket=hash_bucket)
    man["bad_lines"] = rd.stats.bad_lines
    return man


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_prep.parts", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schema", required=True, help="the schema TOML the text is read with")
    ap.add_argument("--input", required=True, help="file, folder, glob or comma list")
    ap.add_argument("--out", required=True, help="the split directory to write (new or empty)")
    ap.add_argument("--rows-per-part", type=int, default=1 << 20, help="rows per part")
    ap.add_argument("--hash-bucket", type=int, default=0, help="0 = full int64 ids")
    ap.add_argument("--stats", default="", help="cont_min/cont_diff JSON for minmax dense")
    ap.add_argument("--pipe-command", default="", help="feed each file to this command")
    a = ap.parse_args(argv)
    try:
        schema = load_schema(a.schema)
        if a.pipe_command:
            schema = dataclasses.replace(schema, pipe_command=a.pipe_command)
        man = prepare(a.input, a.out, schema, rows_per_part=a.rows_per_part,
                      hash_bucket=a.hash_bucket, stats=a.stats)
    except (ValueError, OSError) as e:
        print(f"data_prep.parts: error: {e}", file=sys.stderr)
        return 1
    print(f"data_prep.parts: {man['rows']} rows in {len(man['parts'])} parts -> {a.out} "
          f"({man['bad_lines']} bad lines skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
