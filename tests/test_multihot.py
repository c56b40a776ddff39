"""Multi-hot schemas end to end on CSR bag batches (``tests/bags_driver.py`` feeds the real
trainer, servers and MPI paths from .npz files):

- sync with 2 workers == ``--local --local-workers 2``, every parameter bit for bit;
- a resume continues exactly; async and GEO learn the task; mpips.infer under mpirun;
- the schema round trip: checkpoint manifest, bundle, Predictor (scores bags as the run
  evaluated them); a resume, infer or export with another schema fails with one line;
- checkpoints and bundles written before schemas load as Criteo's.
"""
import json
import os

import numpy as np
import pytest

from mpips.serving import bundle as bd
from mpips import checkpoint as ck
from mpips.metrics import BinaryMetrics
from mpips.schema import Schema, load_schema, stored_schema
from mpips.serving import Predictor
from tests.bags_driver import NpzBags, write_parts
from tests.conftest import ROOT, run_cmd
from tests.test_modes import assert_same_params, metrics

SCHEMA = """format = "slot"
label = "click"
[[dense]]
names = ["d"]
dim = 3
norm = "none"
[[sparse]]
names = ["1", "2", "3"]
pooling = "sum"
[[sparse]]
names = ["4", "5"]
pooling = "%s"
"""
DRIVER = str(ROOT / "tests" / "bags_driver.py")
OLD_CKPT = str(ROOT / "tests" / "data" / "ckpt-v1-async")


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    """(train dir, test dir, schema path, other schema path): 5 slots (3 sum, 2 mean)."""
    out = tmp_path_factory.mktemp("bags")
    write_parts(str(out / "train"), parts=4, rows=400, n_slots=5, n_dense=3, seed=1)
    write_parts(str(out / "test"), parts=2, rows=300, n_slots=5, n_dense=3, seed=2)
    (out / "mean.toml").write_text(SCHEMA % "mean")
    (out / "sum.toml").write_text(SCHEMA % "sum")
    return str(out / "train"), str(out / "test"), str(out / "mean.toml"), str(out / "sum.toml")


