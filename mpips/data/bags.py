"""Row operations on batch pieces, one-hot or CSR: slice, concatenate, permute.

A piece is ``(dense, sparse, label, offsets)`` with the layout of ``mpips.data.reader.Batch``:
``offsets is None`` -> ``sparse`` is ``(n, S)`` (one id per slot); else ``sparse`` is the
``(nnz,)`` ids of all bags, example-major, and bag ``(i, s)`` is
``sparse[offsets[i*S + s] : offsets[i*S + s + 1]]`` with ``offsets`` of length ``n*S + 1``
(``offsets[0] == 0``).  Rows ``i..j`` own one contiguous run of ids, so a slice is a view of
``sparse`` plus offsets shifted to start at 0; all functions here are vectorised numpy.
"""
import numpy as np


def n_rows(piece) -> int:
    return int(piece[2].shape[0])


def slice_rows(piece, lo: int, hi: int):
    """Rows ``lo:hi`` of ``piece`` (views for one-hot; a view of the ids for CSR)."""
    dense, sparse, label, offsets = piece
    if offsets is None:
        return dense[lo:hi], sparse[lo:hi], label[lo:hi], None
    S = _n_slots(offsets, label.shape[0])
    off = offsets[lo * S:hi * S + 1]
    base = off[0]
    return dense[lo:hi], sparse[base:off[-1]], label[lo:hi], off - base


def _n_slots(offsets, n):
    """Slots per row of a CSR piece of n rows (0 for an empty piece)."""
    return (offsets.shape[0] - 1) // n if n else 0


def concat(pieces):
    """One piece of all ``pieces`` in order (all one-hot or all CSR with the same S)."""
    if len(pieces) == 1:
        return pieces[0]
    dense = np.concatenate([p[0] for p in pieces])
    label = np.concatenate([p[2] for p in pieces])
    if pieces[0][3] is None:
        if any(p[3] is not None for p in pieces):
            raise ValueError("cannot concatenate one-hot and CSR batches")
        return dense, np.concatenate([p[1] for p in pieces]), label, None
    if any(p[3] is None for p in pieces):
        raise ValueError("cannot concatenate one-hot and CSR batches")
    sparse = np.concatenate([p[1] for p in pieces])
    shifts = np.cumsum([0] + [int(p[3][-1]) for p in pieces[:-1]])
    offsets = np.concatenate([pieces[0][3][:1]] +
                             [p[3][1:] + s for p, s in zip(pieces, shifts)])
    return dense, sparse, label, offsets


def take(piece, perm: np.ndarray):
    """Rows of ``piece`` in the order ``perm`` (a permutation or any row selection)."""
    dense, sparse, label, offsets = piece
    if offsets is None:
        return dense[perm], sparse[perm], label[perm], None
    n = label.shape[0]
    S = _n_slots(offsets, n)
    if S == 0 or perm.shape[0] == 0:
        return dense[perm], sparse[:0], label[perm], np.zeros(perm.shape[0] * S + 1, np.int64)
    bag_len = np.diff(offsets).reshape(n, S)[perm]  # (m, S)
    new_off = np.zeros(perm.shape[0] * S + 1, dtype=np.int64)
    np.cumsum(bag_len.ravel(), out=new_off[1:])
    row_start = offsets[perm * S]  # (m,) where each chosen row's ids start
    row_len = bag_len.sum(axis=1)
    new_row_start = new_off[:-1:S]
    idx = np.arange(int(new_off[-1]), dtype=np.int64) + np.repeat(row_start - new_row_start,
                                                                   row_len)
    return dense[perm], sparse[idx], label[perm], new_off
