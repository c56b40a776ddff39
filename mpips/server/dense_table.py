"""Dense parameter slice held by one server.

The slice (all dense parameters flattened, this server's part) is stored as ONE row of
width n, so the optimizer is the same row kernel as the sparse table's (rows = [0]);
Adam's beta powers are per table.
"""
import numpy as np

from mpips.server.optim import OptimizerConfig, apply_rows, new_state


class DenseTable:
    """A flat float32 parameter slice with a server-side optimizer.

    Parameters
    ----------
    values : float (n,)         initial values (copied)
    opt : OptimizerConfig
    """

    def __init__(self, values, opt):
        if not isinstance(opt, OptimizerConfig):
            raise TypeError(f'opt must be an OptimizerConfig; got {type(opt).__name__}')
        values = np.asarray(values)
        if values.ndim != 1:
            raise ValueError(f'values must be 1-D; got shape {values.shape}')
        self.opt = opt
        self.size = values.shape[0]
        self._values = np.array(values, dtype=np.float32).reshape(1, self.size)  # (1, n)
        self._state = new_state(opt, 1, self.size)
        self._rows = np.zeros(1, np.int64)
        self._hyper = opt.hyper()

    def __len__(self):
        return self.size

    def _check(self, arr, name):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.shape != (self.size,):
            raise ValueError(f'{name} must have shape ({self.size},); got {arr.shape}')
        return arr.reshape(1, self.size)

    def pull(self, out):
        """Copy the values into ``out`` float32 (n,)."""
        if out.shape != (self.size,) or out.dtype != np.float32:
            raise ValueError(f'out must be float32 of shape ({self.size},); '
                             f'got {out.dtype} {out.shape}')
        out[:] = self._values[0]

    def push(self, grads, scale=1.0):
        """Apply the optimizer with ``grads * scale``; grads (n,)."""
        grads = self._check(grads, 'grads')
        apply_rows(self.opt, self._hyper, self._values, self._state, self._rows, grads,
                   float(scale))

    def add(self, delta):
        """``values += delta`` (GEO-SGD); delta (n,)."""
        self._values += self._check(delta, 'delta')

    def assign(self, values):
        """``values[:] = values`` keeping the optimizer state (GEO rebase)."""
        self._values[0] = self._check(values, 'values')[0]

    @property
    def nbytes(self):
        return self._values.nbytes + sum(a.nbytes for a in self._state.values())

    def export_state(self):
        """Copies: ``values`` (n,), per-element state (n,), per-table state (1,)."""
        out = {'values': self._values[0].copy()}
        for name, arr in self._state.items():
            out[name] = arr.reshape(-1).copy()
        return out

    def import_state(self, data):
        """Restore exactly from a dict like ``export_state`` returns.

        ``values`` is required; missing optimizer state is reset to fresh state.
        """
        expected = ['values'] + list(self._state)
        if 'values' not in data or set(data) - set(expected):
            raise ValueError(f'import_state needs values and accepts only {expected}; '
                             f'got {sorted(data)}')
        self._values[0] = self._check(data['values'], 'values')[0]
        fresh = new_state(self.opt, 1, self.size)
        for name, arr in self._state.items():
            src = np.asarray(data[name]) if name in data else fresh[name]
            if src.size != arr.size:
                raise ValueError(f'import_state: {name} must have {arr.size} elements; '
                                 f'got {src.size}')
            arr[...] = src.reshape(arr.shape)
