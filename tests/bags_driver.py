"""Run ``python -m mpips.train`` on multi-hot batches stored as ``.npz`` files (a test aid).

    python tests/bags_driver.py --schema S.toml --train DIR ... (any mpips.train flags)
    mpiexec -n 4 python tests/bags_driver.py ...
    mpiexec -n 2 python tests/bags_driver.py infer --checkpoint CKPT --data DIR ... (mpips.infer)

Every ``make_reader`` of the run (local and distributed, training, evaluation and the
kernel warm-up) is
replaced by ``NpzBags``: the files' rows in order, cut into batches of exactly
``batch_size`` rows (the last one shorter) that span files, as ``DataReader`` cuts them,
each a CSR ``Batch`` (ids + offsets).  So the real trainer, servers and MPI paths run on
bags without a text reader.  ``write_parts`` makes such files with a hidden click model.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpips.job import loop as runner  # noqa: E402
from mpips.job import warmup  # noqa: E402
from mpips.data.reader import Batch  # noqa: E402


def write_parts(out, parts, rows, n_slots, n_dense, seed, max_len=6, vocab=300):
    """``parts`` files ``part-K.npz`` of ``rows`` examples: bags of 0..max_len ids per slot
    (about 1 in 5 empty), Zipf-like ids, labels from a hidden logistic model (the same for
    every seed, so sets written with other seeds are train and test sets of one task)."""
    w = np.random.default_rng(12345).standard_normal((n_slots, vocab))
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    for k in range(parts):
        lens = rng.integers(1, max_len + 1, rows * n_slots)
        lens[rng.random(rows * n_slots) < 0.2] = 0
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        raw = np.minimum(rng.zipf(1.3, offsets[-1]) - 1, vocab - 1)
        slot = np.repeat(np.tile(np.arange(n_slots), rows), lens)
        score = np.zeros(rows)
        np.add.at(score, np.repeat(np.arange(rows), np.diff(offsets).reshape(rows, -1).sum(1)),
                  w[slot, raw])
        dense = rng.random((rows, n_dense)).astype(np.float32)
        score += dense.sum(1) - n_dense / 2
        label = (rng.random(rows) < 1 / (1 + np.exp(-score))).astype(np.float32)
        ids = raw.astype(np.int64) * 1_000_003 + slot * 7 + 11   # ids distinct per slot
        np.savez(os.path.join(out, f"part-{k:03d}.npz"), dense=dense, sparse=ids, label=label,
                 offsets=offsets)


class _Stats:
    text_rows = text_bytes = 0


class NpzBags:
    """Batches of ``batch_size`` rows over the CSR ``.npz`` files, in file order."""

    def __init__(self, cfg, files, batch_size, warn=None, shuffle=None, **_):
        self.files, self.batch_size, self.stats = list(files), batch_size, _Stats()

    def size(self):
        return 0, 0

    def close(self):
        pass

    def __iter__(self):
        cols = [np.load(f) for f in self.files]
        if not cols:
            return
        dense = np.concatenate([c["dense"] for c in cols])
        ids = np.concatenate([c["sparse"] for c in cols])
        label = np.concatenate([c["label"] for c in cols])
        shift = np.cumsum([0] + [len(c["sparse"]) for c in cols[:-1]])
        offsets = np.concatenate([cols[0]["offsets"][:1]] + [c["offsets"][1:] + d
                                                             for c, d in zip(cols, shift)])
        S = (len(offsets) - 1) // len(label)
        for lo in range(0, len(label), self.batch_size):
            hi = min(lo + self.batch_size, len(label))
            a, b = offsets[lo * S], offsets[hi * S]
            yield Batch(dense[lo:hi], ids[a:b], label[lo:hi], offsets[lo * S:hi * S + 1] - a)


def main(argv):
    if argv[:1] == ["infer"]:
        from mpips import infer
        infer.make_reader = NpzBags
        return infer.main(argv[1:])
    runner.make_reader = warmup.make_reader = NpzBags
    if "--local" not in argv:
        from mpips.job import distributed      # under mpiexec: imports mpi4py.MPI
        distributed.make_reader = NpzBags
    from mpips.train import main as train_main
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
