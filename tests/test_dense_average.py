"""--dense-average B: the moving average of the dense weights, against references.

- the kernel and the table's average equal a numpy float32 loop, bit for bit, whole or
  stepped in shards, and leave the trained weights as they are without it;
- it travels with the optimizer state: packed, imported (a checkpoint without one starts
  it at the values), saved and loaded;
- exports carry it: a bundle's and a patch's dense weights are the average, and
  evaluation scores with it (the trained weights' metrics beside);
- a run resumed mid-epoch equals the uninterrupted one bit for bit (one process, and
  sync workers), average included, and so does a stream killed mid-pass and restarted.
"""
import os

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.test_modes import train

B = 0.9


def ema_reference(avg, values, b=B):
    """One step of the average in numpy float32."""
    return np.float32(b) * avg + np.float32(1.0 - np.float32(b)) * values


def test_kernel_equals_numpy():
    from mpips.kernels.optim import ema_update
    rng = np.random.default_rng(0)
    avg = rng.standard_normal(1001).astype(np.float32)
    w = rng.standard_normal(1001).astype(np.float32)
    want = ema_reference(avg, w, 0.97)
    ema_update(avg, w, np.float32(0.97))
    assert want.dtype == np.float32 and np.array_equal(avg, want)


def test_table_average_whole_and_in_shards():
    """Adam steps on a table with the average: the trained weights are those of a table
    without it, the average is the numpy loop over them, and two shards stepped apart
    (the workers' replicas) give the same bits."""
    from mpips.tables.dense import DenseTable, pack_state, unpack_state
    from mpips.tables.optim import OptimizerConfig
    rng = np.random.default_rng(1)
    v0 = rng.standard_normal(500).astype(np.float32)
    opt = OptimizerConfig(lr=0.01)
    plain, avg = DenseTable(v0, opt), DenseTable(v0, opt, B)
    w0, w1 = DenseTable(v0, opt, B), DenseTable(v0, opt, B)      # two workers' replicas
    ref = v0.copy()
    for _ in range(6):
        g = rng.standard_normal(500).astype(np.float32)
        plain.push(g, 0.5)
        avg.push(g, 0.5)
        w0.push_range(g[:200], 0.5, 0, 200)                   # each steps its shard
        w1.push_range(g[200:], 0.5, 200, 500)
        ref = ema_reference(ref, plain.values)
    assert np.array_equal(avg.values, plain.values)
    assert np.array_equal(avg.averaged, ref)
    assert np.array_equal(np.concatenate([w0.averaged[:200], w1.averaged[200:]]), ref)
    assert not np.array_equal(ref, plain.values)
    assert list(plain.export_state()) == ["values", "m", "v", "beta1_pow", "beta2_pow"]
    assert np.array_equal(avg.export_state()["average"], ref)
    part = unpack_state(avg, pack_state(avg, 100, 300), 200)
    assert np.array_equal(part["average"], ref[100:300])
    fresh = DenseTable(np.zeros(500, np.float32), opt, B)
    fresh.import_state(plain.export_state())           # saved without an average
    assert np.array_equal(fresh.averaged, plain.values)
    fresh.import_state(avg.export_state())
    assert np.array_equal(fresh.averaged, ref)
    plain.import_state(avg.export_state())             # a table without one ignores it
    assert plain.average == 0.0 and np.array_equal(plain.averaged, avg.values)
    with pytest.raises(ValueError, match="average must be in"):
        DenseTable(v0, opt, 1.0)


def test_geo_delta_steps_the_average():
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    t = DenseTable(np.ones(4, np.float32), OptimizerConfig(name="sgd"), 0.5)
    t.add(np.full(4, 2.0, np.float32))
    assert np.array_equal(t.averaged, np.full(4, 2.0, np.float32))     # 0.5 x 1 + 0.5 x 3


def test_checkpoint_before_the_average_loads():
    """tests/data/ckpt-v1-async has no /dense/average: the average starts at its values."""
    from mpips import checkpoint as ck
    from mpips.checkpoint.h5io import dense_values
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    path = ck.resolve(str(ROOT / "tests" / "data" / "ckpt-v1-async"))
    m = ck.read_manifest(path)
    opt = OptimizerConfig(**m["optimizer"])
    dense = DenseTable(np.zeros(m["n_params"], np.float32), opt, B)
    ck.load_local(path, SparseTable(m["embedding_dim"], opt, seed=0), dense)
    assert np.array_equal(dense.averaged, dense.values)
    assert np.array_equal(dense_values(path, m), dense.values)


