"""Issue 23, "the files": a cut, edited, corrupted or differently configured file is refused
or passed over with one line; nothing wrong is loaded and nothing is dropped silently.

- D8 a last line cut inside its last field: here the --strict run;
  test_reader.py::test_cut_last_line_is_a_bad_line has the reader's rule in detail;
- D9 a resume (or a base..delta chain) with another setting that changes what the stored
  numbers mean: refused, one line naming the setting, both values and the fix;
- D10 an edited MANIFEST.json: refused by its checksum (or passed over in a root); meta
  out of the run's range refused even when the manifest is consistent (or legacy);
- D11 a same-size byte flip in the newest checkpoint: passed over, the next older one used
  (test_stream.py::test_corrupted_newest_checkpoint_is_passed_over for a stream restart).
All in one process (the mpips entry points' main() called in-process).
"""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from mpips import checkpoint as ck
from mpips import export as export_cli
from mpips import infer as infer_cli
from mpips import train as train_cli
from mpips.serving.bundle import read_bundle
from mpips.job.build import make_reader
from mpips.checkpoint.manifest import seal
from mpips.checkpoint.compat import MEANING, check_compatible
from mpips.config import Config
from mpips.data.criteo import ID_HASH
from mpips.data.files import resolve_paths
from mpips.job.resume import max_batches
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable

OLD_CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ckpt-v1-async")
STATS = {"cont_min": [0.0] * 13, "cont_diff": [10.0] * 13}
OTHER_STATS = {"cont_min": [0.0] * 13, "cont_diff": [10.0] * 4 + [20.0] + [10.0] * 8}
COMMON = ("--local", "--fc", "8", "--embedding-dim", "4", "--batch-size", "200", "--lr",
          "0.01", "--print-every", "100000")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_prep.synth import generate
    out = tmp_path_factory.mktemp("trust_data")
    generate(str(out), rows=3000, parts=2, seed=4, test_rows=1000)
    (out / "stats.json").write_text(json.dumps(STATS))
    return out


def train(data, root, *extra):
    return train_cli.main(["--train", str(data / "train"), "--test", str(data / "test"),
                           "--save-dir", str(root), *COMMON, *extra])


RUN = ("--hash-bucket", "1000")          # the trained run's settings (with --stats)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A root with one checkpoint: epoch 0 of a run with --hash-bucket 1000 --stats."""
    root = tmp_path_factory.mktemp("trust_ckpt") / "ck"
    assert train(data, root, *RUN, "--stats", str(data / "stats.json")) == 0
    return root


def copy(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "ck")
    return tmp_path / "ck"


def one_line(err):
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


def edit(ckpt_dir, fn, reseal):
    """Edit a MANIFEST.json: by hand (reseal=False), or consistently (checksum redone)."""
    path = os.path.join(ckpt_dir, ck.MANIFEST)
    m = json.load(open(path))
    fn(m)
    with open(path, "w") as fh:
        json.dump(seal(m) if reseal else m, fh, indent=1)


def flip_byte(shard, dataset="dense/values", at=5):
    """Flip one bit inside a dataset's stored bytes: same size, same HDF5 structure."""
    with h5py.File(shard, "r") as f:
        off = f[dataset].id.get_offset() + at
    with open(shard, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x10]))


# ------------------------------------------------------------------ D8
def test_d8_strict_run_stops_at_a_cut_last_line(data, tmp_path, capsys):
    lines = open(data / "train" / sorted(os.listdir(data / "train"))[0], "rb").readlines()
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"".join(lines[:50]) + lines[50][:-4])     # inside its last hex value
    argv = ["--train", str(cut), "--test", str(cut), *COMMON, "--strict"]
    assert train_cli.main(argv) == 1
    assert f"{cut}:51: malformed line skipped: last line" in one_line(capsys.readouterr().err)
    cut.write_bytes(b"".join(lines[:51]))                       # whole: the same run trains
    assert train_cli.main(argv) == 0


