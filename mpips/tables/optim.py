"""Server-side optimizer configuration and dispatch to the row kernels.

The update formulas are documented in :mod:`mpips.kernels.optim`. Adagrad's
accumulator starts at ``initial_accumulator`` (default 0.0, Paddle's
``initial_accumulator_value`` default); with ``epsilon`` in the denominator a zero
accumulator is safe. Adam is always lazy (Paddle ``lazy_mode=True``): only rows present
in a push move, and each row has its own beta powers.
"""
from dataclasses import dataclass

import numpy as np

from mpips.kernels.optim import H_LR, H_SCALE, N_HYPER, adagrad_rows, adam_rows, sgd_rows

# name -> list of (state array name, per_element). per_element arrays are (R, dim)
# float32, the others (R,) float32.
_STATE_ARRAYS = {
    'sgd': [],
    'adagrad': [('accum', True)],
    'adam': [('m', True), ('v', True), ('beta1_pow', False), ('beta2_pow', False)],
}
OPTIMIZERS = tuple(_STATE_ARRAYS)


def state_arrays(name):
    """Optimizer state arrays of optimizer ``name`` as ``[(state_name, per_element)]``."""
    if name not in _STATE_ARRAYS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return list(_STATE_ARRAYS[name])


@dataclass
class OptimizerConfig:
    """Optimizer applied by the servers to pushed gradients."""
    name: str = 'adam'               # one of OPTIMIZERS: 'sgd', 'adagrad', 'adam' (lazy)
    lr: float = 1e-3                 # learning rate, > 0
    beta1: float = 0.9               # Adam first-moment decay, in [0, 1)
    beta2: float = 0.999             # Adam second-moment decay, in [0, 1)
    epsilon: float = 1e-8            # Adam / Adagrad denominator term, > 0
    initial_accumulator: float = 0.0  # Adagrad accumulator start value, >= 0

    def __post_init__(self):
        state_arrays(self.name)  # raises on an unknown name
        if not self.lr > 0:
            raise ValueError(f'optimizer lr must be > 0; got {self.lr}')
        for field in ('beta1', 'beta2'):
            b = getattr(self, field)
            if not 0.0 <= b < 1.0:
                raise ValueError(f'optimizer {field} must be in [0, 1); got {b}')
        if not self.epsilon > 0:
            raise ValueError(f'optimizer epsilon must be > 0; got {self.epsilon}')
        if not self.initial_accumulator >= 0:
            raise ValueError('optimizer initial_accumulator must be >= 0; '
                             f'got {self.initial_accumulator}')

    def state_arrays(self):
        """``[(state_name, per_element)]`` of this optimizer."""
        return state_arrays(self.name)

    def initial_state(self, state_name):
        """Fill value of a fresh row's state array ``state_name``."""
        return {'accum': self.initial_accumulator, 'm': 0.0, 'v': 0.0,
                'beta1_pow': self.beta1, 'beta2_pow': self.beta2}[state_name]

    def hyper(self, scale=1.0):
        """float64 (N_HYPER,) array for :func:`mpips.kernels.optim.adam_rows`."""
        h = np.empty(N_HYPER, np.float64)
        h[:] = (self.lr, self.beta1, self.beta2, self.epsilon, scale)
        return h


# What the optimizers' updates keep true of their state, beyond being finite.  Adagrad's
# accumulator and Adam's v are sums of squares; Adam's beta powers are beta ** t with
# 0 <= beta < 1, so 1 - pow (a divisor of the bias correction) stays > 0.  The magnitudes
# are far beyond any honest run (dense weights stay within a few units; a gradient is at
# most 1e15 in size, mpips.server.checks.MAX_ABS, so m is too and v at most its square):
# a state past them is corrupt or hostile, and one Adam step of it would overflow.
VALUE_MAX = 1e6          # |dense weight|
MOMENT_MAX = 1e15        # |m|: an average of gradients
SECOND_MAX = 1e30        # v: an average of squared gradients
M_FLOOR = 1e-16          # |m| allowed however small v is (v of gradients under ~3e-18
                         # is below float32's normal range)
_STATE_BOUNDS = {'values': (-VALUE_MAX, VALUE_MAX), 'accum': (0.0, None),
                 'm': (-MOMENT_MAX, MOMENT_MAX), 'v': (0.0, SECOND_MAX)}
_TINY = float(np.finfo(np.float32).tiny)    # powers below lose their relative precision


def state_violation(opt, state):
    """Why ``state`` breaks optimizer ``opt``'s invariants, or None (vectorised, O(n)).

    state : dict name -> float array (any shape), the arrays of ``opt.state_arrays()`` and
    optionally ``values``.  Every value must be finite and within ``_STATE_BOUNDS``
    (|values| <= VALUE_MAX, Adagrad ``accum >= 0``, Adam ``|m| <= MOMENT_MAX``,
    ``0 <= v <= SECOND_MAX``); Adam's m within its bound by v (:func:`_moment_ratio`) and
    its beta powers on the sequences beta ** t, at one step t (:func:`_power_violation`).
    """
    for name, arr in state.items():
        arr = np.asarray(arr)
        if not arr.size:
            continue
        lo, hi = float(arr.min()), float(arr.max())     # NaN propagates through min/max
        if not (np.isfinite(lo) and np.isfinite(hi)):
            return f"{opt.name} '{name}' has non-finite values (NaN or inf)"
        low, high = _STATE_BOUNDS.get(name, (None, None))
        if low is not None and lo < low:
            return f"{opt.name} state '{name}' must be >= {low:g}; got min {lo:g}"
        if high is not None and hi > high:
            return f"{opt.name} state '{name}' must be <= {high:g}; got max {hi:g}"
    if opt.name != 'adam':
        return None
    if 'm' in state and 'v' in state:
        why = _moment_violation(opt, np.asarray(state['m']), np.asarray(state['v']))
        if why:
            return why
    if 'beta1_pow' in state and 'beta2_pow' in state:
        return _power_violation(opt, np.asarray(state['beta1_pow'], np.float64),
                                np.asarray(state['beta2_pow'], np.float64))
    return None


