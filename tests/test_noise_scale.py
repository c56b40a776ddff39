"""bench/noise_scale.py: the estimator against known moments, the prediction against its
closed form."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import noise_scale  # noqa: E402


def test_estimates_are_unbiased_for_known_gradient_moments():
    """Per-example gradients G + noise with covariance Sigma: over many draws the pair of
    estimates averages to |G|^2 and tr(Sigma) (a naive |G_B|^2 would be biased by tr/B)."""
    rng = np.random.default_rng(0)
    d, b, k = 20, 8, 16
    G = rng.normal(size=d) * 0.3
    sd = rng.uniform(0.5, 2.0, d)                      # Sigma = diag(sd^2)
    g2s, trs, naive = [], [], []
    for _ in range(4000):
        ex = G + rng.normal(size=(k, b, d)) * sd        # k batches of b examples
        small = ex.mean(axis=1)                         # the k small-batch gradients
        big = small.mean(axis=0)
        g2, tr, _ = noise_scale.estimate(float(np.mean(np.sum(small ** 2, 1))),
                                         float(big @ big), b, k * b)
        g2s.append(g2)
        trs.append(tr)
        naive.append(big @ big)
    assert np.mean(g2s) == pytest.approx(G @ G, rel=0.03)
    assert np.mean(trs) == pytest.approx(np.sum(sd ** 2), rel=0.01)
    assert np.mean(naive) - G @ G == pytest.approx(np.sum(sd ** 2) / (k * b), rel=0.05)


def test_estimates_stay_unbiased_with_parts_of_unequal_size():
    """Parts of 9, 8, 8 and 3 examples (a --global-batch remainder, a short last batch):
    with b the harmonic mean of the sizes, DenseStep's pair averages to |G|^2 and
    tr(Sigma)."""
    from mpips.worker.dense_sync import noise_pair
    rng = np.random.default_rng(2)
    d, sizes = 20, np.array([9, 8, 8, 3])
    G = rng.normal(size=d) * 0.3
    sd = rng.uniform(0.5, 2.0, d)
    b, B = len(sizes) / np.sum(1 / sizes), sizes.sum()
    pairs = []
    for _ in range(4000):
        parts = [(G + rng.normal(size=(n, d)) * sd).sum(0) for n in sizes]
        small = np.mean([np.sum((p / n) ** 2) for p, n in zip(parts, sizes)])
        big = np.sum((np.sum(parts, 0) / B) ** 2)
        pairs.append(noise_pair(small, big, b, B))
    g2, tr = np.mean(pairs, 0)
    assert g2 == pytest.approx(G @ G, rel=0.05)
    assert tr == pytest.approx(np.sum(sd ** 2), rel=0.02)


def curve(bnoise, n=1_000_000, points=40):
    """A run record with a constant B_noise and a test AUC linear in the examples."""
    xs = np.linspace(0, n, points)
    return {"batch": 512, "records": [
        {"examples": float(x), "all_g2": 1.0, "all_tr": float(bnoise),
         "test_auc": 0.5 + 0.3 * x / n, "test_logloss": 0.7 - 0.2 * x / n} for x in xs]}


@pytest.mark.parametrize("bnoise", [2000.0, 20000.0])
def test_prediction_matches_the_closed_form_at_a_constant_noise_scale(bnoise):
    """di/dx = 1 / (1 + B / Bn) for both runs, so the fraction is (1 + b/Bn) / (1 + B/Bn)."""
    out = noise_scale.predict(curve(bnoise), [512, 4096, 32768])
    for p in out:
        frac = (1 + 512 / bnoise) / (1 + p["batch"] / bnoise)
        assert p["fraction"] == pytest.approx(frac, rel=1e-3)
        assert p["auc"] == pytest.approx(-0.3 * (1 - frac), abs=1e-3)
        assert p["logloss"] == pytest.approx(0.2 * (1 - frac), abs=1e-3)


# ---- the noise scale a training job reports (mpips.worker.dense_sync.DenseStep) ----------
def reference_blocks(steps, block):
    """Plain numpy float64: per block of `block` counted steps (a step counts when it has
    >= 2 parts, (n, summed gradient) each; b is the parts' harmonic mean size), the sums of
    the two estimates."""
    out, count = [], 0
    for parts in steps:
        if len(parts) < 2:
            continue
        ns = np.array([n for n, _ in parts], np.float64)
        b, B = len(ns) / np.sum(1 / ns), np.sum(ns)
        small = np.mean([np.sum((g.astype(np.float64) / n) ** 2) for n, g in parts])
        tot = np.sum([g.astype(np.float64) for _, g in parts], axis=0) / B
        big = np.sum(tot ** 2)
        if count % block == 0:
            out.append(np.zeros(2))
        out[-1] += [(B * big - b * small) / (B - b), (small - big) / (1 / b - 1 / B)]
        count += 1
    return np.array(out)


def test_dense_step_noise_blocks_match_numpy_and_shards_add_up():
    from mpips.job.report import noise_scale
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.worker.dense_sync import NOISE_BLOCK, NOISE_BLOCKS, DenseStep
    rng = np.random.default_rng(1)
    P = 101
    mean = rng.normal(size=P)                       # the gradient: mean + per-part noise
    n_steps = NOISE_BLOCK * (NOISE_BLOCKS + 1) + 7  # more blocks than are reported
    steps = [[(32, ((mean * (1 + t % 3) + rng.normal(size=P)) * 32).astype(np.float32))
              for _ in range(4)] for t in range(n_steps)]
    steps.insert(2, [(32, steps[0][0][1]), (7, steps[0][1][1])])   # a short part: counted
    steps.insert(3, [(33, steps[0][2][1]), (32, steps[0][3][1])])   # a G % W remainder
    steps.insert(4, [(32, steps[1][0][1])])                          # one part: skipped
    whole = DenseStep(DenseTable(np.zeros(P), OptimizerConfig("sgd", lr=0.1)))
    shards = [DenseStep(DenseTable(np.zeros(P), OptimizerConfig("sgd", lr=0.1)), lo, hi)
              for lo, hi in ((0, 40), (40, P))]
    for parts in steps:
        for acc in [whole] + shards:
            acc.reset()
            for n, g in parts:
                acc.add(n, g[acc.lo:acc.hi])
            acc.apply()
    ref = reference_blocks(steps, NOISE_BLOCK)[-NOISE_BLOCKS:]
    assert len(ref) == NOISE_BLOCKS and np.all(ref[:, 0] > 0)
    np.testing.assert_allclose(whole.noise(), ref, rtol=1e-5)
    np.testing.assert_allclose(shards[0].noise() + shards[1].noise(), ref, rtol=1e-5)
    assert noise_scale(whole.noise()) == pytest.approx(np.median(ref[:, 1] / ref[:, 0]),
                                                       rel=1e-5)
    whole.noise_reset()
    assert whole.noise().shape == (0, 2) and noise_scale(whole.noise()) is None


def test_noise_scale_is_a_median_robust_to_a_swing_and_counts_no_signal_as_infinite():
    from mpips.job.report import noise_scale
    blocks = np.array([[1.0, 1000.0], [1.2, 1500.0], [50.0, 900.0]])   # the last: a swing
    assert noise_scale(blocks) == pytest.approx(1000.0)     # (a ratio of sums: 65.7)
    no_signal = np.array([[-1.0, 800.0], [-0.5, 900.0], [1.0, 600.0]])
    assert noise_scale(no_signal) is None                   # median: infinite
    assert noise_scale(np.array([[-1.0, 800.0], [1.0, 600.0], [2.0, 1000.0]])) == 600.0


def test_noise_line_gives_the_models_share_and_advises_only_below_three_quarters():
    from mpips.job.report import noise_line
    far = noise_line({"dense_noise_scale": 2000.0, "global_batch": 8192}, 512)
    share = (1 + 512 / 2000) / (1 + 8192 / 2000)           # McCandlish et al.'s B / (1 + B/Bn)
    assert f"about {share:.2f} of what it would in one process's batch of 512" in far
    assert "a smaller --batch-size" in far and "(4.1x it; W x --batch-size 512)" in far
    mid = noise_line({"dense_noise_scale": 8000.0, "global_batch": 4096}, 512)   # share 0.70
    assert "about 0.70 of" in mid and "a smaller --batch-size" in mid
    near = noise_line({"dense_noise_scale": 4000.0, "global_batch": 1024}, 512)  # share 0.90
    assert near.startswith("NOISE --> dense gradient noise scale: 4000 examples")
    assert "about 0.90 of" in near and "a smaller" not in near     # no advice
    assert "(0.3x it; W x --batch-size 512)" in near               # the flag in force
    by_g = noise_line({"dense_noise_scale": 2000.0, "global_batch": 8192}, 2048, True)
    assert "(4.1x it; --global-batch, 2048 a worker)" in by_g
    assert "a smaller --global-batch" in by_g and "--batch-size" not in by_g
    assert "not measured" in noise_line({"dense_noise_scale": None, "global_batch": 64}, 32)
    assert noise_line({"test_auc": 0.7}, 512) is None


def test_dense_step_sums_parts_in_order_from_zero_each_step():
    """A step's total is 0 + part_0 + part_1 + ... in float32, whatever the last step left
    (the first part overwrites it: -0.0 becomes +0.0 as zeroing then adding gives)."""
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.worker.dense_sync import DenseStep
    rng = np.random.default_rng(5)
    acc = DenseStep(DenseTable(np.zeros(9), OptimizerConfig("sgd", lr=0.1)))
    for parts in ([(3, rng.normal(size=9).astype(np.float32))],
                  [(0, np.full(9, np.nan, np.float32)),            # no examples: not read
                   (4, np.array([-0.0, 1, 2, -0.0, 4, 5, 6, 7, -8], np.float32)),
                   (2, np.where(np.arange(9) % 3 == 0, np.float32(-0.0),
                                rng.normal(size=9).astype(np.float32)))]):
        acc.reset()
        want = np.zeros(9, np.float32)
        for n, g in parts:
            acc.add(n, g)
            if n:
                want = want + g
        assert acc.examples == sum(n for n, _ in parts)
        assert np.array_equal(acc.total.view(np.uint32), want.view(np.uint32))
