"""Wide multi-hot synthetic data in Paddle slot text, shaped like PaddleRec's slot_dnn data.

PaddleRec's ``slot_dnn`` sample (``models/rank/slot_dnn/data``) has ~300-400 sparse slots, a line
of 400-540 ``feasign:slot`` tokens, many feasigns per slot (bags of 1 to ~70 ids, most of 1),
slots missing on some lines and 64-bit hashed feasigns.  This generator writes that shape with
a hidden click model whose true probability of every row is known, so a trainer's test AUC can
be set against the best achievable (oracle) AUC.

Shape (per generator, all drawn from ``--seed``):

* ``--slots`` sparse slots named ``"1" .. "S"``.  About half of them are on every line; the
  others are missing on 5-70% of lines.  A slot's bag length is ``1 + min(G, cap - 1)`` with ``G``
  geometric: ~50% of slots are single-valued (cap 1), ~35% short (cap 3-10), ~15% long
  (cap 20-50); the mean extra length of the multi-valued slots is scaled (exactly, in
  closed form) so that a line holds ``--ids-per-example`` ids on average (default 1.5 x S:
  450 for 300 slots).  Ids within a bag are drawn independently (a bag may repeat an id).
* Ids: per slot a power law ``P(r) ~ (r + 1) ** -a`` over ``V`` values (``a`` in 1.05..1.4,
  ``V`` log-uniform in 10..``--max-card``).  The feasign written is a bijection of
  ``(slot, rank)``: unique across slots, 32-bit (``--feasign-bits 64``: full 64-bit, as
  Paddle's hashed feasigns, and longer lines).
* ``--dense`` values (default 4) in one dense slot ``dense_feature`` (already normalised,
  4 decimals), the label in slot ``click``.
* Token order: ``feasign:slot`` (as slot_dnn; ``--token-order slot:feasign`` flips every
  token).  A line is ``y:click``, the dense tokens, then the bags slot by slot in a fixed
  shuffled slot order (not sorted), a bag's tokens adjacent.

Hidden click model: ``logit = bias + A + B + C``.  A: per slot, the pooled (sum, or mean with
``--pooling mean``) per-id effects, a Gaussian drawn from a hash of (seed, slot, id), weighted
per slot (a third of the slots carry no signal); an empty bag adds nothing (as an empty bag
pools to zero).  B (``--interactions SHARE``): factorisation-machine pairwise terms
``<u_a(bag_a), v_b(bag_b)>`` of ``N_PAIRS`` slot pairs with hashed 4-d latent vectors per id,
pooled like A: exactly what a DeepFM's FM part can represent.  C: non-linear terms of the
dense values.  Each part is standardised on a calibration sample and weighted by its variance
share; the total logit spread is ``--signal``, the bias sets ``--ctr``.  The oracle AUC is
exact (Mann-Whitney on the true probabilities of all rows).

Layout::

    out/train/part-00000.txt ...  out/test/part-00000.txt ...   Paddle slot text
    out/truth/train-part-00000.npy  float32 true click probability per line
    out/schema.toml                the mpips schema of the files (``--schema``)
    out/meta.json                  facts: rows, ids, mean ids per example, oracle AUC, ...

CLI::

    python -m data_prep.multihot_synth --out DIR --rows 1000000 --test-rows 200000 \\
        [--slots 300] [--seed 0] [--parts 8] [--interactions 0] [--pooling sum] ...

Numpy-vectorised in blocks of ``BLOCK_ROWS`` rows (memory bounded whatever the row count);
the text is formatted by one numba kernel per block.
"""
import argparse
import json
import os
import time

import numpy as np
from numba import njit

from data_prep.criteo_like import _hash_normal, _mix64, _power_rank, calibrate
from mpips.data.synth import _sigmoid, _split_rows, auc

VERSION = 1
BLOCK_ROWS = 2048        # rows generated and formatted at a time (~0.9M ids at 450 a row)
CALIB_ROWS = 20_000
N_PAIRS = 12             # slot pairs of the interaction part
LATENT = 4               # latent dimension of the interaction part
DENSE_DECIMALS = 4
RANK_BITS = 23           # feasign key = slot << RANK_BITS | rank: cards below 2**23
MAX_SLOTS = 20_000       # slot indices are int16 while sampling
LABEL_SLOT, DENSE_SLOT = "click", "dense_feature"
TOKEN_ORDERS = ("feasign:slot", "slot:feasign")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M32 = np.uint64(0xFFFFFFFF)