# ------------------------------------------------------------------ D9
@pytest.mark.parametrize("flags,want", [
    ((), r"saved with --hash-bucket 1000; this run has --hash-bucket 0 \(it decides which "
         r"row each feature value maps to\): run with --hash-bucket 1000, or do not resume"),
    (RUN, r"saved with --stats \S+stats.json; this run has no --stats \(it decides the dense "
          r"inputs the weights were trained on\): run with --stats \S+stats.json \(or a file "
          r"of the same values\)"),
    (RUN + ("--stats", "OTHER"), r"saved with --stats \S+stats.json \(I5: cont_min 0, "
                                 r"cont_diff 10\); this run has --stats \S+other.json \(I5: "
                                 r"cont_min 0, cont_diff 20\)"),
    (RUN + ("--stats", "SAME", "--embedding-dim", "6"),
     r"--embedding-dim 4; this run has --embedding-dim 6 \(it decides the width of every row\)"),
    (RUN + ("--stats", "SAME", "--fc", "8,4"), r"--fc 8; this run has --fc 8,4"),
    (RUN + ("--stats", "SAME", "--optimizer", "sgd"),
     r"--optimizer adam; this run has --optimizer sgd \(it decides the optimizer state"),
], ids=["hash_bucket", "no_stats", "other_stats", "dim", "fc", "optimizer"])
def test_d9_resume_with_another_meaning_is_refused(data, trained, tmp_path, capsys, flags,
                                                   want):
    (tmp_path / "other.json").write_text(json.dumps(OTHER_STATS))
    shutil.copy(data / "stats.json", tmp_path / "same.json")    # moved: the values count
    names = {"OTHER": str(tmp_path / "other.json"), "SAME": str(tmp_path / "same.json")}
    flags = [names.get(f, f) for f in flags]
    assert train(data, tmp_path / "new", *flags, "--epochs", "2", "--resume", str(trained)) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("mpips: error: checkpoint seq 1 was saved with ")
    assert __import__("re").search(want, line), line


def test_d9_resume_with_the_same_meaning_trains_on(data, trained, tmp_path, capsys):
    """The control: the run's own settings (statistics from a moved file of the same
    values) resume and train epoch 1."""
    shutil.copy(data / "stats.json", tmp_path / "moved.json")
    assert train(data, tmp_path / "new", *RUN, "--stats", str(tmp_path / "moved.json"),
                 "--epochs", "2", "--resume", str(trained), "--metrics-out",
                 str(tmp_path / "m.jsonl")) == 0
    assert [json.loads(x)["epoch"] for x in open(tmp_path / "m.jsonl")] == [1]


def tables(dim=4):
    opt = OptimizerConfig(name="adam", lr=0.05)
    sparse = SparseTable(dim, opt, seed=1)
    keys = np.arange(1, 51, dtype=np.int64)
    sparse.push(keys, np.ones((50, dim), np.float32))
    return sparse, DenseTable(np.linspace(-1, 1, 37), opt)


def test_d9_every_meaning_key_is_compared(tmp_path):
    """Each row of MEANING, changed alone, is refused naming it; equal values pass; a
    version 1 manifest (no recorded settings) is compared on what it has."""
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps(STATS))
    base = dict(embedding_dim=4, fc="3", hash_bucket=7, stats=str(stats))
    path = ck.save_local(str(tmp_path / "r"), *tables(), "full", config=Config(**base))
    m = ck.read_manifest(path)
    assert m["settings"] == {"ids": ID_HASH, "norm": STATS} and m["version"] == 2
    check_compatible(m, Config(**base))
    (tmp_path / "o.json").write_text(json.dumps(OTHER_STATS))
    cases = {"hash_bucket": (dict(hash_bucket=0), "--hash-bucket 7; this run has --hash-bucket 0"),
             "norm": (dict(stats=str(tmp_path / "o.json")), "I5: cont_min 0, cont_diff 10"),
             "embedding_dim": (dict(embedding_dim=8), "--embedding-dim 4; this run has"),
             "fc": (dict(fc="3,2"), "--fc 3; this run has --fc 3,2"),
             "optimizer": (dict(optimizer="sgd"), "--optimizer adam; this run has"),
             "network": (dict(model="deepfm"), "--model dnn (network ")}
    for key, (change, want) in cases.items():
        with pytest.raises(ck.CheckpointError, match=want.replace("(", r"\(")):
            check_compatible(m, Config(**dict(base, **change)))
    edit(path, lambda x: x["settings"].update(ids="fnv1a64-splitmix64/0"), reseal=True)
    with pytest.raises(ck.CheckpointError, match=r"feature-id hashing fnv1a64-splitmix64/0; "
                       rf"this run has feature-id hashing {ID_HASH} .*use the mpips version"):
        check_compatible(ck.read_manifest(path), Config(**base))
    assert set(cases) | {"ids"} == {k for k, _, _ in MEANING}
    old = ck.read_manifest(os.path.join(OLD_CKPT, "ckpt-000001-full"))   # version 1
    check_compatible(old, Config(embedding_dim=2, fc="8,4"))
    with pytest.raises(ck.CheckpointError, match="--hash-bucket 0; this run has --hash-bucket 3"):
        check_compatible(old, Config(embedding_dim=2, fc="8,4", hash_bucket=3))


