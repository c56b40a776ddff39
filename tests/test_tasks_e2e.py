"""Several labels end to end (tiny two-label data from data_prep.two_labels):

- mmoe 2x2 sync equals --local --local-workers 2 bit for bit; every task is in the records;
- esmm 2x2 async, shared_bottom GEO and SSP train, every task above chance;
- a checkpoint resumes exactly (1 epoch + resume + 1 == 2 epochs) and scores the same
  through mpips.infer (one column per task, per-task AUCs), mpips.export and the Predictor
  ((n, T)) as training evaluated it;
- a single-task network given two labels is one line naming the multi-task networks.
"""
import json
import os

import numpy as np
import pytest

from mpips import export, infer
from mpips.serving import Predictor
from tests.conftest import run_cmd
from tests.test_dense_replica import assert_identical

SMALL = ("--batch-size", "100", "--lr", "0.003", "--embedding-dim", "4", "--fc", "16,8",
         "--print-every", "100000")


@pytest.fixture(scope="module")
def two_labels(tmp_path_factory):
    """(train_dir, test_dir, schema) of 3000/1000 two-label rows, two files each."""
    from data_prep import two_labels as tl
    out = tmp_path_factory.mktemp("two")
    model = tl.make(0, seed=5, slots=4, max_card=200)
    for split, n, k in (("train", 1500, 1), ("test", 500, 2)):
        os.makedirs(out / split)
        for part in range(2):
            lab, dense, ids, _, _ = tl.sample(model, n, np.random.default_rng([5, k, part]))
            tl.write_csv(str(out / split / f"part-{part}.csv"), lab, dense, ids)
    (out / "schema.toml").write_text(tl.schema_text(4))
    return str(out / "train"), str(out / "test"), str(out / "schema.toml")


def train(data, out, name, *extra, n=4):
    args = ["-m", "mpips.train", "--train", data[0], "--test", data[1], "--schema", data[2],
            "--save-dir", str(out / name), "--metrics-out", str(out / f"{name}.jsonl"),
            *SMALL, *extra]
    proc = run_cmd(args, n=None if "--local" in extra else n, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in open(out / f"{name}.jsonl")], proc.stdout


def test_mmoe_sync_equals_local_workers_bit_for_bit(two_labels, tmp_path):
    common = ("--model", "mmoe", "--max-steps", "12")
    dist, _ = train(two_labels, tmp_path, "sync", "--mode", "sync", *common, n=4)
    local, out = train(two_labels, tmp_path, "local", "--local", "--local-workers", "2",
                       *common)
    assert_identical(tmp_path / "sync", tmp_path / "local")
    assert dist[0]["train_loss"] == pytest.approx(local[0]["train_loss"], rel=1e-12)
    for name, t in local[0]["tasks"].items():     # test: the same sums; train: summed
        d = dist[0]["tasks"][name]                   # per worker then across, or in turn
        assert {k: v for k, v in d.items() if k.startswith("test_")} == \
            {k: v for k, v in t.items() if k.startswith("test_")}
        assert d["train_loss"] == pytest.approx(t["train_loss"], rel=1e-12)
    for rec in (dist[0], local[0]):
        assert list(rec["tasks"]) == ["click", "purchase"]
        for t in rec["tasks"].values():
            assert set(t) >= {"test_auc", "test_logloss", "test_mean_pred", "test_ctr",
                              "train_loss"}
        assert rec["test_auc"] == rec["tasks"]["click"]["test_auc"]
    assert "TASKS click: auc" in out and "purchase: auc" in out


@pytest.mark.parametrize("model, mode", [("esmm", "async"), ("shared_bottom", "geo"),
                                         ("mmoe", "ssp")])
def test_modes_train_every_task(two_labels, tmp_path, model, mode):
    recs, _ = train(two_labels, tmp_path, mode, "--model", model, "--mode", mode,
                    "--epochs", "2", "--lr", "0.01", n=4)
    tasks = recs[-1]["tasks"]
    assert tasks["click"]["test_auc"] > 0.62 and tasks["purchase"]["test_auc"] > 0.62, tasks
    if model == "esmm":
        assert tasks["purchase"]["test_cvr_auc_clicked"] > 0.55
        # pCTCVR <= pCTR: the mean purchase prediction is below the click one
        assert tasks["purchase"]["test_mean_pred"] < tasks["click"]["test_mean_pred"]


def test_resume_infer_export_predictor(two_labels, tmp_path):
    common = ("--model", "esmm", "--local", "--max-steps", "15")
    two, _ = train(two_labels, tmp_path, "two", *common, "--epochs", "2")
    train(two_labels, tmp_path, "one", *common, "--epochs", "1")
    res, _ = train(two_labels, tmp_path, "res", *common, "--epochs", "2", "--resume",
                   str(tmp_path / "one"))
    assert_identical(tmp_path / "two", tmp_path / "res")
    assert res[-1]["tasks"] == two[-1]["tasks"]
    root, pf, mf = str(tmp_path / "two"), tmp_path / "p.txt", tmp_path / "m.json"
    assert infer.main(["--checkpoint", root, "--data", two_labels[1], "--predictions-out",
                       str(pf), "--metrics-out", str(mf)]) == 0
    scores = np.loadtxt(pf)
    assert scores.shape == (1000, 2) and (scores[:, 1] <= scores[:, 0] + 1e-6).all()
    got = json.load(open(mf))
    for name in ("click", "purchase"):
        assert got["tasks"][name]["test_auc"] == pytest.approx(
            two[-1]["tasks"][name]["test_auc"], abs=1e-4)
    assert export.main(["--checkpoint", root, "--out", str(tmp_path / "b.h5")]) == 0
    header = open(os.path.join(two_labels[1], "part-0.csv")).readline()
    p = Predictor(str(tmp_path / "b.h5"), header=header)
    assert p.task_names == ("click", "purchase")
    lines = [ln for f in sorted(os.listdir(two_labels[1]))
             for ln in open(os.path.join(two_labels[1], f), "rb").readlines()[1:]]
    out = p.predict_lines(lines)
    assert out.shape == (1000, 2)
    np.testing.assert_allclose(out, scores, rtol=0, atol=1e-6)
    check_serve(str(tmp_path / "b.h5"), header, lines[:50], p)


