"""Which server owns what: sparse ids by a hash of the id, dense parameters by slices.

``plan_keys`` dedups a batch's ids and orders the unique keys by owning server (the key
plan the worker pulls and pushes with, in one process or over MPI).
"""
from dataclasses import dataclass

import numpy as np

from mpips.kernels.embedding import group_by_owner_, owner_of, unique_inverse


def dense_bounds(n_params, n_servers):
    """Slice boundaries (S+1,) splitting a flat vector of n_params as evenly as possible."""
    return np.linspace(0, n_params, n_servers + 1).round().astype(np.int64)


def owners(keys, n_servers):
    """Server index (int32, (n,)) of each int64 key."""
    out = np.empty(len(keys), dtype=np.int32)
    owner_of(keys, n_servers, out)
    return out


@dataclass
class KeyPlan:
    """A batch's unique keys grouped by server."""
    keys: np.ndarray      # int64 (u,): unique keys, grouped by server, sorted within a group
    inverse: np.ndarray   # int64 (n,): position in `keys` of each original id
    offsets: np.ndarray   # int64 (S+1,): server s owns keys[offsets[s]:offsets[s+1]]


def plan_keys(ids, n_servers):
    """Dedup ids (any shape, int64) and group the unique keys by owning server."""
    ukeys, inverse = unique_inverse(ids.reshape(-1))
    if n_servers == 1:
        return KeyPlan(ukeys, inverse, np.array([0, len(ukeys)], np.int64))
    own = owners(ukeys, n_servers)
    keys = np.empty_like(ukeys)
    offsets = np.empty(n_servers + 1, np.int64)
    group_by_owner_(ukeys, own, inverse, keys, np.empty_like(ukeys), offsets)   # one pass
    return KeyPlan(keys, inverse, offsets)
