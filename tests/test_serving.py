"""Serving: bundles and patches, the Predictor, export folders, and infer under mpirun.

References: the checkpoint loader's own table (``load_local``), a single-process infer
run, and the predictions of the model a predictor held before a change.
"""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from mpips.serving import bundle as bd
from mpips import checkpoint as ck
from mpips import export
from mpips.serving import exports
from mpips import infer
from mpips.job.build import make_model, make_reader, make_tables
from mpips.job.plan import trainer_settings
from mpips.config import Config
from mpips.tables.ownership import plan_keys
from mpips.serving.model import ServingModel
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from mpips.serving import LineError, Predictor
from mpips.worker.local import LocalPS
from mpips.worker.trainer import Trainer
from tests.conftest import run_cmd


def quiet(_):
    pass


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_prep.synth import generate
    out = tmp_path_factory.mktemp("serve_data")
    generate(str(out), rows=4000, parts=3, seed=11, test_rows=1500)
    return str(out / "train"), str(out / "test")


@pytest.fixture(scope="module")
def root(data, tmp_path_factory):
    """A checkpoint root: base (one epoch), delta (5 more steps), delta (3 steps, evictions)."""
    cfg = Config(train=data[0], test=data[1], fc="16,8", embedding_dim=4, batch_size=128,
                 lr=0.01, print_every=1000, prefetch=False)
    model = make_model(cfg)
    ps = LocalPS(*make_tables(cfg, model))
    trainer = Trainer(trainer_settings(cfg), model, ps, lambda ids: plan_keys(ids, 1),
                      replica=ps.dense)
    out = str(tmp_path_factory.mktemp("serve_ckpt"))
    for mode, steps in (("base", 0), ("delta", 5), ("delta", 3)):
        trainer.train_epoch(make_reader(cfg, data[0], 128, quiet), 0, max_steps=steps)
        if mode == "delta":                          # the 2nd shrink evicts rows unseen since the 1st
            evicted = ps.sparse.shrink(0)
            assert (evicted > 0) == (steps == 3)
        ck.save_local(out, ps.sparse, ps.dense, mode, config=cfg, meta={"stage": mode})
    return out


def ckpt_dirs(root):
    return [os.path.join(root, d) for d in sorted(os.listdir(root))]


def sorted_table(model):
    order = np.argsort(model.keys)
    return model.keys[order], model.values[order]


def test_bundle_equals_the_checkpoint_loader(root, tmp_path):
    m = bd.export_full(root, str(tmp_path / "b.h5"))
    assert m["checkpoint"]["name"] == os.path.basename(ckpt_dirs(root)[-1])
    man = ck.read_manifest(ckpt_dirs(root)[-1])
    opt = OptimizerConfig(**man["optimizer"])
    sparse = SparseTable(man["embedding_dim"], opt, 0, capacity=16)
    dense = DenseTable(np.zeros(man["n_params"], np.float32), opt)
    ck.load_local(root, sparse, dense)
    ref = sparse.export_rows()
    order = np.argsort(ref["keys"])
    p = Predictor(str(tmp_path / "b.h5"))
    keys, values = sorted_table(p.model)
    assert np.array_equal(keys, ref["keys"][order])
    assert np.array_equal(values, ref["values"][order])
    out = np.empty(man["n_params"], np.float32)
    dense.pull(out)
    assert np.array_equal(p.model.params, out)
    with h5py.File(str(tmp_path / "b.h5"), "r") as f:     # no optimizer state
        assert sorted(f["sparse"]) == ["evicted", "keys", "values"] and list(f["dense"]) == ["values"]


def test_chain_of_patches_equals_export_of_latest(root, tmp_path):
    d = ckpt_dirs(root)
    for dtype in ("float32", "float16"):
        b0, p1, p2, full = (str(tmp_path / f"{n}-{dtype}.h5") for n in ("b0", "p1", "p2", "full"))
        bd.export_full(d[0], b0, dtype)
        assert export.main(["--checkpoint", d[1], "--since", b0, "--out", p1, "--dtype", dtype]) == 0
        m2 = bd.export_patch(d[2], p1, p2, dtype)
        assert m2["evicted"] > 0 and m2["since"]["name"] == os.path.basename(d[1])
        assert export.main(["--checkpoint", root, "--out", full, "--dtype", dtype]) == 0
        p = Predictor(b0)
        p.apply(p1)
        p.apply(p2)
        q = Predictor(full)
        for a, b in zip(sorted_table(p.model), sorted_table(q.model)):
            assert np.array_equal(a, b)
        assert np.array_equal(p.model.params, q.model.params)
        assert p.version["name"] == q.version["name"] == os.path.basename(d[2])
        with pytest.raises(bd.BundleError, match="applies to"):
            p.apply(p2)                                  # already applied: wrong base