def _moment_ratio(opt):
    """R with |m| <= R sqrt(v) for every Adam state reached from zero, or None.

    m = (1-b1) sum_k b1^k g_k and v = (1-b2) sum_k b2^k g_k^2, so by Cauchy-Schwarz
    m^2 <= (1-b1)^2 / (1-b2) / (1 - b1^2/b2) v when b1^2 < b2 (7.3 sqrt(v) for 0.9 and
    0.999).  Twice that is allowed (float32 rounding).  It bounds an Adam step by about
    2 R / (1 - b1) lr (145 lr at the defaults) however m and v were chosen."""
    b1, b2 = opt.beta1, opt.beta2
    if b1 * b1 >= b2:
        return None
    return 2.0 * (1 - b1) / np.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def _moment_violation(opt, m, v):
    ratio = _moment_ratio(opt)
    if ratio is None or not m.size:
        return None
    excess = np.abs(m.astype(np.float64)) - ratio * np.sqrt(v.astype(np.float64)) - M_FLOOR
    worst = int(np.argmax(excess))
    if excess.flat[worst] > 0:
        return (f"adam state 'm' {float(m.flat[worst]):g} is out of reach of v "
                f"{float(v.flat[worst]):g}: |m| <= {ratio:.3g} sqrt(v) from any gradients")
    return None


def _steps(pow_, beta):
    """(t = log(pow) / log(beta) as floats, the tolerance of each) for powers >= _TINY.
    Each step rounds the power to float32 (relative error 2^-24 a step)."""
    t = np.log(pow_) / np.log(beta)
    return t, 0.01 + (np.abs(t) + 1) * 2.0 ** -23 / abs(np.log(beta))


def _power_violation(opt, p1, p2):
    """Why the beta powers are not beta1 ** t and beta2 ** t of one whole step t >= 1
    (within float32 rounding), or None."""
    for name, p, beta in (('beta1_pow', p1, opt.beta1), ('beta2_pow', p2, opt.beta2)):
        if np.any(p < 0) or np.any(p > beta * (1 + 2.0 ** -20)):
            return (f"adam state '{name}' must be beta ** t for a step t >= 1, in [0, {beta:g}]; "
                    f"got {float(p.max() if np.any(p > beta) else p.min()):.9g}")
        if beta == 0:
            continue
        ok = p >= _TINY
        if np.any(ok):
            t, tol = _steps(p[ok], beta)
            off = np.abs(t - np.round(t)) > tol
            if np.any(off):
                return (f"adam state '{name}' {float(p[ok][off][0]):.9g} is not {beta:g} ** t "
                        f"for a whole step t (t = {float(t[off][0]):.6g})")
    both = (p1 >= _TINY) & (p2 >= _TINY)
    if opt.beta1 > 0 and opt.beta2 > 0 and np.any(both):
        t1, tol1 = _steps(p1[both], opt.beta1)
        t2, tol2 = _steps(p2[both], opt.beta2)
        off = np.abs(t1 - t2) > tol1 + tol2
        if np.any(off):
            return (f"adam beta powers of different steps: beta1_pow is {opt.beta1:g} ** "
                    f"{float(t1[off][0]):.6g}, beta2_pow {opt.beta2:g} ** {float(t2[off][0]):.6g}")
    return None


def new_state(opt, n_rows, dim):
    """Fresh optimizer state for ``n_rows`` rows: dict name -> float32 array."""
    state = {}
    for name, per_element in opt.state_arrays():
        shape = (n_rows, dim) if per_element else (n_rows,)
        state[name] = np.full(shape, opt.initial_state(name), np.float32)
    return state


def apply_rows(opt, hyper, values, state, rows, grads, scale, lr_scale=None):
    """Apply optimizer ``opt`` to ``values[rows]`` with ``grads * scale``.

    Parameters
    ----------
    opt : OptimizerConfig
    hyper : float64 (N_HYPER,)    scratch from ``opt.hyper()``; its scale slot is set here,
                                  its lr (``opt.lr``, or a warm-up's share of it) is used
    values : float32 (R, dim)
    state : dict name -> float32 array, as made by :func:`new_state`
    rows : int64 (n,)             unique row indices
    grads : float32 (n, dim)
    scale : float
    lr_scale : float32 (n,) or None   each row's learning-rate factor (None: 1, exactly)
    """
    if opt.name == 'adam':
        hyper[H_SCALE] = scale
        adam_rows(values, state['m'], state['v'], state['beta1_pow'], state['beta2_pow'],
                  rows, grads, hyper, lr_scale)
    elif opt.name == 'adagrad':
        adagrad_rows(values, state['accum'], rows, grads, hyper[H_LR], opt.epsilon, scale,
                     lr_scale)
    else:
        sgd_rows(values, rows, grads, hyper[H_LR], scale, lr_scale)