def check_serve(bundle, header, lines, p):
    """V2: one output tensor per task named by its label; TF: a {task: p} per instance;
    raw lines: T tab-separated scores a line; each equal to the Predictor's (n, T)."""
    pytest.importorskip("prometheus_client")
    from tests.test_serve import Server
    ref = p.predict_lines(lines)
    cols = header.strip().split(",")
    rows = [dict(zip(cols, ln.decode().strip().split(","))) for ln in lines]
    insts = [{k: (float(v) if k[0] == "I" else v) for k, v in r.items()} for r in rows]
    srv = Server("--bundle", bundle, "--header", header.strip(), "--name", "ads")
    try:
        s, _, body = srv.call("POST", "/v1/models/ads:predict", {"instances": insts})
        assert s == 200, body
        preds = json.loads(body)["predictions"]
        assert [list(x) for x in preds[:1]] == [["click", "purchase"]]
        got = np.array([[x["click"], x["purchase"]] for x in preds], np.float32)
        assert np.array_equal(got, ref)
        tensors = [{"name": n, "shape": [len(insts)], "datatype": "FP64" if n[0] == "I"
                    else "BYTES", "data": [x[n] for x in insts]} for n in cols[2:]]
        s, _, body = srv.call("POST", "/v2/models/ads/infer", {"inputs": tensors})
        assert s == 200, body
        outs = json.loads(body)["outputs"]
        assert [o["name"] for o in outs] == ["click", "purchase"]
        assert np.array_equal(np.array([o["data"] for o in outs], np.float32).T, ref)
        s, _, body = srv.call("POST", "/v2/models/ads/infer", {"inputs": tensors, "outputs": [
            {"name": "purchase"}]})
        assert [o["name"] for o in json.loads(body)["outputs"]] == ["purchase"]
        s, _, body = srv.call("POST", "/v2/models/ads/infer", {"inputs": tensors, "outputs": [
            {"name": "probability"}]})
        assert s == 400 and "click" in json.loads(body)["error"]
        meta = json.loads(srv.call("GET", "/v2/models/ads")[2])
        assert [o["name"] for o in meta["outputs"]] == ["click", "purchase"]
        s, _, body = srv.call("POST", "/v1/models/ads:lines", b"".join(lines), "text/csv")
        got = np.array([row.split("\t") for row in body.decode().splitlines()], np.float32)
        assert s == 200 and np.array_equal(got, ref)
    finally:
        assert srv.stop() == 0


def test_single_task_network_with_two_labels_is_one_line(two_labels, tmp_path):
    proc = run_cmd(["-m", "mpips.train", "--local", "--model", "dnn", "--train",
                    two_labels[0], "--schema", two_labels[2], *SMALL])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(err) == 1, proc.stderr
    assert "mmoe" in err[0] and "esmm" in err[0] and "shared_bottom" in err[0]


def test_stream_passes_report_every_task(two_labels, tmp_path):
    """Two passes of two-label CSV: each PASS record has both tasks' progressive test
    figures (evaluated before the pass trains) and their training loss."""
    src = os.path.join(two_labels[0], "part-0.csv")
    lines = open(src).readlines()
    for k, hour in enumerate(("00", "01")):
        d = tmp_path / "s" / "20260101" / hour
        d.mkdir(parents=True)
        (d / "part-0.csv").write_text(lines[0] + "".join(lines[1 + 700 * k:1 + 700 * (k + 1)]))
        (d / "_SUCCESS").write_text("")
    proc = run_cmd(["-m", "mpips.train", "--local", "--stream", str(tmp_path / "s"),
                    "--save-dir", str(tmp_path / "ck"), "--schema", two_labels[2],
                    "--model", "shared_bottom", "--stream-timeout", "1", "--metrics-out",
                    str(tmp_path / "p.jsonl"), *SMALL])
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(x) for x in open(tmp_path / "p.jsonl")]
    assert [r["pass"] for r in recs] == ["20260101/00", "20260101/01"]
    for r in recs:
        assert r["test_examples"] == 700
        for t in r["tasks"].values():
            assert {"test_auc", "test_logloss", "train_loss", "test_ctr"} <= set(t)
    assert "| TASKS click: auc" in proc.stdout
    # a base bundle plus the delta's patch scores (n, 2) as a bundle of the delta
    ck = tmp_path / "ck"
    base, full, patch = (str(tmp_path / x) for x in ("base.h5", "full.h5", "patch.h5"))
    assert export.main(["--checkpoint", str(ck / "ckpt-000001-base"), "--out", base]) == 0
    assert export.main(["--checkpoint", str(ck / "ckpt-000002-delta"), "--out", full]) == 0
    assert export.main(["--checkpoint", str(ck / "ckpt-000002-delta"), "--out", patch,
                        "--since", base]) == 0
    p, ref = Predictor(base, header=lines[0]), Predictor(full, header=lines[0])
    before = p.predict_lines(lines[1:300])
    p.apply(patch)
    got = p.predict_lines(lines[1:300])
    assert got.shape == (299, 2) and np.array_equal(got, ref.predict_lines(lines[1:300]))
    assert not np.array_equal(got, before)