def quiet(_):
    pass


def test_exports_and_evaluation_use_the_average(tmp_path):
    """A base and a delta of an averaged run: the bundle, the patch and the Predictor hold
    the average (not the trained weights); the checkpoint loads both back; evaluation
    scores with the average and reports the trained weights' figures beside."""
    from data_prep.synth import generate
    from mpips import checkpoint as ck
    from mpips.job.build import make_model, make_reader, make_tables
    from mpips.job.plan import trainer_settings
    from mpips.metrics import BinaryMetrics
    from mpips.config import Config
    from mpips.serving import bundle as bd
    from mpips.serving.predictor import Predictor
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.ownership import plan_keys
    from mpips.tables.sparse import SparseTable
    from mpips.worker.local import LocalPS
    from mpips.worker.trainer import Trainer
    generate(str(tmp_path / "d"), rows=2000, parts=2, seed=5, test_rows=500)
    cfg = Config(train=str(tmp_path / "d" / "train"), test=str(tmp_path / "d" / "test"),
                 fc="16,8", embedding_dim=4, batch_size=128, lr=0.01, print_every=1000,
                 prefetch=False, dense_average=B)
    model = make_model(cfg)
    ps = LocalPS(*make_tables(cfg, model))
    tr = Trainer(trainer_settings(cfg), model, ps, lambda ids: plan_keys(ids, 1),
                 replica=ps.dense)
    root = str(tmp_path / "ck")
    for mode, steps in (("base", 0), ("delta", 4)):
        tr.train_epoch(make_reader(cfg, cfg.train, 128, quiet), 0, max_steps=steps)
        ck.save_local(root, ps.sparse, ps.dense, mode, config=cfg)
    avg, raw = ps.dense.averaged.copy(), ps.dense.values.copy()
    assert not np.array_equal(avg, raw)
    d = [os.path.join(root, x) for x in sorted(os.listdir(root))]
    bd.export_full(d[0], str(tmp_path / "b.h5"))
    bd.export_patch(d[1], str(tmp_path / "b.h5"), str(tmp_path / "p.h5"))
    assert np.array_equal(bd.read_bundle(str(tmp_path / "p.h5"))[1]["dense/values"], avg)
    p = Predictor(str(tmp_path / "b.h5"))
    p.apply(str(tmp_path / "p.h5"))
    assert np.array_equal(p.model.params, avg)
    m = ck.read_manifest(d[1])
    opt = OptimizerConfig(**m["optimizer"])
    back = DenseTable(np.zeros(m["n_params"], np.float32), opt, B)
    ck.load_local(d[1], SparseTable(m["embedding_dim"], opt, seed=0), back)
    assert np.array_equal(back.averaged, avg) and np.array_equal(back.values, raw)
    bounds = [0, 1000, m["n_params"]]                  # re-sharded onto two servers
    for sid in (0, 1):
        lo, hi = bounds[sid], bounds[sid + 1]
        part = DenseTable(np.zeros(hi - lo, np.float32), opt, B)
        ck.load_shard_into(d[1], SparseTable(m["embedding_dim"], opt, seed=0), part, sid, 2,
                           bounds)
        assert np.array_equal(part.averaged, avg[lo:hi])
    got = tr.evaluate(make_reader(cfg, cfg.test, 128, quiet))
    want = {}
    for name, w in (("avg", avg), ("raw", raw)):            # the same batches, by hand
        ref = BinaryMetrics()
        for b in make_reader(cfg, cfg.test, 128, quiet):
            keys = np.unique(b.sparse)
            rows = np.empty((len(keys), model.row_dim), np.float32)
            ps.sparse.pull(keys, rows, create=False)
            emb = rows[np.searchsorted(keys, b.sparse)].reshape(len(b.label), -1)
            probs = np.empty(len(b.label), np.float32)
            model.predict(w, emb, b.dense, probs)
            ref.update(probs, b.label)
        want[name] = ref
    assert got.auc() == want["avg"].auc() and got.raw.auc() == want["raw"].auc()
    assert got.logloss() == pytest.approx(want["avg"].logloss(), rel=1e-12)
    assert got.logloss() != got.raw.logloss()


