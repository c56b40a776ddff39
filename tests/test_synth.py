"""Synthetic Criteo generator: shape, CTR, determinism, best AUC, cached default set."""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from data_prep import synth as synth_cli
from mpips.data import synth
from mpips.data.reader import DataReader

ROWS = 40_000


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("syn"))
    meta = synth.generate(out, rows=ROWS, parts=3, seed=1, test_rows=5000)
    return out, meta


def test_layout_and_meta(gen):
    out, meta = gen
    assert sorted(os.listdir(os.path.join(out, "train"))) == [f"part-0000{i}.txt" for i in range(3)]
    assert len(os.listdir(os.path.join(out, "test"))) == 3
    assert json.load(open(os.path.join(out, "meta.json"))) == meta
    assert meta["train"]["rows"] == ROWS and meta["test"]["rows"] == 5000
    truth = [np.load(os.path.join(out, "truth", f"train-part-0000{i}.npy")) for i in range(3)]
    assert sum(t.size for t in truth) == ROWS


def test_ctr_and_best_auc(gen):
    _, meta = gen
    assert meta["train"]["ctr"] == pytest.approx(0.25, abs=0.02)
    assert meta["test"]["ctr"] == pytest.approx(0.25, abs=0.03)
    assert 0.77 <= meta["train"]["best_auc"] <= 0.83


def test_files_parse_cleanly_and_look_like_criteo(gen):
    out, meta = gen
    lines = open(os.path.join(out, "train", "part-00000.txt"), "rb").read().split(b"\n")[:-1]
    fields = [l.split(b"\t") for l in lines[:2000]]
    assert all(len(f) == 40 for f in fields)
    ints = [f[1:14] for f in fields]
    cats = [f[14:] for f in fields]
    assert any(i[1].startswith(b"-") for i in ints)  # I2 negative sometimes
    assert 0.05 < np.mean([v == b"" for i in ints for v in i]) < 0.4  # missing ints
    assert any(c == b"" for r in cats for c in r)
    assert all(len(c) in (0, 8) and all(ch in b"0123456789abcdef" for ch in c)
               for r in cats for c in r)
    rd = DataReader(os.path.join(out, "train"), 4096, prefetch=False)
    labels = np.concatenate([b.label for b in rd])
    assert rd.stats.bad_lines == 0 and labels.size == ROWS
    truth = np.concatenate([np.load(os.path.join(out, "truth", f"train-part-0000{i}.npy"))
                            for i in range(3)])
    assert labels.mean() == pytest.approx(meta["train"]["ctr"])
    assert roc_auc_score(labels, truth) == pytest.approx(meta["train"]["best_auc"], abs=1e-9)
    card = np.array(meta["model"]["cardinalities"])
    assert card.min() == 3 and card.max() == ROWS // 10


def test_numpy_auc_matches_sklearn():
    rng = np.random.default_rng(0)
    y = rng.random(5000) < 0.3
    s = np.round(rng.random(5000) + y * 0.3, 2)  # with ties
    assert synth.auc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_deterministic_for_seed(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    synth.generate(a, rows=3000, parts=2, seed=7)
    synth.generate(b, rows=3000, parts=2, seed=7)
    synth.generate(c, rows=3000, parts=2, seed=8)
    for part in ("part-00000.txt", "part-00001.txt"):
        ra = open(os.path.join(a, "train", part), "rb").read()
        assert ra == open(os.path.join(b, "train", part), "rb").read()
        assert ra != open(os.path.join(c, "train", part), "rb").read()


def test_ensure_default_dataset_once_under_concurrency(tmp_path, monkeypatch):
    calls = []
    real = synth.generate

    def counting(*a, **kw):
        calls.append(a)
        return real(*a, **kw)
    monkeypatch.setattr(synth, "generate", counting)
    results, errors = [], []

    def run():
        try:
            results.append(synth.ensure_default_dataset(str(tmp_path), rows=2000,
                                                        test_rows=400, parts=2, seed=3))
        except Exception as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(calls) == 1 and len(set(results)) == 1
    train, test = results[0]
    assert len(os.listdir(train)) == 2 and len(os.listdir(test)) == 2
    assert synth.ensure_default_dataset(str(tmp_path), rows=2000, test_rows=400, parts=2,
                                        seed=3) == (train, test)
    assert len(calls) == 1
    assert not [n for n in os.listdir(tmp_path) if ".lock" in n or ".tmp" in n]


def test_stale_lock_is_recovered(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(proc.stdout)
    name = f"synth-v{synth.VERSION}-r500-t0-p1-s0"
    lock = tmp_path / (name + ".lock")
    lock.mkdir()
    (lock / "owner").write_text(f"{synth.socket.gethostname()} {dead_pid}\n")
    train, test = synth.ensure_default_dataset(str(tmp_path), rows=500, test_rows=0, parts=1,
                                               timeout=30)
    assert test is None
    assert os.listdir(train) == ["part-00000.txt"] and not lock.exists()


def test_cli(tmp_path):
    out = str(tmp_path / "cli")
    assert synth_cli.main(["--rows", "1000", "--out", out, "--parts", "2", "--test-rows", "100"]) == 0
    assert json.load(open(os.path.join(out, "meta.json")))["test"]["rows"] == 100
    with pytest.raises(SystemExit):
        synth_cli.main(["--rows", "0", "--out", out])
