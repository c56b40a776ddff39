"""A behaviour-sequence set in PaddleRec's DIN sample format, with a known optimum.

A line is ``hist_items;hist_cats;target_item;target_cat;label``: the user's history of item
ids and their categories (space-separated, oldest first, so the newest id is the LAST one),
the target item and its category, and the click, no header (PaddleRec's
``models/rank/din`` data).  Histories are 3 to 40 items long (``--min-len``, ``--max-len``).

Hidden model.  Items belong to one of ``--cats`` categories; each item has a popularity
effect ``b_item`` ~ N(0, 0.5^2).  A user has 1 to 3 interest categories; each history item
comes from one of them with probability 0.8 (else any item).  The target is an item of an
interest with probability 0.5 (else any item).  The click's logit is

    bias + 1.6 * tanh(m / 2) + 0.8 * [target item among the 10 newest] + b_item(target),
    m = sum over the history of 0.85 ** age * [category == target's],

``age`` 0 for the newest id.  So the click depends on how the target matches the history,
the newest items counting most: what attention over the history (DIN) computes, and what a
sum of the history's embeddings blurs.  The oracle AUC (Mann-Whitney on the true
probabilities of the test rows) is written to ``meta.json`` and printed.

Layout::

    out/train.txt  out/test.txt        the lines
    out/schema.toml                    the mpips schema: attention pooling, shared tables
    out/schema_sum.toml                the same with the histories pooled by sum
    out/meta.json                      rows, ctr, mean history length, oracle AUC

CLI::

    python -m data_prep.din_synth --out DIR --rows 200000 --test-rows 50000 [--seed 0]
"""
import argparse
import json
import os

import numpy as np

RECENT = 10            # the newest ids whose item match adds to the click
DECAY = 0.85           # weight of a category match per step of age
P_INTEREST = 0.8       # history items from the user's interests
P_TARGET = 0.5         # targets from the user's interests

SCHEMA = """# {what}: python -m data_prep.din_synth (docs/sequences.md)
format = "csv"
header = false
delimiter = ";"
label = "label"
fields = ["hist_items", "hist_cats", "target_item", "target_cat", "label"]

[[sparse]]
names = ["hist_items"]
separator = " "
table = "item"
{pool}max_len = {max_len}
keep = "last"

[[sparse]]
names = ["hist_cats"]
separator = " "
table = "cat"
{pool_cat}max_len = {max_len}
keep = "last"

[[sparse]]
names = ["target_item"]
table = "item"

[[sparse]]
names = ["target_cat"]
table = "cat"
"""


def schema_text(pooling, max_len):
    """The schema of the files: histories pooled by ``attention`` (queried by the target)
    or by ``sum``."""
    if pooling == "attention":
        pool = 'pooling = "attention"\nquery = "target_item"\n'
        pool_cat = 'pooling = "attention"\nquery = "target_cat"\n'
    else:
        pool = pool_cat = f'pooling = "{pooling}"\n'
    return SCHEMA.format(what=f"histories pooled by {pooling}", pool=pool, pool_cat=pool_cat,
                         max_len=max_len)


def world(rng, n_items, n_cats):
    """Each item's category (every category non-empty) and popularity effect."""
    cat = np.concatenate([np.arange(n_cats), rng.integers(0, n_cats, n_items - n_cats)])
    rng.shuffle(cat)
    order = np.argsort(cat, kind="stable")
    starts = np.searchsorted(cat[order], np.arange(n_cats + 1))
    return cat, order, starts, 0.5 * rng.standard_normal(n_items)


def pick_in(rng, cats, order, starts):
    """A uniform item of each category in ``cats``."""
    lo, hi = starts[cats], starts[cats + 1]
    return order[lo + (rng.random(len(cats)) * (hi - lo)).astype(np.int64)]


