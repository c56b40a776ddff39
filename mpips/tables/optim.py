"""Server-side optimizer configuration and dispatch to the row kernels.

The update formulas are documented in :mod:`mpips.kernels.optim`. Adagrad's
accumulator starts at ``initial_accumulator`` (default 0.0, Paddle's
``initial_accumulator_value`` default); with ``epsilon`` in the denominator a zero
accumulator is safe. Adam is always lazy (Paddle ``lazy_mode=True``): only rows present
in a push move, and each row has its own beta powers.
"""
from dataclasses import dataclass

import numpy as np

from mpips.kernels.optim import H_SCALE, N_HYPER, adagrad_rows, adam_rows, sgd_rows

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


# name -> (lowest allowed, highest allowed or None, whether the highest is excluded): what
# the optimizer's updates keep true of its state (every state value is also finite).
# Adagrad's accumulator and Adam's v are sums of squares; Adam's beta powers are
# beta ** t with 0 <= beta < 1, so 1 - pow (a divisor of the bias correction) stays > 0.
_STATE_BOUNDS = {'accum': (0.0, None), 'm': (None, None), 'v': (0.0, None),
                 'beta1_pow': (0.0, 1.0), 'beta2_pow': (0.0, 1.0)}


def state_violation(opt, state):
    """Why ``state`` breaks optimizer ``opt``'s invariants, or None (vectorised, O(n)).

    state : dict name -> float array (any shape), the arrays of ``opt.state_arrays()`` and
    optionally ``values``.  Every value must be finite; Adagrad ``accum >= 0``; Adam
    ``v >= 0`` and ``0 <= beta1_pow, beta2_pow < 1``.
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
        if high is not None and hi >= high:
            return f"{opt.name} state '{name}' must be < {high:g}; got max {hi:g}"
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
    hyper : float64 (N_HYPER,)    scratch from ``opt.hyper()``; its scale slot is set here
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
        adagrad_rows(values, state['accum'], rows, grads, opt.lr, opt.epsilon, scale, lr_scale)
    else:
        sgd_rows(values, rows, grads, opt.lr, scale, lr_scale)
