"""Which run is which (issue 35): every --metrics-out record names its run, mpips.plot draws
one labelled line per run, --tensorboard writes the scalars (read back here with a plain
TFRecord reader and the event protobuf, not with the writer's library)."""
import hashlib
import importlib.metadata
import json
import re
import struct

import pytest

from mpips.schema import Schema
from tests.conftest import run_cmd

TINY = ["--synth-rows", "1200", "--synth-test-rows", "300", "--fc", "8", "--batch-size", "100",
        "--print-every", "4", "--progress-every", "0", "--local"]


def records(path):
    return [json.loads(x) for x in open(path) if x.strip()]


def events(path):
    """(tag, step, value) of every scalar in a TensorBoard event file: TFRecord framing
    (u64 length, u32 crc, data, u32 crc) around Event protobufs."""
    from tensorboardX.proto import event_pb2
    out, data, pos = [], open(path, "rb").read(), 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
        pos += 12 + n + 4
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                out.append((v.tag, ev.step, v.simple_value))
    return out


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two local runs appending to one metrics file (the second with another lr and 2 epochs),
    the first with --tensorboard."""
    tmp = tmp_path_factory.mktemp("ident")
    m, tb = tmp / "m.jsonl", tmp / "tb"
    common = ["-m", "mpips.train", *TINY, "--cache-dir", str(tmp / "data"), "--metrics-out",
              str(m)]
    p1 = run_cmd(common + ["--tensorboard", str(tb)])
    assert p1.returncode == 0, p1.stderr[-2000:]
    p2 = run_cmd(common + ["--lr", "0.002", "--epochs", "2"])
    assert p2.returncode == 0, p2.stderr[-2000:]
    return records(m), tb, p1


def test_every_record_names_its_run(two_runs):
    recs, _, _ = two_runs
    assert len(recs) == 3
    want_hash = hashlib.sha256(json.dumps(Schema.criteo().to_dict(), sort_keys=True,
                                          separators=(",", ":")).encode()).hexdigest()[:16]
    for r in recs:
        assert re.fullmatch(r"[0-9a-f]{12}", r["run_id"]), r
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["run_started"]), r
        assert (r["model"], r["mode"], r["batch_size"]) == ("dnn", "async", 100)
        assert (r["workers"], r["servers"], r["local_workers"]) == (0, 0, 1)
        assert r["schema_hash"] == want_hash
        assert r["mpips_version"] == importlib.metadata.version("mpips")
    assert recs[0]["run_id"] != recs[1]["run_id"] == recs[2]["run_id"]
    assert [r["lr"] for r in recs] == [0.001, 0.002, 0.002]
    assert [r["epoch"] for r in recs] == [0, 0, 1]


def test_tensorboard_scalars_at_print_every_and_each_epoch(two_runs):
    recs, tb, p1 = two_runs
    runs = list(tb.iterdir())
    assert len(runs) == 1 and runs[0].name.endswith(recs[0]["run_id"]), runs
    files = list(runs[0].glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    got = events(files[0])
    train = [(s, v) for t, s, v in got if t == "train/loss"]
    logged = [(int(b), float(x)) for b, x in
              re.findall(r"^TRAIN --> pass: 0 batch: (\d+) loss: (\S+)", p1.stdout, re.M)]
    assert [s for s, _ in train] == [b for b, _ in logged] == [4, 8, 12]
    assert [v for _, v in train] == pytest.approx([x for _, x in logged], abs=1e-6)
    per_epoch = {t: (s, v) for t, s, v in got if t.startswith("epoch/")}
    for key in ("train_loss", "test_auc", "test_logloss", "examples_per_sec", "table_rows"):
        assert per_epoch[f"epoch/{key}"] == (0, pytest.approx(recs[0][key], rel=1e-6)), key


def test_plot_draws_one_labelled_line_per_run(two_runs, tmp_path):
    pytest.importorskip("matplotlib")
    from mpips import plot
    recs, _, _ = two_runs
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    runs = [(plot.run_label(str(path), r, [str(path)]), r) for r in plot.split_runs(recs)]
    assert [len(r) for _, r in runs] == [1, 2]
    fig = plot.plot_epochs(runs)
    auc = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    first, second = (f"m: {recs[i]['run_id'][:6]} dnn async local x1 b100 lr{lr}"
                     for i, lr in ((0, 0.001), (1, 0.002)))
    assert auc[f"{first} test"] == [recs[0]["test_auc"]]
    assert auc[f"{second} test"] == [recs[1]["test_auc"], recs[2]["test_auc"]]
    assert plot.main([str(path), "--out", str(tmp_path / "m.png")]) == 0
