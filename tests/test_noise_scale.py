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