def _geo_mean_trunc(q, c):
    """E[min(G, c)] for G geometric with P(G >= k) = q**k (vectorised; q < 1, c >= 0)."""
    return np.where(q > 0, q * (1.0 - q ** c) / np.maximum(1.0 - q, 1e-300), 0.0)


class MultiHot:
    """The hidden generative model; depends on its constructor arguments only."""

    def __init__(self, seed=0, slots=300, ids_per_example=None, dense=4, max_card=200_000,
                 signal=1.6, interactions=0.0, dense_share=0.15, ctr=0.2, pooling="sum",
                 feasign_bits=32):
        ids_per_example = 1.5 * slots if ids_per_example is None else ids_per_example
        if not 2 <= slots <= MAX_SLOTS or dense < 0:
            raise ValueError(f"need 2 <= slots <= {MAX_SLOTS} and dense >= 0; got slots={slots}, "
                             f"dense={dense}")
        if not 10 <= max_card < 1 << RANK_BITS:
            raise ValueError(f"need 10 <= max_card < 2**{RANK_BITS}; got {max_card}")
        if not (0 <= interactions and 0 <= dense_share and interactions + dense_share < 1):
            raise ValueError("need interactions >= 0, dense_share >= 0 and their sum < 1; got "
                             f"{interactions} and {dense_share}")
        if dense == 0 and dense_share > 0:
            raise ValueError("--dense-share > 0 needs --dense > 0")
        if not 0 < ctr < 1 or signal < 0 or pooling not in ("sum", "mean"):
            raise ValueError(f"need 0 < ctr < 1, signal >= 0, pooling sum|mean; got ctr={ctr}, "
                             f"signal={signal}, pooling={pooling!r}")
        if feasign_bits not in (32, 64):
            raise ValueError(f"feasign_bits must be 32 or 64; got {feasign_bits}")
        if feasign_bits == 32 and slots >= 1 << (32 - RANK_BITS):
            raise ValueError(f"32-bit feasigns hold at most {1 << (32 - RANK_BITS)} slots; "
                             "use --feasign-bits 64")
        self.args = dict(seed=seed, slots=slots, ids_per_example=ids_per_example, dense=dense,
                         max_card=max_card, signal=signal, interactions=interactions,
                         dense_share=dense_share, ctr=ctr, pooling=pooling,
                         feasign_bits=feasign_bits)
        self.S, self.D, self.pooling, self.bits = slots, dense, pooling, feasign_bits
        rng = np.random.default_rng([seed, 0x3A17B07])
        S = slots
        self.card = np.round(np.exp(rng.uniform(np.log(10), np.log(max_card), S))).astype(np.int64)
        self.zipf_a = rng.uniform(1.05, 1.4, S)
        self.present = np.where(rng.random(S) < 0.5, 1.0, rng.uniform(0.3, 0.95, S))
        kind = rng.choice(3, S, p=[0.5, 0.35, 0.15])           # single, short, long
        self.cap = np.where(kind == 0, 1, np.where(kind == 1, rng.integers(3, 11, S),
                                                   rng.integers(20, 51, S))).astype(np.int64)
        base_mu = np.where(kind == 0, 0.0, np.where(kind == 1, rng.uniform(0.3, 2.0, S),
                                                    rng.uniform(3.0, 15.0, S)))
        self.q = self._fit_lengths(base_mu, ids_per_example)
        self.order = rng.permutation(S)                        # slot order on a line
        self.slot_w = rng.lognormal(0.0, 0.5, S) * (rng.random(S) < 0.67)
        self.seed64 = np.uint64(seed & 0xFFFFFFFF)
        self.slot_key = _mix64((np.uint64(self.seed64) << np.uint64(24))
                               ^ np.arange(S, dtype=np.uint64) * np.uint64(0x10001))
        multi = np.flatnonzero(self.present > 0.5)
        pairs = set()
        while len(pairs) < min(N_PAIRS, len(multi) * (len(multi) - 1) // 2):
            a, b = sorted(rng.choice(multi, 2, replace=False).tolist())
            pairs.add((a, b))
        self.pairs = sorted(pairs)
        self.dense_mu = rng.uniform(-3.0, 0.0, dense)
        self.dense_sigma = rng.uniform(0.5, 1.5, dense)
        self.dense_w = rng.normal(0, 1, dense)
        self.dense_c = rng.uniform(-0.5, 0.5, dense)
        self.mul32 = np.uint64(int(rng.integers(0, 1 << 31)) * 2 + 1)
        self.add32 = np.uint64(int(rng.integers(0, 1 << 32)))
        self.part_scale = np.ones(3)
        self.part_w = np.sqrt([1.0 - interactions - dense_share, interactions, dense_share])
        self.bias = 0.0
        crng = np.random.default_rng([seed, 0xCA11B])
        parts = np.concatenate([self._parts(self.sample(crng, min(BLOCK_ROWS, CALIB_ROWS - i)))
                                for i in range(0, CALIB_ROWS, BLOCK_ROWS)])  # memory bounded
        self.part_scale, self.logit_scale, self.bias = calibrate(parts, self.part_w, signal, ctr)

    def _fit_lengths(self, base_mu, target):
        """Geometric q per slot so that the expected ids per line is ``target`` (bisection on
        a factor of the multi-valued slots' mean extra length; closed-form expectation)."""
        def expected(f):
            mu = base_mu * f
            return float((self.present * (1.0 + _geo_mean_trunc(mu / (1.0 + mu), self.cap - 1))).sum())
        lo, hi = 0.0, 1e6
        if not expected(lo) <= target <= expected(hi):
            raise ValueError(f"ids_per_example {target:g} is out of reach for this slot layout "
                             f"({expected(lo):.0f}..{expected(hi):.0f}); change it or --slots")
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected(mid) < target else (lo, mid)
        mu = base_mu * (lo + hi) / 2
        self.expected_ids = expected((lo + hi) / 2)
        return mu / (1.0 + mu)

    # ---------------------------------------------------------------- features
    def sample(self, rng, n: int) -> dict:
        """n rows: lengths (n,S), slot and rank per id (example-major), dense (n,D)."""
        S = self.S
        u = rng.random((n, S))
        extra = np.floor(np.log1p(-u) / np.log(np.where(self.q > 0, self.q, 0.5)))
        lengths = 1 + np.minimum(np.where(self.q > 0, extra, 0), self.cap - 1).astype(np.int64)
        lengths[rng.random((n, S)) >= self.present] = 0
        flat = lengths.ravel()
        slot = np.repeat(np.tile(np.arange(S, dtype=np.int16), n), flat)
        # ranks slot by slot (one power law each), put back in example-major order
        by_slot = np.argsort(slot, kind="stable")
        counts = np.bincount(slot, minlength=S)
        ranks_sorted = np.empty(slot.size, np.int64)
        uu = rng.random(slot.size)
        start = 0
        for s in range(S):
            end = start + counts[s]
            ranks_sorted[start:end] = _power_rank(uu[start:end], int(self.card[s]), self.zipf_a[s])
            start = end
        rank = np.empty_like(ranks_sorted)
        rank[by_slot] = ranks_sorted
        x = np.exp(rng.normal(self.dense_mu, self.dense_sigma, (n, self.D)))
        dense = np.round(np.minimum(x, 100.0), DENSE_DECIMALS)
        return {"lengths": lengths, "slot": slot.astype(np.int64), "rank": rank, "dense": dense}

    def feasigns(self, slot, rank):
        """uint64 feasign per id: a bijection of slot << RANK_BITS | rank (32 or 64 bits)."""
        key = (slot.astype(np.uint64) << np.uint64(RANK_BITS)) | rank.astype(np.uint64)
        if self.bits == 64:
            return _mix64(key ^ self.slot_key[0])
        with np.errstate(over="ignore"):
            x = (key * self.mul32 + self.add32) & _M32
            x ^= x >> np.uint64(16)
            x = (x * np.uint64(0x45D9F3B)) & _M32
            x ^= x >> np.uint64(16)
        return x

    # ---------------------------------------------------------------- click model
    def _hkey(self, tag, slot, rank):
        with np.errstate(over="ignore"):
            return ((rank.astype(np.uint64) + np.uint64(1)) * _GOLDEN) ^ _mix64(
                self.slot_key[slot] + np.uint64(tag))

    def _pool(self, f, s):
        """Pooled (sum or mean) value per bag of a per-id quantity; (n*S,) bag order."""
        lengths = s["lengths"].ravel()
        bag = np.repeat(np.arange(lengths.size), lengths)
        w = f if self.pooling == "sum" else f / lengths[bag]
        return np.bincount(bag, weights=w, minlength=lengths.size)

    def _parts(self, s):
        """(n, 3) unscaled parts A (id effects), B (pairwise FM terms), C (dense terms)."""
        n = s["lengths"].shape[0]
        S = self.S
        out = np.zeros((n, 3))
        slot, rank = s["slot"], s["rank"]
        sig = self.slot_w != 0
        eff = np.zeros(slot.size)
        m = sig[slot]
        eff[m] = self.slot_w[slot[m]] * _hash_normal(self._hkey(1, slot[m], rank[m]))
        out[:, 0] = self._pool(eff, s).reshape(n, S).sum(axis=1)
        if self.part_w[1] > 0:
            for a, b in self.pairs:
                ua = self._latent(s, a, 2)
                vb = self._latent(s, b, 3)
                out[:, 1] += (ua * vb).sum(axis=1)
        if self.D:
            lx = np.log(s["dense"] + 1e-3)
            c = self.dense_w * np.tanh((lx - self.dense_mu) / self.dense_sigma + self.dense_c)
            out[:, 2] = c.sum(axis=1) + 0.5 * np.sin(2 * lx[:, 0])
        return out

    def _latent(self, s, k, tag):
        """(n, LATENT) pooled hashed latent vectors of slot k's bags."""
        n = s["lengths"].shape[0]
        m = s["slot"] == k
        lengths = s["lengths"][:, k]
        row = np.repeat(np.arange(n), lengths)
        out = np.zeros((n, LATENT))
        h = self._hkey(tag, s["slot"][m], s["rank"][m])
        div = 1.0 if self.pooling == "sum" else lengths[row]
        for j in range(LATENT):
            with np.errstate(over="ignore"):
                v = _hash_normal(h + np.uint64(j) * _GOLDEN)
            out[:, j] = np.bincount(row, weights=v / div, minlength=n)
        return out

    def prob(self, s):
        return _sigmoid((self._parts(s) @ (self.part_scale * self.part_w)) * self.logit_scale
                        + self.bias)

    def summary(self) -> dict:
        return {"args": self.args, "cardinalities": self.card.tolist(),
                "zipf_a": np.round(self.zipf_a, 4).tolist(),
                "present": np.round(self.present, 4).tolist(), "bag_cap": self.cap.tolist(),
                "expected_ids_per_example": round(self.expected_ids, 3),
                "signal_slots": [str(k + 1) for k in np.flatnonzero(self.slot_w)],
                "interactions": bool(self.part_w[1] > 0),
                "interaction_pairs": ([[str(a + 1), str(b + 1)] for a, b in self.pairs]
                                      if self.part_w[1] > 0 else []),
                "interaction_latent_dim": LATENT if self.part_w[1] > 0 else 0,
                "bias": float(self.bias), "logit_scale": float(self.logit_scale)}


# -------------------------------------------------------------------- formatting
_POW10 = np.array([10 ** k for k in range(1, 20)], np.uint64)


@njit(cache=True, nogil=True)
def _put_uint(out, p, v, write):
    """Decimal digits of uint64 v at out[p:]; returns the new position.  All arithmetic
    stays uint64 (numba turns uint64 op int64 into float64)."""
    nd = 1
    while nd < 20 and v >= _POW10[nd - 1]:
        nd += 1
    if write:
        ten = np.uint64(10)
        t = v
        for d in range(nd - 1, -1, -1):
            out[p + d] = np.uint8(48) + np.uint8(t % ten)
            t //= ten
    return p + nd


@njit(cache=True, nogil=True)
def _put_name(out, p, names, name_off, k, write):
    a, b = name_off[k], name_off[k + 1]
    if write:
        out[p:p + b - a] = names[a:b]
    return p + b - a


@njit(cache=True, nogil=True)
def _put_fixed(out, p, v, decimals, write):
    """Non-negative fixed-point v / 10**decimals with exactly ``decimals`` decimals."""
    scale = 1
    for _ in range(decimals):
        scale *= 10
    p = _put_uint(out, p, np.uint64(v // scale), write)
    if write:
        out[p] = 46
        f = v % scale
        for d in range(decimals - 1, -1, -1):
            out[p + 1 + d] = 48 + f % 10
            f //= 10
    return p + 1 + decimals


@njit(cache=True, nogil=True)
def _lines(out, write, labels, dense, decimals, lengths, offsets, feasigns, order, names,
           name_off, feasign_first):
    """Slot text of the rows (pass write=False: byte count only).  Name k < S is slot k's;
    S is the label's, S + 1 the dense slot's."""
    n, S = lengths.shape
    p = 0
    for i in range(n):
        for t in range(1 + dense.shape[1]):         # label, then the dense values
            k = S if t == 0 else S + 1
            if not feasign_first:
                p = _put_name(out, p, names, name_off, k, write)
                if write:
                    out[p] = 58
                p += 1
            if t == 0:
                p = _put_uint(out, p, np.uint64(labels[i]), write)
            else:
                p = _put_fixed(out, p, dense[i, t - 1], decimals, write)
            if feasign_first:
                if write:
                    out[p] = 58
                p = _put_name(out, p + 1, names, name_off, k, write)
            if write:
                out[p] = 32
            p += 1
        for j in range(S):
            s = order[j]
            for q in range(offsets[i * S + s], offsets[i * S + s + 1]):
                if feasign_first:
                    p = _put_uint(out, p, feasigns[q], write)
                    if write:
                        out[p] = 58
                    p = _put_name(out, p + 1, names, name_off, s, write)
                else:
                    p = _put_name(out, p, names, name_off, s, write)
                    if write:
                        out[p] = 58
                    p = _put_uint(out, p + 1, feasigns[q], write)
                if write:
                    out[p] = 32
                p += 1
        if write:
            out[p - 1] = 10                         # the last space becomes the newline
    return p


def _name_table(S: int):
    """(bytes uint8, offsets) of the names: slots "1".."S", then the label and dense slot."""
    names = [str(k + 1).encode() for k in range(S)] + [LABEL_SLOT.encode(), DENSE_SLOT.encode()]
    off = np.zeros(len(names) + 1, np.int64)
    off[1:] = np.cumsum([len(x) for x in names])
    return np.frombuffer(b"".join(names), np.uint8).copy(), off


def format_block(model: MultiHot, labels, s, feasigns, token_order="feasign:slot") -> np.ndarray:
    """Slot text bytes (uint8) of one block of rows."""
    lengths = np.ascontiguousarray(s["lengths"], np.int64)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths.ravel(), out=offsets[1:])
    dense = np.rint(s["dense"] * 10 ** DENSE_DECIMALS).astype(np.int64)
    names, off = _name_table(model.S)
    args = (np.ascontiguousarray(labels, np.int64), dense, DENSE_DECIMALS, lengths, offsets,
            np.ascontiguousarray(feasigns, np.uint64), model.order.astype(np.int64), names, off,
            token_order == "feasign:slot")
    out = np.empty(_lines(np.empty(0, np.uint8), False, *args), np.uint8)
    _lines(out, True, *args)
    return out


def schema_toml(model: MultiHot, token_order="feasign:slot") -> str:
    """The mpips schema (``--schema``) of the files this model writes."""
    names = ", ".join(f'"{k + 1}"' for k in range(model.S))
    dense = (f'\n[[dense]]\nnames = ["{DENSE_SLOT}"]\ndim = {model.D}\nnorm = "none"  '
             "# written already normalised\n" if model.D else "")
    return (f"# written by data_prep.multihot_synth (seed {model.args['seed']}): Paddle slot "
            f"text, {model.S} sparse slots\nformat = \"slot\"\ntoken_order = \"{token_order}\"\n"
            f"label = \"{LABEL_SLOT}\"\n{dense}\n[[sparse]]\nnames = [{names}]\n"
            f"pooling = \"{model.pooling}\"\n")


class _SplitStats:
    """Running facts of one split."""

    def __init__(self, model):
        S = model.S
        self.y, self.p = [], []
        self.ids = self.rows = self.bytes = 0
        self.min_ids, self.max_ids = 1 << 62, 0
        self.bag_hist = np.zeros(1, np.int64)
        self.missing = np.zeros(S, np.int64)
        self.card_off = np.concatenate([[0], np.cumsum(model.card)[:-1]])
        self.seen = np.zeros(int(model.card.sum()), np.bool_)  # (slot, rank) seen

    def update(self, y, p, s, nbytes):
        L = s["lengths"]
        per_row = L.sum(axis=1)
        self.y.append(y)
        self.p.append(p)
        self.rows += L.shape[0]
        self.ids += int(per_row.sum())
        self.bytes += nbytes
        self.min_ids = min(self.min_ids, int(per_row.min()))
        self.max_ids = max(self.max_ids, int(per_row.max()))
        h = np.bincount(L.ravel())
        if h.size > self.bag_hist.size:
            h[:self.bag_hist.size] += self.bag_hist
            self.bag_hist = h
        else:
            self.bag_hist[:h.size] += h
        self.missing += (L == 0).sum(axis=0)
        self.seen[self.card_off[s["slot"]] + s["rank"]] = True

    def facts(self) -> dict:
        y, p = np.concatenate(self.y), np.concatenate(self.p).astype(np.float64)
        pc = np.clip(p, 1e-15, 1 - 1e-15)
        bags = self.bag_hist[1:]
        return {"rows": self.rows, "ids": self.ids, "mean_ids_per_example": self.ids / self.rows,
                "min_ids_per_example": self.min_ids, "max_ids_per_example": self.max_ids,
                "bag_length_max": int(bags.nonzero()[0].max() + 1) if bags.any() else 0,
                "bag_length_hist": bags.tolist(),
                "single_id_bag_share": float(bags[0] / max(bags.sum(), 1)) if bags.size else 0.0,
                "missing_slot_share": float(self.missing.sum() / (self.rows * self.missing.size)),
                "ctr": float(y.mean()), "oracle_auc": auc(y, p),
                "oracle_logloss": float(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc))),
                "bytes": self.bytes, "distinct_ids": int(self.seen.sum())}


