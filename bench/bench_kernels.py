"""Worker-side kernel speed: unique_inverse (numba hash) against np.unique(return_inverse).

    PYTHONPATH=. python bench/bench_kernels.py [--batch 512] [--rounds 5]

One CTR-like batch of ids (batch x 26 slots, Zipf-distributed repeats over int64). The two
functions are timed alternately, best of 30 calls per round; the ratio printed is the
median over the rounds (absolute times drift with the machine's load; the ratio less so).
Correctness is tested in tests/test_embedding.py.
"""
import argparse
import statistics
import time

import numpy as np

from mpips.kernels.embedding import unique_inverse


def ctr_batch(rng, n):
    z = rng.zipf(1.3, size=n).astype(np.int64)
    slot = np.tile(np.arange(26), n // 26 + 1)[:n]
    return (z * 1000003 + slot * 7919) * 0x9E3779B1


def best(f, ids, reps=30):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(ids)
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    ids = ctr_batch(np.random.default_rng(1), a.batch * 26)
    unique_inverse(ids)                                        # compile
    ours, ref = [], []
    for _ in range(a.rounds):
        ours.append(best(unique_inverse, ids))
        ref.append(best(lambda x: np.unique(x, return_inverse=True), ids))
    ratio = statistics.median(r / o for r, o in zip(ref, ours))
    print(f"unique_inverse: n={ids.shape[0]} ids, {np.unique(ids).shape[0]} unique: "
          f"median {statistics.median(ours) * 1e6:.0f} us vs np.unique "
          f"{statistics.median(ref) * 1e6:.0f} us -> {ratio:.1f}x faster (median of {a.rounds} "
          f"alternating rounds)")


if __name__ == "__main__":
    main()
