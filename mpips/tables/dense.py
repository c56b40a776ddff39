"""Dense parameter slice held by one server.

The slice (all dense parameters flattened, this server's part) is stored as ONE row of
width n, so the optimizer is the same row kernel as the sparse table's (rows = [0]);
Adam's beta powers are per table.

With ``average`` B > 0 (``--dense-average``) the table also keeps an exponential moving
average of its values, ``average = B average + (1 - B) values``, updated on the range each
optimizer step (or delta) touched, in one pass (:func:`mpips.kernels.optim.ema_update`).
It starts at the initial values, travels with the optimizer state (:func:`dense_fields`:
saved, packed, gathered like Adam's m) and is what evaluation and every output use.
"""
import numpy as np

from mpips.kernels.optim import H_LR, ema_update
from mpips.tables.optim import OptimizerConfig, apply_rows, new_state, state_violation


class DenseTable:
    """A flat float32 parameter slice with a server-side optimizer.

    Parameters
    ----------
    values : float (n,)         initial values (copied)
    opt : OptimizerConfig
    average : float in [0, 1)   --dense-average B: keep a moving average (0 = none)
    """

    def __init__(self, values, opt, average=0.0):
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
        if not 0.0 <= average < 1.0:
            raise ValueError(f'average must be in [0, 1) (0 = off); got {average}')
        self.average = float(average)
        self._decay = np.float32(average)
        self._avg = self._values[0].copy() if average else None    # (n,) the moving average

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
        self.push_range(grads, scale, 0, self.size)

    def scale_lr(self, factor):
        """Steps from now on take the optimizer's lr x ``factor`` (a warm-up's ramp)."""
        self._hyper[H_LR] = self.opt.lr * factor

    def push_range(self, grads, scale, lo, hi):
        """Apply the optimizer to values [lo, hi) only, with ``grads * scale``; grads
        (hi - lo,).  Elementwise, so it gives those weights exactly what :meth:`push` of the
        whole vector would; per-table state (Adam's beta powers) advances as in a push."""
        if not 0 <= lo <= hi <= self.size:
            raise ValueError(f'range [{lo}, {hi}) is outside [0, {self.size})')
        n = hi - lo
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.shape != (n,):
            raise ValueError(f'grads must have shape ({n},); got {grads.shape}')
        state = {name: (arr[0, lo:hi].reshape(1, n) if arr.ndim == 2 else arr)
                 for name, arr in self._state.items()}
        apply_rows(self.opt, self._hyper, self._values[0, lo:hi].reshape(1, n), state,
                   self._rows, grads.reshape(1, n), float(scale))
        if self._avg is not None:
            ema_update(self._avg[lo:hi], self._values[0, lo:hi], self._decay)

    @property
    def values(self):
        """The live values (n,): a view that every update writes (a worker's replica
        computes with it directly)."""
        return self._values[0]

    @property
    def averaged(self):
        """The weights to evaluate and serve (n,): the moving average, or the live values
        when the table keeps none."""
        return self._values[0] if self._avg is None else self._avg

    def array(self, name):
        """The flat (n,) or (1,) array of field ``name`` of :func:`dense_fields` (a view)."""
        if name == 'values':
            return self._values[0]
        return self._avg if name == 'average' else self._state[name].reshape(-1)

    def add(self, delta):
        """``values += delta`` (GEO-SGD: a server's dense step); delta (n,)."""
        self._values += self._check(delta, 'delta')
        if self._avg is not None:
            ema_update(self._avg, self._values[0], self._decay)

    def assign(self, values):
        """``values[:] = values`` keeping the optimizer state (GEO rebase)."""
        self._values[0] = self._check(values, 'values')[0]

    @property
    def nbytes(self):
        return (self._values.nbytes + sum(a.nbytes for a in self._state.values())
                + (0 if self._avg is None else self._avg.nbytes))

    def export_state(self):
        """Copies: ``values`` (n,), per-element state (n,), per-table state (1,), and the
        ``average`` (n,) when the table keeps one."""
        return {name: self.array(name).copy() for name, _ in dense_fields(self)}

    def import_state(self, data):
        """Restore exactly from a dict like ``export_state`` returns.

        ``values`` is required; missing optimizer state is reset to fresh state, a missing
        ``average`` starts at the values (a checkpoint saved without one), and an
        ``average`` is ignored by a table that keeps none.  Raises
        ValueError, leaving the table unchanged, when a shape is wrong or the state breaks
        the optimizer's invariants (``mpips.tables.optim.state_violation``: finite values,
        Adam ``v >= 0`` and beta powers in [0, 1), Adagrad's accumulator >= 0).
        """
        expected = ['values', 'average'] + list(self._state)
        if 'values' not in data or set(data) - set(expected):
            raise ValueError(f'import_state needs values and accepts only {expected}; '
                             f'got {sorted(data)}')
        new = {'values': self._check(data['values'], 'values')}
        fresh = new_state(self.opt, 1, self.size)
        for name, arr in self._state.items():
            src = np.asarray(data[name]) if name in data else fresh[name]
            if src.size != arr.size:
                raise ValueError(f'import_state: {name} must have {arr.size} elements; '
                                 f'got {src.size}')
            new[name] = src.reshape(arr.shape)
        avg = None
        if self._avg is not None:
            avg = self._check(data.get('average', new['values'][0]), 'average')[0]
        why = state_violation(self.opt, new if avg is None else {**new, 'average': avg})
        if why:
            raise ValueError(f'import_state: {why}')
        self._values[...] = new['values']
        if avg is not None:
            self._avg[...] = avg
        for name, arr in self._state.items():
            arr[...] = new[name]


def dense_fields(table):
    """``[(name, per_element)]`` of what a dense table holds and saves: ``values``, its
    optimizer's state arrays, and ``average`` when it keeps a moving average."""
    return ([('values', True)] + table.opt.state_arrays()
            + ([('average', True)] if table.average else []))


def packed_size(table, n):
    """Floats of :func:`pack_state` for an ``n``-value slice of tables like ``table``."""
    return sum(n if per_el else 1 for _, per_el in dense_fields(table))


def pack_state(table, lo, hi):
    """``[values[lo:hi], each state array's slice (per-table ones whole), average[lo:hi]
    (when kept)]`` as float32.

    What a worker hands a server for slice [lo, hi) of its dense replica (DENSE_PUT), and
    what a server sends back whole (DENSE_GET); :func:`unpack_state` inverts it.
    """
    parts = [table.array(name)[lo:hi] if per_el else table.array(name)
             for name, per_el in dense_fields(table)]
    return np.concatenate(parts).astype(np.float32, copy=False)


def unpack_state(table, flat, n):
    """The ``import_state`` dict of an ``n``-value slice packed by :func:`pack_state` from
    a table like ``table`` (the same optimizer and averaging)."""
    if len(flat) != packed_size(table, n):
        raise ValueError(f"a packed dense slice of {n} values under {table.opt.name} "
                         f"{'with' if table.average else 'without'} an average has "
                         f"{packed_size(table, n)} floats; got {len(flat)}")
    out, off = {}, 0
    for name, per_el in dense_fields(table):
        k = n if per_el else 1
        out[name] = flat[off:off + k]
        off += k
    return out
