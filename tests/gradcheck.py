"""Central differences: the reference the networks' analytic gradients are checked against."""
import numpy as np

EPS = 1e-6


def central_differences(f, arr, eps=EPS):
    """d f / d arr.flat[k] for every k, by (f(arr + eps e_k) - f(arr - eps e_k)) / 2 eps."""
    out = np.empty(arr.size)
    for k in range(arr.size):
        a, b = arr.copy(), arr.copy()
        a.flat[k] += eps
        b.flat[k] -= eps
        out[k] = (f(a) - f(b)) / (2 * eps)
    return out


def check_gradients(loss, params, rows, grad, grows, rtol=1e-5, atol=1e-9):
    """``grad`` and ``grows`` (the analytic gradients of the parameters and of the table
    rows) against central differences of ``loss(params, rows)`` (float64)."""
    np.testing.assert_allclose(grad, central_differences(lambda p: loss(p, rows), params),
                               rtol=rtol, atol=atol)
    np.testing.assert_allclose(np.ravel(grows),
                               central_differences(lambda r: loss(params, r), rows),
                               rtol=rtol, atol=atol)
