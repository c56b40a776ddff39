"""Text schemas end to end through the real CLIs (issue 20):

- a CSV schema with 2 min-max dense columns and ``--stats``: the checkpoint records the
  run's 2 normalisation pairs; resume checks them (another file fails with one line);
  mpips.infer, mpips.export + ``Predictor.predict_lines`` give the run's test AUC;
- ``predict_lines`` on a non-Criteo bundle (CSV with a header argument, slot multi-hot)
  scores raw lines as mpips.infer scores the same lines.
"""
import json

import numpy as np
import pytest

from mpips.serving import bundle as bd
from mpips import checkpoint as ck
from mpips.metrics import BinaryMetrics
from mpips.serving import LineError, Predictor
from tests.conftest import ROOT, run_cmd
from tests.test_modes import metrics

CSV_SCHEMA = """format = "csv"
header = true
label = "click"
[[dense]]
names = ["price", "age"]
norm = "minmax"
[[sparse]]
names = ["site", "app"]
[[sparse]]
names = ["tags"]
separator = "|"
pooling = "mean"
"""
HEADER = "click,price,age,site,app,tags"
STATS = {"cont_min": [10.0, 18.0], "cont_diff": [990.0, 62.0]}


def csv_rows(rng, n):
    """Lines of HEADER's columns; the click depends on price, age, site and tags."""
    price, age = rng.uniform(10, 1000, n), rng.integers(18, 80, n)
    site, app = rng.integers(0, 20, n), rng.integers(0, 50, n)
    lines = []
    for i in range(n):
        tags = rng.choice(8, rng.integers(0, 4), replace=False)
        z = (2 * (price[i] - 500) / 990 - (age[i] - 49) / 31 + (site[i] % 3 - 1)
             + 0.5 * sum(1 if t < 4 else -1 for t in tags))
        click = int(rng.random() < 1 / (1 + np.exp(-2 * z)))
        lines.append(f"{click},{price[i]:.2f},{age[i]},s{site[i]},a{app[i]},"
                     + "|".join(f"t{t}" for t in tags))
    return lines


@pytest.fixture(scope="module")
def csv_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("csv")
    rng = np.random.default_rng(5)
    (out / "train").mkdir()
    for k in range(2):
        (out / "train" / f"part-{k}.csv").write_text(
            "\n".join([HEADER] + csv_rows(rng, 1500)) + "\n")
    test = csv_rows(rng, 800)
    (out / "test.csv").write_text("\n".join([HEADER] + test) + "\n")
    (out / "schema.toml").write_text(CSV_SCHEMA)
    (out / "stats.json").write_text(json.dumps(STATS))
    (out / "other.json").write_text(json.dumps({"cont_min": [0.0, 18.0],
                                                "cont_diff": [1000.0, 62.0]}))
    return out, test


def train(out, name, *extra, ok=True):
    args = ["-m", "mpips.train", "--local", "--train", str(out / "train"),
            "--test", str(out / "test.csv"), "--schema", str(out / "schema.toml"),
            "--fc", "16,8", "--embedding-dim", "4", "--batch-size", "64", "--lr", "0.01",
            "--print-every", "100000", "--save-dir", str(out / name),
            "--metrics-out", str(out / f"{name}.jsonl")] + list(extra)
    proc = run_cmd(args, timeout=300)
    if not ok:
        return proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(out / f"{name}.jsonl")


@pytest.fixture(scope="module")
def csv_run(csv_set):
    out, _ = csv_set
    return train(out, "run", "--stats", str(out / "stats.json"))


