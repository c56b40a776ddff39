"""Synthetic Criteo-format data with a known, learnable click model.

Layout written by ``generate(out_dir, rows, parts, seed, test_rows)``::

    out_dir/train/part-00000.txt ...   TSV: label \\t I1..I13 \\t C1..C26
    out_dir/test/part-00000.txt ...    (only if test_rows > 0; same number of parts)
    out_dir/truth/train-part-00000.npy true click probability per line, float32
    out_dir/meta.json                  rows, ctr, best achievable AUC, model summary

Shape of the data: 13 integer features with missing values and heavy tails (I2 can be
negative), 26 categorical fields of 8 hex digits with Zipf-distributed values and
cardinalities from 3 to ~1e5 (capped at rows // 10), some fields often empty.

Hidden model: logit = bias + per-value effects of 12 slots (empty is a value) + two
pairwise slot interactions + smooth functions of five integer features (and missingness),
scaled to a fixed spread so that the best achievable AUC is about 0.80, with the bias
set for a CTR of 0.25.  Everything is vectorised numpy and deterministic for a seed.

``python -m mpips.train`` with no ``--train`` trains on ``ensure_default_dataset``'s set.
CLI: ``python -m data_prep.synth --rows N --out DIR --parts P --seed S [--test-rows M]``
"""
import json
import os
import shutil
import socket
import time

import numpy as np
from numba import njit

N_INT, N_CAT = 13, 26
TARGET_CTR = 0.25
LOGIT_STD = 1.38  # spread of the centred logit; sets the best achievable AUC (~0.80)
CALIB_ROWS = 200_000  # sample used to fix the logit scale and bias
BLOCK_ROWS = 1 << 16  # rows formatted at a time
INT_MISSING = np.array([.45, 0, .21, .22, .03, .22, .04, 0, .04, .45, .04, .77, .22])
INT_MU = np.array([0.7, 2.5, 2.3, 1.8, 8.0, 4.0, 1.5, 2.5, 3.5, 0.3, 0.8, 0.3, 1.8])
INT_SIGMA = np.array([1.2, 2.0, 1.5, 1.0, 2.0, 1.8, 1.5, 1.0, 1.3, 0.6, 0.9, 0.8, 1.0])
N_INFORMATIVE = 12  # slots with per-value effects
HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
VERSION = 1


