"""A two-label synthetic set (click, purchase) where a purchase follows a click, with a
known optimum: PaddleRec's multi-task CSV layout (``click,purchase,f1,...``).

Hidden model (all drawn from ``--seed``):

* ``--slots`` categorical columns ``C1..CS`` (cardinalities log-spaced in 20..``--max-card``,
  ids drawn with a power law) and 3 dense columns ``I1..I3`` uniform in [0, 1);
* two Gaussian effects per id: a click effect and a conversion effect, correlated by
  ``--shared`` (0: unrelated tasks, 1: the same effect), plus a non-linear dense term each;
* ``pCTR = sigmoid(b_c + sum of click effects + g_c(dense))``,
  ``pCVR = sigmoid(b_v + sum of conversion effects + g_v(dense))``;
* ``click ~ Bernoulli(pCTR)``, ``purchase = click x Bernoulli(pCVR)``: the purchase label
  is click-and-purchase over all impressions, as ESMM's CTCVR.

Oracle (best achievable) AUCs, written to ``oracle.json`` and printed, computed exactly
(Mann-Whitney) on each split with the true probabilities:

* ``click``: pCTR against click;
* ``purchase``: pCTR x pCVR against purchase (the pCTCVR task);
* ``cvr_clicked``: pCVR against purchase on the clicked rows (ESMM's CVR figure).

Layout::

    out/train.csv  out/test.csv    header click,purchase,I1,I2,I3,C1..CS
    out/schema.toml                label = ["click", "purchase"]; dense norm "none"
    out/oracle.json                the oracle AUCs of both splits

    python -m data_prep.two_labels --out D --rows 200000 --test-rows 50000
"""
import argparse
import json
import os
import sys

import numpy as np

from mpips.data.synth import auc


def _effects(rng, cards, shared, scale):
    """Per slot (click effects, conversion effects), each (card,), correlated by ``shared``."""
    out = []
    for v in cards:
        a, b = rng.standard_normal(v), rng.standard_normal(v)
        out.append((scale * a, scale * (shared * a + np.sqrt(1 - shared ** 2) * b)))
    return out


def _ids(rng, cards, n):
    """(n, S) ids, a power law per slot."""
    cols = []
    for v in cards:
        p = (np.arange(v) + 1.0) ** -1.1
        cols.append(rng.choice(v, size=n, p=p / p.sum()))
    return np.stack(cols, 1)


def make(rows, seed=0, slots=8, max_card=2000, shared=0.5, ctr_bias=-1.0, cvr_bias=-1.0,
         scale=0.6):
    """(labels (n, 2) int8, dense (n, 3), ids (n, S), pctr (n,), pcvr (n,)) of ``rows``
    examples; the model is drawn from ``seed`` (splits of one seed share it)."""
    model = np.random.default_rng(seed)
    cards = np.unique(np.geomspace(20, max_card, slots).astype(int)).tolist()
    cards += [max_card] * (slots - len(cards))
    eff = _effects(model, cards, shared, scale)
    return cards, eff, (ctr_bias, cvr_bias)


def sample(model, n, rng):
    cards, eff, (bc, bv) = model
    ids = _ids(rng, cards, n)
    dense = rng.random((n, 3))
    zc = bc + sum(e[0][ids[:, s]] for s, e in enumerate(eff)) + \
        1.5 * np.sin(3 * dense[:, 0]) - dense[:, 1]
    zv = bv + sum(e[1][ids[:, s]] for s, e in enumerate(eff)) + \
        2.0 * (dense[:, 2] - 0.5) ** 2 + dense[:, 1]
    pctr, pcvr = 1 / (1 + np.exp(-zc)), 1 / (1 + np.exp(-zv))
    click = rng.random(n) < pctr
    buy = click & (rng.random(n) < pcvr)
    return np.stack([click, buy], 1).astype(np.int8), dense, ids, pctr, pcvr


def write_csv(path, labels, dense, ids):
    S = ids.shape[1]
    head = "click,purchase,I1,I2,I3," + ",".join(f"C{s + 1}" for s in range(S))
    cols = [labels[:, 0].astype(str), labels[:, 1].astype(str)]
    cols += [np.char.mod("%.5f", dense[:, j]) for j in range(3)]
    cols += [np.char.add(f"s{s + 1}_", ids[:, s].astype(str)) for s in range(S)]
    lines = cols[0]
    for c in cols[1:]:
        lines = np.char.add(np.char.add(lines, ","), c)
    with open(path, "w") as f:
        f.write(head + "\n")
        f.write("\n".join(lines.tolist()) + "\n")


def schema_text(slots):
    names = ", ".join(f'"C{s + 1}"' for s in range(slots))
    return ('format = "csv"\nlabel = ["click", "purchase"]\n\n[[dense]]\n'
            'names = ["I1", "I2", "I3"]\nnorm = "none"\n\n[[sparse]]\n'
            f'names = [{names}]\n')


def oracle(labels, pctr, pcvr):
    clicked = labels[:, 0] == 1
    return {"click": auc(labels[:, 0], pctr), "purchase": auc(labels[:, 1], pctr * pcvr),
            "cvr_clicked": auc(labels[clicked, 1], pcvr[clicked]),
            "rows": int(len(labels)), "ctr": float(labels[:, 0].mean()),
            "purchase_rate": float(labels[:, 1].mean())}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m data_prep.two_labels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--rows", type=int, required=True, help="training rows")
    ap.add_argument("--test-rows", type=int, default=0, help="test rows (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, default=8, help="categorical columns (default 8)")
    ap.add_argument("--max-card", type=int, default=2000, help="largest cardinality")
    ap.add_argument("--shared", type=float, default=0.5,
                    help="correlation of an id's click and conversion effects (0..1)")
    a = ap.parse_args(argv)
    if not 0 <= a.shared <= 1 or a.rows < 1 or a.slots < 1:
        ap.error("--shared must be in [0, 1], --rows and --slots >= 1")
    os.makedirs(a.out, exist_ok=True)
    model = make(a.rows, a.seed, a.slots, a.max_card, a.shared)
    report = {}
    for split, n, k in (("train", a.rows, 1), ("test", a.test_rows, 2)):
        if n:
            labels, dense, ids, pctr, pcvr = sample(model, n, np.random.default_rng([a.seed, k]))
            write_csv(os.path.join(a.out, f"{split}.csv"), labels, dense, ids)
            report[split] = oracle(labels, pctr, pcvr)
    with open(os.path.join(a.out, "schema.toml"), "w") as f:
        f.write(schema_text(a.slots))
    with open(os.path.join(a.out, "oracle.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
