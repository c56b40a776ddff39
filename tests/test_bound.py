"""bench/bound.py times the products the model computes; bench/bench_step.py finds them."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_step  # noqa: E402
import bound  # noqa: E402

from mpips.models.zoo import builtin  # noqa: E402


def _label(a_shape, ta, b_shape, tb):
    """bench_step's name of a product whose operands have these (logical) shapes."""
    sa = "x".join(map(str, a_shape)) + ("^T" if ta else "")
    sb = "x".join(map(str, b_shape)) + ("^T" if tb else "")
    return f"gemm {sa} @ {sb}"


@pytest.mark.parametrize("hidden", [(7,), (6, 5, 4)])
def test_bound_times_the_products_forward_backward_computes(hidden):
    model = builtin("dnn", n_sparse=3, dim=2, n_dense=4, hidden=hidden)
    B = 9
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((B, model.emb_width)).astype(np.float32)
    dense = rng.random((B, model.n_dense)).astype(np.float32)
    label = (rng.random(B) < 0.5).astype(np.float32)
    sites, outside = bench_step.profile_model(model, model.init_params(0), emb, dense,
                                              label, reps=2)
    seen = [lab for lab, _ in sites if lab.startswith("gemm")]
    spec = bound.gemms(B, model.tensors["x"].width, model.emb_width, hidden)
    assert seen == [_label(a, ta, b, tb) for _, a, b, ta, tb in spec]
    assert outside >= 0 and all(s > 0 for _, s in sites)
    kernels = {lab for lab, _ in sites if not lab.startswith("gem")}
    assert kernels == {k for _, k in bench_step.KERNELS} - (
        {"relu_backward_colsum_"} if len(hidden) == 1 else set())


def test_criteo_shape_flops_and_timing_records():
    spec = bound.gemms(512, 273, 260, (400, 400, 400))
    per_example = sum(bound.flops(spec)) / 512
    assert per_example == 2 * (3 * (273 * 400 + 2 * 400 * 400) - 13 * 400)   # dX skips dense
    r = bound.measure(16, 11, 8, (6, 5), reps=2, rounds=1, names=["numpy"])
    rec = r["blas"]["numpy"]
    assert r["best"] == "numpy" and r["flops_per_example"] == sum(
        bound.flops(bound.gemms(16, 11, 8, (6, 5)))) / 16
    assert rec["seconds"] == pytest.approx(sum(p["seconds"] for p in rec["parts"].values()))
    assert rec["ex_per_s_core"] == pytest.approx(16 / rec["seconds"])
    assert bound.per_core(r) == rec["ex_per_s_core"] == bound.per_core(r, cores=2)
