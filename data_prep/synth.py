"""CLI over :mod:`mpips.data.synth` (the generator lives in mpips: the embedded dataset of
``python -m mpips.train`` is made there).

    python -m data_prep.synth --rows N --out DIR --parts P --seed S [--test-rows M]
"""
import argparse

from mpips.data.synth import (N_CAT, VERSION, Model, _sigmoid, _split_rows,  # noqa: F401
                              auc, ensure_default_dataset, format_lines, generate)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_prep.synth",
                                 description="Write a synthetic Criteo-format data set.")
    ap.add_argument("--rows", type=int, required=True, help="training rows")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--parts", type=int, default=4, help="files per split (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-rows", type=int, default=0, help="test rows (default 0: none)")
    args = ap.parse_args(argv)
    try:
        meta = generate(args.out, args.rows, args.parts, args.seed, args.test_rows)
    except ValueError as exc:
        ap.error(str(exc))
    for split in ("train", "test"):
        if split in meta:
            m = meta[split]
            print(f"{split}: {m['rows']} rows in {args.parts} parts, ctr {m['ctr']:.4f}, "
                  f"best achievable auc {m['best_auc']:.4f}")
    print(f"wrote {args.out} in {meta['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