def test_d9_a_chain_mixing_settings_is_refused(data, tmp_path, capsys):
    """A base saved with --hash-bucket 1000 and a delta on it with 0 (a resume before this
    check existed): scoring, export and resume refuse the chain."""
    root = str(tmp_path / "r")
    sparse, dense = tables()
    ck.save_local(root, sparse, dense, "base", config=Config(embedding_dim=4, fc="3",
                                                               hash_bucket=1000))
    sparse.push(np.arange(3, dtype=np.int64), np.ones((3, 4), np.float32))
    ck.save_local(root, sparse, dense, "delta", config=Config(embedding_dim=4, fc="3"))
    want = ("its chain mixes settings: ckpt-000001-base was saved with --hash-bucket 1000, "
            "ckpt-000002-delta with --hash-bucket 0 (use a checkpoint whose base and deltas "
            "come from one run)")
    assert export_cli.main(["--checkpoint", root, "--out", str(tmp_path / "b.h5")]) == 1
    assert one_line(capsys.readouterr().err).endswith(want)
    assert infer_cli.main(["--checkpoint", root, "--data", str(data / "test")]) == 1
    assert one_line(capsys.readouterr().err).endswith(want)
    assert train_cli.main(["--local", "--fc", "3", "--embedding-dim", "4", "--resume", root,
                           "--train", str(data / "train")]) == 2
    assert one_line(capsys.readouterr().err).endswith(want)


def test_stats_values_are_the_recorded_ones_for_infer_and_export(data, trained, tmp_path,
                                                                  capsys):
    """Scoring and export read with the normalisation the run trained with, recorded in the
    checkpoint: the statistics file edited or gone changes nothing; an export --stats with
    other values is refused."""
    ck_dir = copy(trained, tmp_path)
    stats = data / "stats.json"
    (tmp_path / "stats.json").write_text(stats.read_text())
    edit_cfg = lambda m: m["config"].update(stats=str(tmp_path / "stats.json"))  # noqa: E731
    edit(ck.resolve(str(ck_dir)), edit_cfg, reseal=True)       # its own copy of the file
    scores = []
    for step in ("as trained", "file edited", "file gone"):
        if step == "file edited":
            (tmp_path / "stats.json").write_text(json.dumps(OTHER_STATS))
        if step == "file gone":
            os.remove(tmp_path / "stats.json")
        out = tmp_path / f"{len(scores)}.json"
        assert infer_cli.main(["--checkpoint", str(ck_dir), "--data", str(data / "test"),
                               "--predictions-out", str(tmp_path / "p.txt"),
                               "--metrics-out", str(out)]) == 0, capsys.readouterr().err
        scores.append((json.loads(out.read_text())["test_auc"],
                       (tmp_path / "p.txt").read_text()))
    assert scores[0] == scores[1] == scores[2]
    cfg = Config(stats=str(data / "stats.json"))                # the edit would have counted:
    first = sorted(os.listdir(data / "test"))[0]
    (tmp_path / "o.json").write_text(json.dumps(OTHER_STATS))
    a = next(iter(make_reader(cfg, [str(data / "test" / first)], 100, print)))
    b = next(iter(make_reader(Config(stats=str(tmp_path / "o.json")),
                              [str(data / "test" / first)], 100, print)))
    assert not np.array_equal(a.dense, b.dense)
    bundle = tmp_path / "b.h5"
    assert export_cli.main(["--checkpoint", str(ck_dir), "--out", str(bundle)]) == 0
    assert read_bundle(str(bundle))[0]["data"]["cont_diff"] == STATS["cont_diff"]
    assert export_cli.main(["--checkpoint", str(ck_dir), "--out", str(bundle), "--stats",
                            str(tmp_path / "o.json")]) == 1
    line = one_line(capsys.readouterr().err)
    assert "(I5: cont_min 0, cont_diff 10); this run has --stats" in line
    assert line.endswith("leave --stats out (the checkpoint holds the values it was trained "
                         "with)")


