"""`python -m mpips.infer`: a checkpoint of briefly trained tables gives the in-process AUC."""
import glob
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpips import checkpoint as ck
from mpips import infer
from mpips.serving.bundle import Snapshot
from mpips.job.build import make_model, make_reader, make_tables
from mpips.job.plan import trainer_settings
from mpips.config import Config
from mpips.tables.ownership import plan_keys
from mpips.serving.model import ServingModel
from mpips.worker.local import LocalPS
from mpips.worker.trainer import Trainer

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_prep.synth import generate
    out = tmp_path_factory.mktemp("infer_data")
    generate(str(out), rows=6000, parts=2, seed=11, test_rows=3000)
    return str(out / "train"), str(out / "test")


def quiet(_):
    pass


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A root with a base (after one epoch) and a delta (5 more steps), and the in-process
    test metrics at each of the two moments, scored as infer scores: file by file, each in
    batches from its own start (a row's prediction depends on the batch it is in: BLAS
    rounds by the batch's shape on some CPUs, e.g. OpenBLAS's Haswell kernels)."""
    train_dir, test_dir = data
    cfg = Config(train=train_dir, test=test_dir, fc="16,8", embedding_dim=4, batch_size=256,
                 lr=0.01, print_every=4, prefetch=False)
    model = make_model(cfg)
    ps = LocalPS(*make_tables(cfg, model))
    trainer = Trainer(trainer_settings(cfg), model, ps, lambda ids: plan_keys(ids, 1),
                      replica=ps.dense)
    root = str(tmp_path_factory.mktemp("infer_ckpt"))
    results = []
    for mode, steps in (("base", 0), ("delta", 5)):
        trainer.train_epoch(make_reader(cfg, train_dir, 256, quiet), 0, max_steps=steps)
        n_rows = len(ps.sparse)
        files = sorted(glob.glob(os.path.join(test_dir, "*")))
        assert len(files) == 2
        m = trainer.evaluate(itertools.chain.from_iterable(
            make_reader(cfg, [f], 256, quiet) for f in files))
        assert len(ps.sparse) == n_rows                     # evaluation creates no rows
        path = ck.save_local(root, ps.sparse, ps.dense, mode, config=cfg, meta={"stage": mode})
        results.append((path, m, n_rows))
    return root, results


@pytest.mark.exact
def test_infer_matches_in_process_auc(trained, data, tmp_path, capsys):
    root, [(base, m_base, _), (delta, m_delta, _)] = trained
    for model_arg, m in ((root, m_delta), (base, m_base)):
        mf, pf = tmp_path / "m.json", tmp_path / "p.txt"
        code = infer.main(["--checkpoint", model_arg, "--data", data[1], "--metrics-out", str(mf),
                           "--predictions-out", str(pf), "--batch-size", "256"])
        out = capsys.readouterr().out
        assert code == 0
        rec = json.loads(mf.read_text())
        assert rec["test_examples"] == m.count == 3000
        assert rec["test_auc"] == m.auc() and 0.6 < rec["test_auc"] < 1
        # the same predictions, added in the same order: exact
        assert rec["test_logloss"] == m.logloss()
        assert rec["checkpoint"] == (delta if model_arg == root else base)
        assert rec["meta"] == {"stage": "delta" if model_arg == root else "base"}
        preds = np.loadtxt(pf)
        assert preds.shape == (3000,) and ((preds > 0) & (preds < 1)).all()
        assert preds.mean() == pytest.approx(m.mean_pred(), abs=1e-6)
        assert out.count("TEST --> batch: ") == 3          # 12 batches, every 4th (stored)
        assert "TEST --> batch: 4 loss: " in out and f"auc: {m.auc():.6f}" in out


def test_infer_unknown_ids_read_zeros(trained, data):
    root, [_, (_, _, n_rows)] = trained
    snap = Snapshot(root)
    model = ServingModel.from_snapshot(snap)
    assert len(model) == n_rows and snap.manifest["mode"] == "delta"
    assert not model.embed(np.array([[123456789] * 26, [-5] * 26], np.int64)).any()
    assert len(model) == n_rows


def test_infer_errors_are_one_line(tmp_path, data, trained, capsys):
    assert infer.main(["--checkpoint", str(tmp_path / "none"), "--data", data[1]]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such checkpoint" in err[0]
    partial = ck.new_checkpoint_dir(str(tmp_path / "root"), "full")
    assert infer.main(["--checkpoint", partial, "--data", data[1]]) == 1
    assert "partial checkpoint" in capsys.readouterr().err
    root, _ = trained
    proc = subprocess.run([sys.executable, "-m", "mpips.infer", "--checkpoint", root, "--data",
                           str(tmp_path / "nodata")], capture_output=True, text=True,
                          check=False, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT_DIR), cwd=ROOT_DIR)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpips.infer: error:") and "nodata" in lines[0]


def test_infer_scores_unlabeled_files(trained, data, tmp_path, capsys):
    """--no-label: the test files without their label column get the labelled run's
    predictions (the same batches); the metrics count examples only."""
    root, _ = trained
    code = infer.main(["--checkpoint", root, "--data", data[1], "--predictions-out",
                       str(tmp_path / "ref.txt")])
    assert code == 0
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in sorted(glob.glob(os.path.join(data[1], "*"))):
        lines = open(f, "rb").read().splitlines()
        (bare / os.path.basename(f)).write_bytes(b"".join(x.split(b"\t", 1)[1] + b"\n"
                                                          for x in lines))
    pf, mf = tmp_path / "p.txt", tmp_path / "m.json"
    code = infer.main(["--checkpoint", root, "--data", str(bare), "--no-label", "--predictions-out",
                       str(pf), "--metrics-out", str(mf)])
    out = capsys.readouterr().out
    assert code == 0 and "SCORE --> examples: 3000 (no labels)" in out
    assert pf.read_text() == (tmp_path / "ref.txt").read_text()
    rec = json.loads(mf.read_text())
    assert rec["test_examples"] == 3000 and rec["test_auc"] is None
    assert infer.main(["--checkpoint", root, "--data", str(bare), "--no-label"]) == 2
    assert "give --predictions-out" in capsys.readouterr().err


def test_checkpoint_flag_and_model_alias(tmp_path, data, trained, capsys):
    """--checkpoint names the checkpoint in infer and export; --model is kept as its old
    name with a one-line note, and --model with a network name says what to give."""
    from mpips import export
    root, _ = trained
    out = tmp_path / "m.json"
    assert infer.main(["--checkpoint", root, "--data", data[1], "--metrics-out", str(out)]) == 0
    assert "--model" not in capsys.readouterr().err
    ref = json.loads(out.read_text())
    assert infer.main(["--model", root, "--data", data[1], "--metrics-out", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m mpips.infer: note: --model is the old name of --checkpoint here "
                   f"(in mpips.train --model is the network); use --checkpoint {root}"]
    got = json.loads(out.read_text())
    keys = ("test_auc", "test_logloss", "checkpoint")
    assert [got[k] for k in keys] == [ref[k] for k in keys]
    assert export.main(["--model", root, "--out", str(tmp_path / "b.h5")]) == 0
    assert "mpips.export: note: --model is the old name" in capsys.readouterr().err
    for main, rest in ((infer.main, ["--data", data[1]]), (export.main, ["--out", "x"])):
        with pytest.raises(SystemExit):
            main(["--model", "deepfm", *rest])
        assert "--model deepfm names a network" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(rest)
        assert "--checkpoint DIR is required" in capsys.readouterr().err
