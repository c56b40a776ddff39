"""Synthetic stream of passes for online training: DIR/YYYYMMDD/HH/part-*.txt + _SUCCESS.

Built on data_prep.synth's hidden model, with time:
- **new ids appear, old ones fade**: in the high-cardinality slots the id of popularity rank
  r at pass t is `r + t * shift`, so each pass brings `shift` new ids per such slot at the
  head of the Zipf law and lets the oldest ones slide into the tail and vanish;
- **drift**: the per-id effects of the hidden model take a small random-walk step per pass.
An id's effect belongs to the id (not to its rank), so what a model learns about an id stays
true while the id lives.

    python -m data_prep.stream_synth --out DIR --days 3 --hours 24 --rows-per-pass 2000
"""
import argparse
import json
import os
from datetime import date, timedelta

import numpy as np

from mpips.data.synth import N_CAT, Model, auc, format_lines


class StreamModel(Model):
    """Model whose churning slots emit shifted ids with per-id effects that drift."""

    def __init__(self, seed, rows, passes, shift, drift):
        self.churn, self.id_effects, self.t = [], {}, 0     # plain model while calibrating
        super().__init__(seed, rows)
        rng = np.random.default_rng([seed, 0x57AE])
        paired = {k for ab in self.pairs for k in ab}
        self.churn = [k for k in range(N_CAT) if self.card[k] >= 100 and k not in paired]
        self.shift, self.drift, self.t = shift, drift, 0
        span = passes * shift
        self.id_effects = {}        # churning informative slots: effect per id, empty last
        for k in self.churn:
            if k in self.effects:
                eff = self.effects.pop(k)
                extra = rng.normal(0, eff[:-1].std() or 0.7, span)
                self.id_effects[k] = np.concatenate([eff[:-1], extra, eff[-1:]])
        self.rng = rng

    def ids(self, cats):
        """(n, 26) id index per slot at the current pass (-1 = empty)."""
        out = cats.copy()
        for k in self.churn:
            out[:, k] = np.where(cats[:, k] < 0, -1, cats[:, k] + self.t * self.shift)
        return out

    def logit(self, ints, imiss, cats):
        z = super().logit(ints, imiss, cats)          # other slots, pairs, integer features
        ids = self.ids(cats)
        for k, eff in self.id_effects.items():
            i = np.minimum(ids[:, k], len(eff) - 2)
            z += np.where(ids[:, k] < 0, eff[-1], eff[np.maximum(i, 0)])
        return z

    def hex_codes(self, cats):
        return super().hex_codes(self.ids(cats))

    def step(self):
        """Next pass: ids shift and effects drift."""
        self.t += 1
        for eff in list(self.effects.values()) + list(self.id_effects.values()):
            eff += self.drift * self.rng.normal(0, 1, eff.shape)


def write_pass(model, path, rows, parts, rng):
    """One pass folder with `parts` files, then _SUCCESS; returns (labels, probs)."""
    os.makedirs(path, exist_ok=True)
    ys, ps = [], []
    for i, n in enumerate(np.diff(np.linspace(0, rows, parts + 1).round().astype(int))):
        ints, imiss, cats = model.sample_features(rng, n)
        p = model.prob(ints, imiss, cats)
        y = (rng.random(n) < p).astype(np.int8)
        with open(os.path.join(path, f"part-{i:05d}.txt"), "wb") as f:
            f.write(format_lines(y, ints, imiss, cats, model.hex_codes(cats)).data)
        ys.append(y)
        ps.append(p)
    open(os.path.join(path, "_SUCCESS"), "w").close()
    return np.concatenate(ys), np.concatenate(ps)


def pass_names(start, days, hours):
    """['YYYYMMDD/HH', ...] in order."""
    d0 = date(int(start[:4]), int(start[4:6]), int(start[6:]))
    return [f"{(d0 + timedelta(days=d)).strftime('%Y%m%d')}/{h:02d}"
            for d in range(days) for h in range(hours)]


def generate_stream(out_dir, days=3, hours=24, rows_per_pass=2000, parts=2, seed=0,
                    start="20261129", shift=3, drift=0.01, only=None):
    """Write every pass (or only the names in `only`); return the meta dict."""
    names = pass_names(start, days, hours)
    model = StreamModel(seed, rows_per_pass * len(names), len(names), shift, drift)
    meta = {"passes": [], "rows_per_pass": rows_per_pass, "seed": seed, "shift": shift,
            "drift": drift, "churn_slots": [k + 1 for k in model.churn]}
    for t, name in enumerate(names):
        rng = np.random.default_rng([seed, 7, t])
        if only is None or name in only:
            y, p = write_pass(model, os.path.join(out_dir, name), rows_per_pass, parts, rng)
            meta["passes"].append({"name": name, "ctr": float(y.mean()), "best_auc": auc(y, p)})
        model.step()
    with open(os.path.join(out_dir, "stream_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m data_prep.stream_synth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--days", type=int, default=3)
    ap.add_argument("--hours", type=int, default=24)
    ap.add_argument("--rows-per-pass", type=int, default=2000)
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", default="20261129")
    ap.add_argument("--shift", type=int, default=3, help="new ids per churning slot per pass")
    ap.add_argument("--drift", type=float, default=0.01)
    a = ap.parse_args(argv)
    meta = generate_stream(a.out, a.days, a.hours, a.rows_per_pass, a.parts, a.seed, a.start,
                           a.shift, a.drift)
    print(f"wrote {len(meta['passes'])} passes to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