def run(bags, out, name, *extra, n=None, schema=None, ok=True):
    args = [DRIVER, "--train", bags[0], "--test", bags[1], "--schema", schema or bags[2],
            "--fc", "16,8", "--embedding-dim", "4", "--batch-size", "32", "--lr", "0.003",
            "--print-every", "100000", "--save-dir", str(out / name),
            "--metrics-out", str(out / f"{name}.jsonl")] + list(extra)
    proc = run_cmd(args, n=n, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
        return metrics(out / f"{name}.jsonl")
    return proc


@pytest.fixture(scope="module")
def local_run(bags, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    return out, run(bags, out, "local", "--local", "--local-workers", "2")


def test_sync_equals_local_workers_on_bags(bags, local_run, tmp_path):
    out, local = local_run
    dist = run(bags, tmp_path, "sync", "--mode", "sync", n=4)
    assert_same_params(tmp_path / "sync", out / "local", rtol=0, atol=0)     # bit for bit
    assert dist[0]["train_loss"] == pytest.approx(local[0]["train_loss"], rel=1e-12)
    assert dist[0]["train_examples"] == local[0]["train_examples"] == 1600
    assert 0.6 < local[0]["test_auc"] and dist[0]["test_auc"] == pytest.approx(
        local[0]["test_auc"], abs=1e-6)


def test_schema_round_trip_checkpoint_bundle_predictor(bags, local_run, tmp_path):
    out, local = local_run
    want = load_schema(bags[2])
    m = ck.read_manifest(ck.resolve(str(out / "local")))
    assert stored_schema(m) == want and m["schema"] == json.loads(want.to_json())
    bundle = str(tmp_path / "model.h5")
    bd.export_full(str(out / "local"), bundle)
    assert bd.read_manifest(bundle)["schema"] == json.loads(want.to_json())
    p = Predictor(bundle)
    assert p.model.schema == want and p.model.n_dense == 3 and p.model.n_sparse == 5
    mt = BinaryMetrics()                     # the bundle scores the bags as the run evaluated
    for b in NpzBags(None, sorted(os.path.join(bags[1], f) for f in os.listdir(bags[1])), 32):
        mt.update(p.predict_arrays(b.dense, b.sparse, b.offsets), b.label)
    assert mt.count == 600 and mt.auc() == pytest.approx(local[0]["test_auc"], abs=1e-6)
    got = p.predict_lines(["click:1 d:0.1 d:0.2 d:0.3 1:5", "d:0.1 d:0.2 d:0.3 1:5"])
    assert got.shape == (2,) and np.isfinite(got).all() and got[0] == got[1]   # label or not


def test_async_geo_and_infer_under_mpirun_on_bags(bags, local_run, tmp_path):
    """2x2 async and local GEO learn the bags' task as --local does; mpips.infer under mpirun
    (shared-memory table, warm-up on bags) scores the test bags as the run evaluated them."""
    out, local = local_run
    auc = local[0]["test_auc"]
    a = run(bags, tmp_path, "async", "--mode", "async", n=4)
    g = run(bags, tmp_path, "geo", "--local", "--mode", "geo", "--geo-steps", "4")
    for r in (a[0], g[0]):       # 1600 examples: AUCs of the same task vary by a few 0.01
        assert r["test_auc"] > 0.65 and abs(r["test_auc"] - auc) < 0.06, (r, auc)
    rec = tmp_path / "infer.json"
    proc = run_cmd([DRIVER, "infer", "--checkpoint", str(out / "local"), "--data", bags[1],
                    "--metrics-out", str(rec), "--batch-size", "32", "--schema", bags[2]],
                   n=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(rec.read_text())
    assert r["ranks"] == 2 and r["test_examples"] == 600
    assert r["test_auc"] == pytest.approx(auc, abs=1e-6)


def test_resume_on_bags_equals_uninterrupted(bags, tmp_path):
    """2 epochs == 1 epoch, resume (same schema: accepted), 1 epoch; every parameter equal."""
    run(bags, tmp_path, "two", "--local", "--epochs", "2")
    run(bags, tmp_path, "one", "--local", "--epochs", "1")
    r = run(bags, tmp_path, "one", "--local", "--epochs", "2", "--resume", str(tmp_path / "one"))
    assert [x["epoch"] for x in r] == [0, 1]        # epoch 1 ran in the resumed job
    assert_same_params(tmp_path / "two", tmp_path / "one", rtol=0, atol=0)


def one_line_error(text, *words):
    lines = [x for x in text.strip().splitlines() if x.strip()]
    assert len(lines) == 1, text
    for w in words:
        assert w in lines[0], lines[0]


def test_other_schema_fails_resume_infer_export(bags, local_run, tmp_path, capsys):
    out, _ = local_run
    proc = run(bags, tmp_path, "again", "--local", "--resume", str(out / "local"),
               schema=bags[3], ok=False)
    assert proc.returncode == 2
    one_line_error(proc.stderr, "another feature schema", "schema sparse", '"mean"', '"sum"')
    from mpips import export
    from mpips import infer
    assert export.main(["--checkpoint", str(out / "local"), "--out", str(tmp_path / "x.h5"),
                        "--schema", bags[3]]) == 1
    one_line_error(capsys.readouterr().err, "another feature schema", "schema sparse")
    assert not os.path.exists(tmp_path / "x.h5")
    assert infer.main(["--checkpoint", str(out / "local"), "--data", bags[1],
                       "--schema", bags[3]]) == 1
    one_line_error(capsys.readouterr().err, "another feature schema", "schema sparse")


def test_old_checkpoint_loads_as_criteo(tmp_path):
    m = ck.read_manifest(ck.resolve(OLD_CKPT))
    assert "schema" not in m and stored_schema(m) == Schema.criteo()
    bundle = str(tmp_path / "old.h5")
    bd.export_full(OLD_CKPT, bundle)
    assert bd.read_manifest(bundle)["schema"] == json.loads(Schema.criteo().to_json())
    p = Predictor(bundle)
    assert p.model.schema.is_criteo and (p.model.n_dense, p.model.n_sparse) == (13, 26)
    manifest, arrays = bd.read_bundle(bundle)      # a bundle written before schemas: no key
    manifest.pop("schema")
    from mpips.serving.model import ServingModel
    assert ServingModel.from_arrays(manifest, arrays).schema.is_criteo


def test_bad_offsets_are_one_clear_error(local_run, tmp_path):
    out, _ = local_run
    bundle = str(tmp_path / "m.h5")
    bd.export_full(str(out / "local"), bundle)
    p = Predictor(bundle)
    dense = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"offsets \(B\*5\+1,\)"):
        p.predict_arrays(dense, np.arange(4), np.array([0, 1, 2, 3, 4], np.int64))
    probs = p.predict_arrays(dense, np.arange(4), np.array([0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]))
    assert probs.shape == (2,) and np.isfinite(probs).all()
    assert json.dumps(p.model.schema.to_dict())


def test_bag_sightings_are_occurrences_and_bad_offsets_fail(bags):
    """Admission counts of a CSR batch: one per occurrence of an id (a repeat inside a bag
    counts twice), as for one-hot batches; offsets that do not fit give one clear error."""
    from mpips.job.build import make_model, make_tables
    from mpips.job.plan import trainer_settings
    from mpips.config import Config
    from mpips.data.reader import Batch
    from mpips.tables.ownership import plan_keys
    from mpips.worker.local import LocalPS
    from mpips.worker.trainer import Trainer
    cfg = Config(local=True, fc="4", embedding_dim=2, entry="count:2")
    schema = load_schema(bags[2])
    model = make_model(cfg, schema)
    ps = LocalPS(*make_tables(cfg, model))
    tr = Trainer(trainer_settings(cfg), model, ps, lambda ids: plan_keys(ids, 2),
                 replica=ps.dense)
    ids = np.array([7, 7, 3, 9, 7, 3, 5], np.int64)         # 2 examples x 5 slots
    offsets = np.array([0, 2, 3, 3, 4, 4, 5, 5, 6, 7, 7], np.int64)
    b = Batch(np.zeros((2, 3), np.float32), ids, np.zeros(2, np.float32), offsets)
    prep = tr._prepare(b)
    keys, counts = np.unique(ids, return_counts=True)
    got = dict(zip(prep.plan.keys.tolist(), prep.counts[:, 0].tolist()))
    assert got == dict(zip(keys.tolist(), counts.astype(float).tolist()))
    with pytest.raises(ValueError, match=r"needs offsets \(11,\)"):
        tr._prepare(Batch(b.dense, ids, b.label, offsets[:-1]))
    with pytest.raises(ValueError, match="non-decreasing"):
        tr._prepare(Batch(b.dense, ids, b.label, offsets[::-1].copy()))


def test_deepfm_on_bags_sync_equals_local_and_bundle_scores_as_evaluated(bags, tmp_path):
    """DeepFM on multi-hot bags (3 sum, 2 mean slots; rows [w | v]): 2x2 sync == --local
    --local-workers 2 bit for bit, and its bundle scores the test bags as the run evaluated."""
    local = run(bags, tmp_path, "local", "--local", "--local-workers", "2", "--model", "deepfm")
    dist = run(bags, tmp_path, "sync", "--mode", "sync", "--model", "deepfm", n=4)
    assert_same_params(tmp_path / "sync", tmp_path / "local", rtol=0, atol=0)
    assert dist[0]["train_loss"] == pytest.approx(local[0]["train_loss"], rel=1e-12)
    assert local[0]["test_auc"] > 0.6
    bundle = str(tmp_path / "model.h5")
    bd.export_full(str(tmp_path / "local"), bundle)
    p = Predictor(bundle)
    assert p.model.name == "deepfm" and p.model.values.shape[1] == 5
    mt = BinaryMetrics()
    for b in NpzBags(None, sorted(os.path.join(bags[1], f) for f in os.listdir(bags[1])), 32):
        mt.update(p.predict_arrays(b.dense, b.sparse, b.offsets), b.label)
    assert mt.count == 600 and mt.auc() == pytest.approx(local[0]["test_auc"], abs=1e-6)