def _write_part(model, path, truth_path, n, rng, stats, token_order):
    truth = np.lib.format.open_memmap(truth_path, mode="w+", dtype=np.float32, shape=(n,))
    with open(path, "wb") as f:
        for start in range(0, n, BLOCK_ROWS):
            m = min(BLOCK_ROWS, n - start)
            s = model.sample(rng, m)
            p = model.prob(s)
            y = (rng.random(m) < p).astype(np.int8)
            text = format_block(model, y, s, model.feasigns(s["slot"], s["rank"]), token_order)
            f.write(text.data)
            truth[start:start + m] = p
            stats.update(y, p, s, text.size)
    truth.flush()
    del truth


def generate(out_dir, rows, test_rows=0, parts=8, seed=0, token_order="feasign:slot",
             **model_args) -> dict:
    """Write the data set, its schema and facts; returns the facts (also ``meta.json``)."""
    if rows < 1 or parts < 1 or test_rows < 0:
        raise ValueError(f"need rows >= 1, parts >= 1, test_rows >= 0; got rows={rows}, "
                         f"parts={parts}, test_rows={test_rows}")
    if token_order not in TOKEN_ORDERS:
        raise ValueError(f"token_order must be one of {TOKEN_ORDERS}; got {token_order!r}")
    t_start, cpu_start = time.time(), time.process_time()
    model = MultiHot(seed=seed, **model_args)
    meta = {"generator": "data_prep.multihot_synth", "version": VERSION, "seed": seed,
            "parts": parts, "format": "slot", "token_order": token_order,
            "slots": model.S, "dense": model.D, "label_slot": LABEL_SLOT,
            "dense_slot": DENSE_SLOT, "schema": "schema.toml"}
    os.makedirs(os.path.join(out_dir, "truth"), exist_ok=True)
    train_seen = None
    for name, n, stream in [("train", rows, 1)] + ([("test", test_rows, 2)] if test_rows else []):
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        stats = _SplitStats(model)
        for i, m in enumerate(_split_rows(n, parts)):
            _write_part(model, os.path.join(out_dir, name, f"part-{i:05d}.txt"),
                        os.path.join(out_dir, "truth", f"{name}-part-{i:05d}.npy"), m,
                        np.random.default_rng([seed, stream, i]), stats, token_order)
        meta[name] = stats.facts()
        if name == "train":
            train_seen = stats.seen
        else:
            meta[name]["ids_not_in_train"] = int((stats.seen & ~train_seen).sum())
    with open(os.path.join(out_dir, "schema.toml"), "w") as f:
        f.write(schema_toml(model, token_order))
    meta["model"] = model.summary()
    meta["seconds"] = round(time.time() - t_start, 3)
    cpu = time.process_time() - cpu_start         # not inflated by other jobs on the machine
    meta["rows_per_cpu_second"] = round((rows + test_rows) / max(cpu, 1e-9))
    tmp = os.path.join(out_dir, ".meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_prep.multihot_synth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--rows", type=int, required=True, help="training rows")
    ap.add_argument("--test-rows", type=int, default=0, help="test rows (default 0: none)")
    ap.add_argument("--parts", type=int, default=8, help="files per split (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, default=300, help="sparse slots (default 300)")
    ap.add_argument("--ids-per-example", type=float, default=None,
                    help="mean ids per line over all slots (default 1.5 x slots)")
    ap.add_argument("--dense", type=int, default=4, help="dense values per line (default 4)")
    ap.add_argument("--max-card", type=int, default=200_000,
                    help="largest slot vocabulary (default 200000)")
    ap.add_argument("--signal", type=float, default=1.6,
                    help="std of the true logit: larger = easier (default 1.6)")
    ap.add_argument("--interactions", type=float, default=0.0,
                    help="share of the logit variance in pairwise (FM) slot interactions "
                         "(default 0: none)")
    ap.add_argument("--dense-share", type=float, default=0.15,
                    help="share of the logit variance from the dense values (default 0.15)")
    ap.add_argument("--ctr", type=float, default=0.2, help="base CTR (default 0.2)")
    ap.add_argument("--pooling", default="sum", choices=("sum", "mean"),
                    help="pooling of the hidden model and of the schema (default sum)")
    ap.add_argument("--feasign-bits", type=int, default=32, choices=(32, 64),
                    help="feasign width (default 32; 64 as Paddle's hashed feasigns)")
    ap.add_argument("--token-order", default="feasign:slot", choices=TOKEN_ORDERS)
    a = ap.parse_args(argv)
    try:
        meta = generate(a.out, a.rows, a.test_rows, a.parts, a.seed, token_order=a.token_order,
                        slots=a.slots, ids_per_example=a.ids_per_example, dense=a.dense,
                        max_card=a.max_card, signal=a.signal, interactions=a.interactions,
                        dense_share=a.dense_share, ctr=a.ctr, pooling=a.pooling,
                        feasign_bits=a.feasign_bits)
    except ValueError as exc:
        ap.error(str(exc))
    for split in ("train", "test"):
        if split in meta:
            m = meta[split]
            extra = (f", {m['ids_not_in_train']} not in train" if "ids_not_in_train" in m
                     else "")
            print(f"{split}: {m['rows']} rows in {a.parts} parts, {m['ids']} ids "
                  f"({m['mean_ids_per_example']:.1f} a line, {m['min_ids_per_example']}.."
                  f"{m['max_ids_per_example']}), bags up to {m['bag_length_max']}, "
                  f"{m['distinct_ids']} distinct ids{extra}, ctr {m['ctr']:.4f}, oracle auc "
                  f"{m['oracle_auc']:.4f} logloss {m['oracle_logloss']:.4f}, "
                  f"{m['bytes'] / 1e6:.0f} MB")
    print(f"wrote {a.out} (schema {os.path.join(a.out, 'schema.toml')}) in {meta['seconds']:.1f}s "
          f"({meta['rows_per_cpu_second']} rows per CPU second)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