# ------------------------------------------------------------------ D10
def test_d10_edited_manifest_is_refused_or_passed_over(data, trained, tmp_path, capsys):
    ck_dir = copy(trained, tmp_path)
    good = ck.resolve(str(ck_dir))
    out = tmp_path / "m.json"
    assert infer_cli.main(["--checkpoint", good, "--data", str(data / "test"), "--metrics-out",
                           str(out)]) == 0
    auc = json.loads(out.read_text())["test_auc"]
    capsys.readouterr()
    newer = str(ck_dir / "ckpt-000002-full")
    shutil.copytree(good, newer)
    edit(newer, lambda m: m.update(seq=2), reseal=True)          # a second, valid one
    assert ck.resolve(str(ck_dir)) == newer
    edit(newer, lambda m: m["config"].update(hash_bucket=0), reseal=False)     # by hand
    refused = (f"{newer}: MANIFEST.json was edited or damaged after it was written (its "
               "checksum does not match its contents); restore it, or use another checkpoint")
    assert infer_cli.main(["--checkpoint", newer, "--data", str(data / "test")]) == 1
    assert one_line(capsys.readouterr().err).endswith(refused)
    assert export_cli.main(["--checkpoint", newer, "--out", str(tmp_path / "b.h5")]) == 1
    assert one_line(capsys.readouterr().err).endswith(refused)
    assert train(data, tmp_path / "new", *RUN, "--epochs", "2", "--resume", newer) == 2
    assert one_line(capsys.readouterr().err) == f"mpips: error: {refused}"
    # in a root it is passed over, with one line, for the older one
    assert infer_cli.main(["--checkpoint", str(ck_dir), "--data", str(data / "test"),
                           "--metrics-out", str(out)]) == 0
    assert json.loads(out.read_text())["test_auc"] == auc
    assert one_line(capsys.readouterr().err) == f"mpips.checkpoint: passing over {refused}"
    for fn in (lambda m: m["meta"].update(epoch=7), lambda m: m.pop("checksum"),
               lambda m: m.update(version=1)):
        shutil.rmtree(newer)
        shutil.copytree(good, newer)
        edit(newer, lambda m: m.update(seq=2), reseal=True)
        edit(newer, fn, reseal=False)
        with pytest.raises(ck.CheckpointError, match="was edited or damaged"):
            ck.read_manifest(newer)