class Model:
    """The hidden generative model; depends on (seed, rows) only."""

    def __init__(self, seed: int, rows: int):
        rng = np.random.default_rng([seed, 0xC0FFEE])
        base = np.round(np.geomspace(3, 1e5, N_CAT)).astype(np.int64)
        cap = max(3, rows // 10)
        self.card = np.minimum(rng.permutation(base), cap)  # (26,)
        self.zipf_a = rng.uniform(1.05, 1.5, N_CAT)
        self.cat_missing = np.where(rng.random(N_CAT) < 0.3, rng.uniform(.05, .45, N_CAT), 0.)
        self.cdf = [np.cumsum(1.0 / np.arange(1, c + 1) ** a) for c, a in
                    zip(self.card, self.zipf_a)]
        self.cdf = [c / c[-1] for c in self.cdf]
        self.hex_mul = rng.integers(0, 1 << 31, N_CAT, dtype=np.uint64) * 2 + 1  # odd
        self.hex_add = rng.integers(0, 1 << 32, N_CAT, dtype=np.uint64)
        self.informative = np.sort(rng.choice(N_CAT, N_INFORMATIVE, replace=False))
        # effect tables have one extra entry (index card) for the empty value
        self.effects = {int(k): rng.normal(0, 0.7, self.card[k] + 1) for k in self.informative}
        low = np.flatnonzero(self.card <= 300)
        pa = rng.choice(low, 4, replace=False) if low.size >= 4 else np.array([0, 1, 2, 3])
        self.pairs = [(int(pa[0]), int(pa[1])), (int(pa[2]), int(pa[3]))]
        self.pair_tables = [rng.normal(0, 0.9, (self.card[a] + 1, self.card[b] + 1))
                            for a, b in self.pairs]
        self.scale, self.bias = 1.0, 0.0
        calib = np.random.default_rng([seed, 0xCA11B])
        raw = self.logit(*self.sample_features(calib, CALIB_ROWS))
        self.scale = LOGIT_STD / raw.std()
        z = (raw - raw.mean()) * self.scale
        lo, hi = -10.0, 10.0
        for _ in range(60):  # bisection: mean sigmoid(z + b) = TARGET_CTR
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _sigmoid(z + mid).mean() < TARGET_CTR else (lo, mid)
        self.bias = (lo + hi) / 2 - raw.mean() * self.scale

    def sample_features(self, rng, n: int):
        """(ints (n,13) int64, int_missing (n,13) bool, cats (n,26) int64 rank or -1)."""
        latent = np.exp(rng.normal(INT_MU, INT_SIGMA, (n, N_INT)))
        ints = np.floor(latent).astype(np.int64) - 1
        ints[:, 1] = np.where(rng.random(n) < 0.12, -rng.integers(1, 4, n), ints[:, 1])
        ints = np.maximum(ints, np.where(np.arange(N_INT) == 1, -3, 0))
        imiss = rng.random((n, N_INT)) < INT_MISSING
        cats = np.empty((n, N_CAT), dtype=np.int64)
        for k in range(N_CAT):
            cats[:, k] = np.searchsorted(self.cdf[k], rng.random(n))
        cats[rng.random((n, N_CAT)) < self.cat_missing] = -1
        return ints, imiss, cats

    def logit(self, ints, imiss, cats):
        """Raw logit (n,) float64 before scale and bias; the scaled one is truth."""
        z = np.zeros(ints.shape[0])
        idx = np.where(cats < 0, self.card, cats)  # empty -> extra entry
        for k, eff in self.effects.items():
            z += eff[idx[:, k]]
        for (a, b), tab in zip(self.pairs, self.pair_tables):
            z += tab[idx[:, a], idx[:, b]]
        lx = np.log1p(np.maximum(ints, 0)).astype(np.float64)  # (n, 13)
        z += np.where(imiss[:, 0], -0.4, 0.8 * np.tanh(lx[:, 0] - 1.0))
        z += -0.35 * (lx[:, 4] / 8.0 - 1.0) ** 2 * ~imiss[:, 4]
        z += 0.5 * np.sin(lx[:, 6]) * ~imiss[:, 6]
        z += 0.3 * np.tanh(ints[:, 1] / 20.0)
        z += np.where(imiss[:, 10], 0.0, 0.25 * (lx[:, 10] - 0.8))
        return z

    def prob(self, ints, imiss, cats):
        return _sigmoid(self.logit(ints, imiss, cats) * self.scale + self.bias)

    def hex_codes(self, cats):
        """(n, 26) uint32 hex value of each (slot, rank); bijective per slot."""
        r = np.maximum(cats, 0).astype(np.uint64)
        return ((r * self.hex_mul + self.hex_add) & np.uint64(0xFFFFFFFF)).astype(np.uint32)

    def summary(self) -> dict:
        return {"cardinalities": self.card.tolist(), "informative_slots":
                (self.informative + 1).tolist(), "pairs": [[a + 1, b + 1] for a, b in
                                                            self.pairs],
                "scale": float(self.scale), "bias": float(self.bias)}


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney, ties get average ranks)."""
    labels = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    npos = int(labels.sum())
    nneg = labels.size - npos
    if npos == 0 or nneg == 0:
        return float("nan")
    _, inv, cnt = np.unique(s, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(cnt) - (cnt - 1) / 2.0  # 1-based average rank per distinct score
    r = avg_rank[inv]
    return float((r[labels].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


@njit(cache=True, nogil=True)
def _format_kernel(labels, ints, imiss, empty, hexes):
    """TSV bytes of the rows: label, ints (decimal, nothing where missing), 8-hex codes."""
    n, n_int = ints.shape
    n_cat = hexes.shape[1]
    lens = np.empty(n, np.int64)
    digits = np.empty(24, np.uint8)
    for i in range(n):                          # pass 1: line lengths
        w = 2 + n_int + n_cat                   # label, tabs, newline
        for j in range(n_int):
            if not imiss[i, j]:
                v = ints[i, j]
                if v < 0:
                    w += 1
                    v = -v
                w += 1
                while v >= 10:
                    v //= 10
                    w += 1
        for k in range(n_cat):
            if not empty[i, k]:
                w += 8
        lens[i] = w
    out = np.empty(lens.sum(), np.uint8)
    p = 0
    for i in range(n):                          # pass 2: the bytes
        out[p] = 48 + labels[i]
        p += 1
        for j in range(n_int):
            out[p] = 9
            p += 1
            if imiss[i, j]:
                continue
            v = ints[i, j]
            if v < 0:
                out[p] = 45
                p += 1
                v = -v
            nd = 0
            while True:
                digits[nd] = 48 + v % 10
                nd += 1
                v //= 10
                if v == 0:
                    break
            for d in range(nd):
                out[p + d] = digits[nd - 1 - d]
            p += nd
        for k in range(n_cat):
            out[p] = 9
            p += 1
            if empty[i, k]:
                continue
            c = hexes[i, k]
            for d in range(8):
                out[p + d] = HEX[(c >> (28 - 4 * d)) & 15]
            p += 8
        out[p] = 10
        p += 1
    return out


def format_lines(labels, ints, imiss, cats, hexes) -> np.ndarray:
    """TSV bytes of n rows as a flat uint8 array (``cats < 0`` = empty field)."""
    return _format_kernel(np.ascontiguousarray(labels, np.int64), np.ascontiguousarray(
        ints, np.int64), np.ascontiguousarray(imiss, np.bool_), np.ascontiguousarray(
        cats < 0), np.ascontiguousarray(hexes, np.uint32))


def _write_part(model: Model, path: str, truth_path: str, n: int, rng) -> tuple:
    """Write n rows to path; return (labels (n,) int8, probs (n,) float32)."""
    labels_all, probs_all = [], []
    with open(path, "wb") as f:
        for start in range(0, n, BLOCK_ROWS):
            m = min(BLOCK_ROWS, n - start)
            ints, imiss, cats = model.sample_features(rng, m)
            p = model.prob(ints, imiss, cats)
            y = (rng.random(m) < p).astype(np.int8)
            f.write(format_lines(y, ints, imiss, cats, model.hex_codes(cats)).data)
            labels_all.append(y)
            probs_all.append(p.astype(np.float32))
    y = np.concatenate(labels_all) if labels_all else np.zeros(0, np.int8)
    p = np.concatenate(probs_all) if probs_all else np.zeros(0, np.float32)
    np.save(truth_path, p)
    return y, p


def _split_rows(rows: int, parts: int) -> list[int]:
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def generate(out_dir: str, rows: int, parts: int = 4, seed: int = 0, test_rows: int = 0) -> dict:
    """Write the synthetic data set to ``out_dir``; return the meta dict (also meta.json)."""
    if rows < 1 or parts < 1 or test_rows < 0:
        raise ValueError(f"need rows >= 1, parts >= 1, test_rows >= 0; got rows={rows}, "
                         f"parts={parts}, test_rows={test_rows}")
    t0 = time.time()
    model = Model(seed, rows)
    meta = {"version": VERSION, "seed": seed, "parts": parts, "format": "criteo-tsv"}
    splits = [("train", rows, 1)] + ([("test", test_rows, 2)] if test_rows else [])
    os.makedirs(os.path.join(out_dir, "truth"), exist_ok=True)
    for name, n, stream in splits:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        ys, ps = [], []
        for i, m in enumerate(_split_rows(n, parts)):
            rng = np.random.default_rng([seed, stream, i])
            y, p = _write_part(model, os.path.join(out_dir, name, f"part-{i:05d}.txt"),
                               os.path.join(out_dir, "truth", f"{name}-part-{i:05d}.npy"),
                               m, rng)
            ys.append(y)
            ps.append(p)
        y, p = np.concatenate(ys), np.concatenate(ps)
        meta[name] = {"rows": int(n), "ctr": float(y.mean()), "best_auc": auc(y, p),
                      "mean_prob": float(p.mean())}
    meta["model"] = model.summary()
    meta["seconds"] = round(time.time() - t0, 3)
    tmp = os.path.join(out_dir, ".meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))
    return meta


def _lock_is_stale(lock: str) -> bool:
    """True if the lock's owner (same host) is gone."""
    try:
        with open(os.path.join(lock, "owner")) as f:
            host, pid = f.read().split()
    except (OSError, ValueError):
        return False  # owner file not written yet (or foreign format): assume alive
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def ensure_default_dataset(cache_dir: str, rows: int = 100_000, test_rows: int = 20_000,
                           parts: int = 4, seed: int = 0, timeout: float = 1800.0):
    """Generate (once) and return ``(train_dir, test_dir)`` of a cached synthetic set.

    ``test_dir`` is None when ``test_rows == 0``.  The set lives in
    ``cache_dir/synth-v{VERSION}-r{rows}-t{test_rows}-p{parts}-s{seed}``.

    Safe when several processes (e.g. MPI ranks) call it at once: one takes the lock
    directory and generates into a temporary directory that is renamed into place; the
    others wait for the rename.  A lock left by a dead process on this host is removed.
    """
    name = f"synth-v{VERSION}-r{rows}-t{test_rows}-p{parts}-s{seed}"
    final = os.path.join(cache_dir, name)
    lock = final + ".lock"
    dirs = (os.path.join(final, "train"), os.path.join(final, "test") if test_rows else None)
    os.makedirs(cache_dir, exist_ok=True)
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not os.path.exists(os.path.join(final, "meta.json")):
        try:
            os.mkdir(lock)
        except FileExistsError:
            if _lock_is_stale(lock):
                shutil.rmtree(lock, ignore_errors=True)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f}s for {final} to be generated by the "
                                   f"holder of {lock}; if no process is generating it, "
                                   f"remove {lock} and retry") from None
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)
            continue
        try:
            with open(os.path.join(lock, "owner"), "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            if not os.path.exists(os.path.join(final, "meta.json")):
                tmp = f"{final}.tmp-{socket.gethostname()}-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                generate(tmp, rows, parts, seed, test_rows)
                shutil.rmtree(final, ignore_errors=True)  # a partial leftover, never whole
                os.rename(tmp, final)
        finally:
            shutil.rmtree(lock, ignore_errors=True)
    return dirs
