"""Which server owns what: sparse ids by a hash of the id, dense parameters by slices."""
import numpy as np

from mpips.kernels.embedding import owner_of


def dense_bounds(n_params, n_servers):
    """Slice boundaries (S+1,) splitting a flat vector of n_params as evenly as possible."""
    return np.linspace(0, n_params, n_servers + 1).round().astype(np.int64)


def owners(keys, n_servers):
    """Server index (int32, (n,)) of each int64 key."""
    out = np.empty(len(keys), dtype=np.int32)
    owner_of(keys, n_servers, out)
    return out