def infer(model, data, out):
    proc = run_cmd(["-m", "mpips.infer", "--checkpoint", str(model), "--data", str(data),
                    "--predictions-out", str(out) + ".txt", "--metrics-out",
                    str(out) + ".json"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (np.loadtxt(str(out) + ".txt", dtype=np.float64, ndmin=1),
            json.load(open(str(out) + ".json")))


def test_csv_minmax_stats_record_resume_infer_export(csv_set, csv_run, tmp_path):
    out, test = csv_set
    auc = csv_run[0]["test_auc"]
    assert auc > 0.75, csv_run                       # it learnt the click model
    m = ck.read_manifest(ck.resolve(str(out / "run")))
    assert m["settings"]["norm"] == STATS            # the run's 2 pairs, recorded
    pred, met = infer(out / "run", out / "test.csv", tmp_path / "inf")
    assert met["test_examples"] == 800 and met["test_auc"] == pytest.approx(auc, abs=1e-6)

    bundle = str(tmp_path / "model.h5")
    proc = run_cmd(["-m", "mpips.export", "--checkpoint", str(out / "run"), "--out", bundle])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = bd.read_manifest(bundle)["data"]
    assert (data["cont_min"], data["cont_diff"]) == (STATS["cont_min"], STATS["cont_diff"])
    p = Predictor(bundle, header=HEADER)
    got = p.predict_lines(test)
    # one forward pass on the same float32 inputs: equal to infer's printed values
    np.testing.assert_allclose(got, pred, rtol=0, atol=2e-6)
    labels = np.array([float(x.split(",")[0]) for x in test], np.float32)
    mt = BinaryMetrics()
    mt.update(got, labels)
    assert mt.auc() == pytest.approx(auc, abs=1e-6)

    bad = run_cmd(["-m", "mpips.export", "--checkpoint", str(out / "run"), "--out",
                   str(tmp_path / "x.h5"), "--stats", str(out / "other.json")])
    assert bad.returncode != 0 and "--stats" in bad.stderr.strip().splitlines()[-1]


def test_csv_resume_checks_recorded_stats(csv_set, csv_run, tmp_path):
    out, _ = csv_set
    proc = train(out, "again", "--stats", str(out / "other.json"), "--resume",
                 str(out / "run"), ok=False)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "--stats" in lines[0] and "dense value 1" in lines[0], lines
    r = train(out, "again", "--stats", str(out / "stats.json"), "--resume", str(out / "run"),
              "--epochs", "2")
    assert [x["epoch"] for x in r] == [1] and r[0]["test_auc"] > 0.75
    m = ck.read_manifest(ck.resolve(str(out / "again")))
    assert m["settings"]["norm"] == STATS


SLOT_SCHEMA = str(ROOT / "tests" / "data" / "paddle_slot.toml")
SLOT_SAMPLE = str(ROOT / "tests" / "data" / "paddle_slot_sample.txt")


def test_predict_lines_slot_multihot_equals_infer(tmp_path):
    """A slot-text run (26 bag slots, 13-value dense slot): the exported bundle scores raw
    lines, with or without their click token, as mpips.infer scores the same file."""
    text = (tmp_path / "multi.txt")            # multi-hot: a second feasign in some slots
    lines = [x for x in open(SLOT_SAMPLE).read().splitlines() if x.strip()]
    lines = [x + f" 3:{k} 7:{k * 13}" if k % 2 else x for k, x in enumerate(lines)]
    text.write_text("\n".join(lines) + "\n")
    proc = run_cmd(["-m", "mpips.train", "--local", "--train", str(text), "--test", str(text),
                    "--schema", SLOT_SCHEMA, "--fc", "8", "--embedding-dim", "4",
                    "--batch-size", "16", "--print-every", "100000",
                    "--save-dir", str(tmp_path / "run")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pred, met = infer(tmp_path / "run", text, tmp_path / "inf")
    assert met["test_examples"] == 80
    bundle = str(tmp_path / "model.h5")
    proc = run_cmd(["-m", "mpips.export", "--checkpoint", str(tmp_path / "run"), "--out", bundle])
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = Predictor(bundle)
    assert p.model.data["cont_min"] is None          # norm "none": no statistics
    got = p.predict_lines(lines)
    np.testing.assert_allclose(got, pred, rtol=0, atol=2e-6)     # infer prints 7 digits
    no_label = [x.split(" ", 1)[1] for x in lines]
    np.testing.assert_array_equal(p.predict_lines(no_label), got)
    mixed = [lines[0], "", "click:1 dense_feature", lines[1].encode()]
    with pytest.raises(LineError) as e:
        p.predict_lines(mixed)
    assert [i for i, _ in e.value.bad] == [1, 2] and "blank" in e.value.bad[0][1]
    out = p.predict_lines(mixed, errors="nan")
    assert np.isnan(out[1:3]).all() and out[0] == got[0] and out[3] == got[1]
    assert p.bad_lines == 2 and [i for i, _ in p.last_bad] == [1, 2]


def test_predict_lines_csv_needs_its_header(csv_set, csv_run, tmp_path):
    out, test = csv_set
    bundle = str(tmp_path / "model.h5")
    bd.export_full(str(out / "run"), bundle)
    with pytest.raises(ValueError, match="header="):
        Predictor(bundle).predict_lines(test[:2])
    p = Predictor(bundle, header=HEADER)
    no_label = Predictor(bundle, header=HEADER.split(",", 1)[1])   # lines without click
    np.testing.assert_array_equal(no_label.predict_lines([x.split(",", 1)[1] for x in test]),
                                  p.predict_lines(test))
    with pytest.raises(LineError, match="line 1 of 2"):
        p.predict_lines([test[0], "1,2,3"])