def test_float16_bundle_is_close(root, tmp_path):
    bd.export_full(root, str(tmp_path / "32.h5"))
    bd.export_full(root, str(tmp_path / "16.h5"), "float16")
    a, b = Predictor(str(tmp_path / "32.h5")).model, Predictor(str(tmp_path / "16.h5")).model
    assert np.abs(a.values - b.values).max() <= np.abs(a.values).max() * 2 ** -10
    assert 0 < np.abs(a.values - b.values).max()


def read_lines(test_dir):
    lines = []
    for f in sorted(os.listdir(test_dir)):
        lines += open(os.path.join(test_dir, f), "rb").read().splitlines()
    return lines


def test_predictor_equals_infer(root, data, tmp_path, capsys):
    pf, mf = tmp_path / "p.txt", tmp_path / "m.json"
    assert infer.main(["--checkpoint", root, "--data", data[1], "--predictions-out", str(pf),
                       "--metrics-out", str(mf)]) == 0
    ref = np.loadtxt(pf)
    bd.export_full(root, str(tmp_path / "b.h5"))
    p = Predictor(str(tmp_path / "b.h5"))
    lines = read_lines(data[1])
    got = p.predict_lines(lines)
    assert got.shape == ref.shape == (1500,)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    # str lines, no label column, a blank and a malformed line: an error naming the first
    # bad line and why, or (errors="nan") NaN where there is no row, the bad ones listed
    mixed = [lines[0].decode(), lines[1].split(b"\t", 1)[1], b"", b"1\tnot a line", lines[2]]
    with pytest.raises(LineError, match=r"^line 2 of 5 cannot be scored: blank line \(and 1 "
                       r"more: lines 3\); fix .* errors='nan'") as e:
        p.predict_lines(mixed)
    assert e.value.bad == [(2, "blank line"), (3, "expected 40 tab-separated fields, found 2 "
                                                  "(39 without the label column)")]
    assert p.bad_lines == 0
    out = p.predict_lines(mixed, errors="nan")
    assert np.isnan(out[2]) and np.isnan(out[3]) and p.bad_lines == 2
    assert p.last_bad == e.value.bad
    np.testing.assert_allclose(out[[0, 1, 4]], ref[[0, 1, 2]], atol=1e-6)
    bad_int = lines[3].split(b"\t")
    bad_int[2] = b"x7"                                          # I2 not an integer
    with pytest.raises(LineError, match=r"^line 1 of 2 cannot be scored: integer field I2 "):
        p.predict_lines([lines[0], b"\t".join(bad_int)])
    many = [b"junk"] * 70 + [lines[0]]                          # more than one parse records
    out = p.predict_lines(many, errors="nan")
    assert [i for i, _ in p.last_bad] == list(range(70)) and not np.isnan(out[70])
    cfg = infer.config_from_manifest(ck.read_manifest(ckpt_dirs(root)[-1]))
    batch = next(iter(make_reader(cfg, [os.path.join(data[1], sorted(os.listdir(data[1]))[0])],
                                  64, quiet)))
    np.testing.assert_allclose(p.predict_arrays(batch.dense, batch.sparse), ref[:64], atol=1e-6)


def test_unknown_ids_read_zeros(root, tmp_path):
    bd.export_full(root, str(tmp_path / "b.h5"))
    m = Predictor(str(tmp_path / "b.h5")).model
    unknown = np.array([[123456789] * 26, [-5] * 26], np.int64)
    assert not m.embed(unknown).any()
    dense = np.random.default_rng(0).random((2, 13)).astype(np.float32)
    ref = np.empty(2, np.float32)
    make_model(Config(fc="16,8", embedding_dim=4)).predict(
        m.params, np.zeros((2, 104), np.float32), dense, ref)
    np.testing.assert_array_equal(m.predict(dense, unknown), ref)