def rows(rng, n, w, n_items, n_cats, lens):
    """(histories: list of item arrays oldest first, targets, true click probabilities)."""
    cat, order, starts, b_item = w
    n_int = rng.integers(1, 4, n)
    interests = rng.integers(0, n_cats, (n, 3))
    L = rng.integers(lens[0], lens[1] + 1, n)
    tot = int(L.sum())
    ex = np.repeat(np.arange(n), L)
    which = interests[ex, (rng.random(tot) * n_int[ex]).astype(np.int64)]
    hist = np.where(rng.random(tot) < P_INTEREST, pick_in(rng, which, order, starts),
                    rng.integers(0, n_items, tot))
    t_int = interests[np.arange(n), (rng.random(n) * n_int).astype(np.int64)]
    target = np.where(rng.random(n) < P_TARGET, pick_in(rng, t_int, order, starts),
                      rng.integers(0, n_items, n))
    ends = np.cumsum(L)
    age = ends[ex] - 1 - np.arange(tot)                      # 0 = the newest
    m = np.bincount(ex, DECAY ** age * (cat[hist] == cat[target][ex]), minlength=n)
    recent = np.bincount(ex, (age < RECENT) & (hist == target[ex]), minlength=n) > 0
    logit = 1.6 * np.tanh(m / 2) + 0.8 * recent + b_item[target]
    return np.split(hist, ends[:-1]), target, logit


def oracle_auc(p, y):
    """Mann-Whitney AUC of scores ``p`` for labels ``y`` (ties count half)."""
    order = np.argsort(p, kind="stable")
    ps = p[order]
    ranks = np.empty(len(p))
    lo = np.r_[0, np.flatnonzero(np.diff(ps)) + 1]
    hi = np.r_[lo[1:], len(p)]
    ranks[order] = np.repeat((lo + hi + 1) / 2.0, hi - lo)
    pos = y > 0
    npos = pos.sum()
    return float((ranks[pos].sum() - npos * (npos + 1) / 2) / (npos * (len(y) - npos)))


def write(path, hist, target, cat, y):
    with open(path, "w") as f:
        for h, t, lab in zip(hist, target, y):
            f.write(f"{' '.join(map(str, h))};{' '.join(map(str, cat[h]))};{t};{cat[t]};"
                    f"{int(lab)}\n")


def generate(out, n_train, n_test, seed=0, n_items=5000, n_cats=100, lens=(3, 40), ctr=0.3):
    rng = np.random.default_rng(seed)
    w = world(rng, n_items, n_cats)
    hist, target, logit = rows(rng, n_train + n_test, w, n_items, n_cats, lens)
    lo, hi = -10.0, 10.0                                      # the bias that gives ``ctr``
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (1 / (1 + np.exp(-(logit + mid)))).mean() < ctr else (lo, mid)
    p = 1 / (1 + np.exp(-(logit + lo)))
    y = (rng.random(len(p)) < p).astype(np.int64)
    os.makedirs(out, exist_ok=True)
    write(os.path.join(out, "train.txt"), hist[:n_train], target[:n_train], w[0], y[:n_train])
    write(os.path.join(out, "test.txt"), hist[n_train:], target[n_train:], w[0], y[n_train:])
    for name, pooling in (("schema.toml", "attention"), ("schema_sum.toml", "sum")):
        with open(os.path.join(out, name), "w") as f:
            f.write(schema_text(pooling, lens[1]))
    meta = {"rows": n_train, "test_rows": n_test, "seed": seed, "items": n_items,
            "cats": n_cats, "history_lengths": list(lens),
            "mean_history": float(np.mean([len(h) for h in hist])), "ctr": float(y.mean()),
            "oracle_test_auc": oracle_auc(p[n_train:], y[n_train:]) if n_test else None,
            "oracle_train_auc": oracle_auc(p[:n_train], y[:n_train])}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_prep.din_synth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--rows", type=int, required=True, help="training rows")
    ap.add_argument("--test-rows", type=int, default=0, help="test rows (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--items", type=int, default=5000, help="items (default 5000)")
    ap.add_argument("--cats", type=int, default=100, help="categories (default 100)")
    ap.add_argument("--min-len", type=int, default=3, help="shortest history (default 3)")
    ap.add_argument("--max-len", type=int, default=40, help="longest history (default 40)")
    ap.add_argument("--ctr", type=float, default=0.3, help="mean click rate (default 0.3)")
    a = ap.parse_args(argv)
    if not (1 <= a.min_len <= a.max_len and a.cats <= a.items and 0 < a.ctr < 1):
        ap.error("need 1 <= --min-len <= --max-len, --cats <= --items and 0 < --ctr < 1")
    meta = generate(a.out, a.rows, a.test_rows, a.seed, a.items, a.cats,
                    (a.min_len, a.max_len), a.ctr)
    print(f"din_synth: {a.rows} train + {a.test_rows} test rows in {a.out}; mean history "
          f"{meta['mean_history']:.1f}, ctr {meta['ctr']:.3f}, oracle test AUC "
          f"{meta['oracle_test_auc']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