def test_d10_meta_out_of_range_is_refused(data, trained, tmp_path, capsys):
    """Even in a consistent manifest (resealed, or a legacy one), a position outside the
    run is an error naming it: no resume that trains nothing, no endless skip loop."""
    ck_dir = copy(trained, tmp_path)
    path = ck.resolve(str(ck_dir))
    edit(path, lambda m: m["meta"].update(epoch=7), reseal=True)
    args = (*RUN, "--stats", str(data / "stats.json"), "--resume", path)
    assert train(data, tmp_path / "new", *args, "--epochs", "2") == 2
    assert one_line(capsys.readouterr().err) == (
        f"mpips: error: checkpoint seq 1 ({path}) holds the end of epoch 7, and --epochs 2 "
        "ends before epoch 8: nothing left to train (epochs count from 0; give --epochs 9 "
        "or more to train on from it)")
    edit(path, lambda m: m["meta"].update(epoch=0), reseal=True)
    assert train(data, tmp_path / "new", *args, "--epochs", "1") == 2       # already done
    assert "holds the end of epoch 0, and --epochs 1 ends before epoch 1" in \
        capsys.readouterr().err
    edit(path, lambda m: m["meta"].update(epoch=1, steps=10 ** 9, complete=False), reseal=True)
    assert train(data, tmp_path / "new", *args, "--epochs", "2") == 2      # before any work
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"mpips: error: checkpoint seq 1 ({path}) was saved after "
                           f"{10 ** 9} batches of epoch 1, but the training data hold at most ")
    assert line.endswith("resume with the --train data and --batch-size it was saved with")
    assert max_batches(resolve_paths(str(data / "train")), 200)[1] >= 3000   # a true bound
    for bad in ({"epoch": 1.5}, {"steps": -1}, {"complete": "no"}, {"pass": 3}):
        edit(path, lambda m, bad=bad: m.update(meta=dict({"epoch": 0}, **bad)), reseal=True)
        assert train(data, tmp_path / "new", *args, "--epochs", "2") == 2
        assert "its meta " in one_line(capsys.readouterr().err)
    legacy = tmp_path / "old"                                  # version 1: no checksum
    shutil.copytree(OLD_CKPT, legacy)
    edit(legacy / "ckpt-000001-full", lambda m: m["meta"].update(epoch=7), reseal=False)
    assert train_cli.main(["--local", "--fc", "8,4", "--embedding-dim", "2", "--epochs", "2",
                           "--train", str(data / "train"), "--resume", str(legacy)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("mpips.checkpoint: note: ") and \
        "a version 1 MANIFEST.json (written before manifests were sealed)" in err[0]
    assert "holds the end of epoch 7" in err[1]


# ------------------------------------------------------------------ D11
def test_d11_a_flipped_byte_is_passed_over(tmp_path):
    """The newest checkpoint with one flipped bit (same size): passed over with one line
    for the next older one; a corrupted base takes its deltas with it, and is read once;
    none left: one clear error."""
    root = str(tmp_path)
    sparse, dense = tables()
    full = ck.save_local(root, sparse, dense, "full")
    base = ck.save_local(root, sparse, dense, "base")
    deltas = []
    for i in range(2):
        sparse.push(np.arange(i, i + 5, dtype=np.int64), np.ones((5, 4), np.float32))
        deltas.append(ck.save_local(root, sparse, dense, "delta"))
    assert ck.latest(root) == deltas[-1]
    flip_byte(os.path.join(deltas[-1], ck.shard_name(0, 1)), "sparse/values")
    warned = []
    assert ck.latest(root, warned.append) == deltas[0]
    assert warned == [f"passing over {deltas[-1]}/{ck.shard_name(0, 1)}: checksum mismatch "
                      "in dataset sparse/values (the file is corrupted)"]
    flip_byte(os.path.join(base, ck.shard_name(0, 1)))
    reads = []
    real = ck.h5io.Shard.verify
    ck.h5io.Shard.verify = lambda self, name: (reads.append((self.path, name)),
                                                real(self, name))[1]
    try:
        warned = []
        assert ck.resolve(root, warned.append) == full
    finally:
        ck.h5io.Shard.verify = real
    assert len(warned) == 3 and all("checksum mismatch in dataset dense/values" in w
                                    for w in warned)
    assert f"{deltas[0]} needs ckpt-000002-base: " in warned[1]
    assert len(reads) == len(set(reads))                       # the base was verified once
    flip_byte(os.path.join(full, ck.shard_name(0, 1)), "sparse/keys")
    with pytest.raises(ck.CheckpointError, match=f"{root}: holds no checkpoint that verifies"):
        ck.resolve(root, lambda _: None)
    s2, d2 = tables()
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):       # named: loaded
        ck.load_local(full, SparseTable(4, s2.opt, seed=1), d2)             # and refused


def test_stats_message_names_criteo_inputs_only_for_the_default_schema():
    """A 13-wide --schema of its own is not Criteo: its values are not I1..I13."""
    from mpips.checkpoint.compat import _show
    a = {"cont_min": [0.0] * 13, "cont_diff": [1.0] * 13}
    b = {"cont_min": [0.0] * 13, "cont_diff": [1.0] * 4 + [10.0] + [1.0] * 8}
    criteo = _show("norm", "--stats", b, {"stats": "s.json"}, a)
    own = _show("norm", "--stats", b, {"stats": "s.json", "schema": "my.toml"}, a)
    assert "(I5: cont_min 0, cont_diff 10)" in criteo
    assert "(dense value 5: cont_min 0, cont_diff 10)" in own