def test_apply_swaps_one_reference(root, tmp_path):
    d = ckpt_dirs(root)
    bd.export_full(d[1], str(tmp_path / "b.h5"))
    bd.export_patch(d[2], str(tmp_path / "b.h5"), str(tmp_path / "p.h5"))
    p = Predictor(str(tmp_path / "b.h5"))
    old = p.model                                   # what a reader in flight holds
    keys0, values0 = old.keys.copy(), old.values.copy()
    ids = np.tile(old.keys[:26], (3, 1))
    dense = np.zeros((3, 13), np.float32)
    before = old.predict(dense, ids)
    p.apply(str(tmp_path / "p.h5"))
    assert p.model is not old
    assert np.array_equal(old.keys, keys0) and np.array_equal(old.values, values0)
    np.testing.assert_array_equal(old.predict(dense, ids), before)
    assert not np.array_equal(p.model.predict(dense, ids), before)


def corrupt(path, where):
    """Truncate the file to half, or flip a byte of a dataset ("sparse/values") or the manifest."""
    if where == "manifest":
        offset = open(path, "rb").read().index(b'"format": "mpips-bundle"') + 12
    elif where != "truncate":
        with h5py.File(path, "r") as f:
            offset = f[where].id.get_offset() + 5
    data = bytearray(open(path, "rb").read())
    if where == "truncate":
        data = data[:len(data) // 2]
    else:
        data[offset] ^= 0x01
    open(path, "wb").write(bytes(data))


def test_bad_bundle_or_patch_gives_one_clear_error(root, tmp_path, capsys):
    d = ckpt_dirs(root)
    good, patch = str(tmp_path / "b.h5"), str(tmp_path / "p.h5")
    bd.export_full(d[1], good)
    bd.export_patch(d[2], good, patch)
    p = Predictor(good)
    model = p.model
    for where, msg in (("truncate", "truncated or corrupted"),
                       ("sparse/values", "checksum mismatch in dataset sparse/values"),
                       ("dense/values", "checksum mismatch in dataset dense/values"),
                       ("manifest", "no valid bundle manifest.*checksum mismatch")):
        for src in (good, patch):
            bad = str(tmp_path / f"bad-{where.replace('/', '-')}-{os.path.basename(src)}")
            shutil.copy(src, bad)
            corrupt(bad, where)
            with pytest.raises(bd.BundleError, match=msg):
                Predictor(bad) if src == good else p.apply(bad)
            assert p.model is model                      # the old model stays
        if where in ("sparse/values", "dense/values"):
            continue                                     # --since reads the manifest only
        assert export.main(["--checkpoint", root, "--since", bad, "--out", str(tmp_path / "x.h5")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mpips.export: error: BundleError: ")
    p.apply(patch)                                       # the good patch still applies
    assert p.version["name"] == os.path.basename(d[2])


def stream_cfg(stream, out):
    return Config(stream=str(stream), fc="16,8", embedding_dim=4, batch_size=128, lr=0.003,
                  print_every=100000, save_dir=str(out / "ck"), export_dir=str(out / "ex"),
                  prefetch=False)


def test_stream_export_folder_is_followed(tmp_path):
    from data_prep.stream_synth import generate_stream, pass_names
    from mpips.job.plan import make_plan
    from mpips.train import run_local
    stream = tmp_path / "stream"
    names = pass_names("20261129", 2, 2)
    generate_stream(str(stream), days=2, hours=2, rows_per_pass=600, parts=1, seed=5,
                    only=names[:2])
    cfg = stream_cfg(stream, tmp_path)
    run_local(make_plan(cfg))                        # day 1: base + delta
    kinds = [e["kind"] for e in exports.read_index(cfg.export_dir)]
    assert kinds == ["full", "patch"]
    p = Predictor.follow(cfg.export_dir)
    assert p.version["name"] == os.path.basename(ck.latest(cfg.save_dir))
    assert not p.refresh()
    generate_stream(str(stream), days=2, hours=2, rows_per_pass=600, parts=1, seed=5,
                    only=names[2:3])
    run_local(make_plan(cfg))                        # day 2, hour 0: a new base
    generate_stream(str(stream), days=2, hours=2, rows_per_pass=600, parts=1, seed=5,
                    only=names[3:])
    run_local(make_plan(cfg))                        # day 2, hour 1: a patch on it
    idx = exports.read_index(cfg.export_dir)
    assert [e["kind"] for e in idx] == ["full", "patch", "full", "patch"]
    # the newest patch is corrupted: refresh fails with one error and keeps the old model
    patch = os.path.join(cfg.export_dir, idx[-1]["file"])
    saved = open(patch, "rb").read()
    corrupt(patch, "sparse/values")
    old = p.model
    with pytest.raises(bd.BundleError, match="checksum mismatch"):
        p.refresh()
    assert p.model is old
    open(patch, "wb").write(saved)
    assert p.refresh()
    latest = ck.latest(cfg.save_dir)
    bd.export_full(latest, str(tmp_path / "ref.h5"))
    q = Predictor(str(tmp_path / "ref.h5"))
    assert p.version["name"] == os.path.basename(latest)
    for a, b in zip(sorted_table(p.model), sorted_table(q.model)):
        assert np.array_equal(a, b)
    assert np.array_equal(p.model.params, q.model.params)


@pytest.mark.exact
@pytest.mark.parametrize("n,extra", [(2, ["--table-per-rank"]), (3, [])])
def test_infer_under_mpirun_equals_one_process(root, data, tmp_path, n, extra):
    """N ranks (one table per node in shared memory, or one per rank) == one process."""
    ref_p, ref_m = tmp_path / "p1.txt", tmp_path / "m1.json"
    assert infer.main(["--checkpoint", root, "--data", data[1], "--predictions-out", str(ref_p),
                       "--metrics-out", str(ref_m), "--batch-size", "100"]) == 0
    pf, mf = tmp_path / f"p{n}.txt", tmp_path / f"m{n}.json"
    proc = run_cmd(["-m", "mpips.infer", "--checkpoint", root, "--data", data[1], "--batch-size",
                    "100", "--predictions-out", str(pf), "--metrics-out", str(mf)] + extra, n=n,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert pf.read_bytes() == ref_p.read_bytes()           # same numbers, same order
    one, many = json.loads(ref_m.read_text()), json.loads(mf.read_text())
    assert many["ranks"] == n and many["test_examples"] == one["test_examples"] == 1500
    # the same predictions (above), so the same integer bucket counts: the AUC is exact; the
    # logloss adds the same 1500 float64 terms grouped by rank: < 2 n 2**-53 = 3.3e-13 relative
    assert many["test_auc"] == one["test_auc"]
    assert many["test_logloss"] == pytest.approx(one["test_logloss"], rel=1e-12)
    assert not list(tmp_path.glob("*.part-*"))


def test_serving_model_rejects_mismatched_weights():
    with pytest.raises(bd.BundleError, match="dense weights"):
        ServingModel(np.empty(0, np.int64), np.empty((0, 4), np.float32), np.zeros(3),
                     {"embedding_dim": 4, "fc": "16,8", "n_params": 3},
                     {"hash_bucket": 0, "cont_min": [0] * 13, "cont_diff": [1] * 13})


def test_slot_lines_with_and_without_click_parse_as_the_reader_does():
    from mpips.data.slot import parse_slot_bytes
    from mpips.serving import parse_lines
    rng = np.random.default_rng(3)
    lines = []
    for _ in range(5):
        dense = " ".join(f"dense_feature:{x:.4f}" for x in rng.random(13))
        ids = " ".join(f"{k}:{v}" for k, v in zip(range(1, 27), rng.integers(0, 10**6, 26)))
        lines.append(f"click:{rng.integers(0, 2)} {dense} {ids}".encode())
    data = {"data_format": "auto", "hash_bucket": 0, "cont_min": [0] * 13, "cont_diff": [1] * 13}
    ref = parse_slot_bytes(b"\n".join(lines))
    bare = [x.split(b" ", 1)[1] for x in lines]             # no click: token
    for batch in (lines, bare, [lines[0].decode()] + bare[1:]):
        dense, ids, ok = parse_lines(batch, data)
        assert ok.all()
        np.testing.assert_array_equal(dense, ref.dense)
        np.testing.assert_array_equal(ids, ref.sparse)


def test_infer_under_mpirun_fails_with_one_line(root, tmp_path):
    proc = run_cmd(["-m", "mpips.infer", "--checkpoint", root, "--data", str(tmp_path / "nodata")],
                   n=2, timeout=120)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("mpips.infer")]
    assert len(lines) == 1 and lines[0].startswith("mpips.infer: rank 0: error: ")
    assert "nodata" in lines[0]