def load_all(root):
    """(sorted keys, rows, the dense export_state) of the latest checkpoint under root,
    loaded into an averaging table."""
    from mpips import checkpoint as ck
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    path = ck.resolve(str(root))
    m = ck.read_manifest(path)
    opt = OptimizerConfig(**m["optimizer"])
    sparse = SparseTable(m["embedding_dim"], opt, seed=0)
    dense = DenseTable(np.zeros(m["n_params"], np.float32), opt, B)
    ck.load_local(path, sparse, dense)
    rows = sparse.export_rows()
    order = np.argsort(rows["keys"])
    return rows["keys"][order], rows["values"][order], dense.export_state()


def assert_same(a, b):
    ka, va, da = load_all(a)
    kb, vb, db = load_all(b)
    assert np.array_equal(ka, kb) and np.array_equal(va, vb)
    assert list(da) == list(db) and "average" in da
    for k in da:
        assert np.array_equal(da[k], db[k]), f"dense {k} differs"


def saved(root, epoch, complete, steps=None):
    """The checkpoint of ``epoch`` under root saved at its end (complete) or mid-epoch
    after ``steps`` batches."""
    from mpips import checkpoint as ck
    found = [c["path"] for c in ck.list_checkpoints(str(root))
             if (m := ck.read_manifest(c["path"])["meta"])["epoch"] == epoch
             and m["complete"] == complete and (steps is None or m["steps"] == steps)]
    assert len(found) == 1
    return found[0]


def test_resume_mid_epoch_is_exact_local_and_sync(tiny_data, tmp_path):
    """An epoch of one process with 2 parts and of 2 sync workers (the replicas' shards
    stepping the average, DENSE_PUT and the servers' saves), a save every 30 steps; each
    resumed from its save at step 30 (sync: DENSE_GET with the average).  All four end
    on the same bits, average included, with the same test figures, averaged and raw."""
    common = ("--batch-size", "100", "--lr", "0.003", "--dense-average", str(B),
              "--save-every", "30")
    local = ("--local", "--local-workers", "2")
    recs = {"full": train(tiny_data, tmp_path, "full", *local, *common),
            "dist": train(tiny_data, tmp_path, "dist", "--mode", "sync", *common, n=4)}
    recs["res"] = train(tiny_data, tmp_path, "res", *local, *common, "--resume",
                        saved(tmp_path / "full", 0, False, 30))
    recs["dres"] = train(tiny_data, tmp_path, "dres", "--mode", "sync", *common, "--resume",
                         saved(tmp_path / "dist", 0, False, 30), n=4)
    ref = recs["full"][-1]
    for name in ("res", "dist", "dres"):
        assert_same(tmp_path / "full", tmp_path / name)
        rec = recs[name][-1]
        for k in ("test_auc", "test_auc_raw"):
            assert rec[k] == ref[k], (name, k)
        assert rec["test_logloss"] == pytest.approx(ref["test_logloss"], rel=1e-14)
    assert ref["test_logloss"] != ref["test_logloss_raw"]


def test_stream_killed_and_resumed_keeps_the_average(tmp_path):
    """A stream run SIGKILLed mid-pass and started again (the same command) ends on the
    bits of the uninterrupted run, the average included, pass records alike."""
    from data_prep.stream_synth import generate_stream
    from tests.conftest import run_cmd
    from tests.test_stream import EXACT, args, killed, records
    stream = tmp_path / "stream"
    generate_stream(str(stream), days=2, hours=3, rows_per_pass=400, parts=2, seed=5)
    flags = EXACT + ("--local", "--dense-average", str(B))
    (tmp_path / "ref").mkdir()
    assert run_cmd(args(stream, tmp_path / "ref", *flags)).returncode == 0
    killed(stream, tmp_path / "run", *flags)
    proc = run_cmd(args(stream, tmp_path / "run", *flags))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same(tmp_path / "ref" / "ck", tmp_path / "run" / "ck")
    keys = ("pass", "test_auc", "test_logloss", "test_auc_raw", "test_logloss_raw")
    assert ([{k: r[k] for k in keys} for r in records(tmp_path / "run")]
            == [{k: r[k] for k in keys} for r in records(tmp_path / "ref")])
