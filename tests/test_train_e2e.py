"""End to end: `python -m mpips.train` locally and under mpiexec -n 4 on tiny data."""
import json

import pytest

from tests.conftest import run_cmd

FIELDS = ("epoch", "train_examples", "train_seconds", "examples_per_sec", "train_loss",
          "test_auc", "test_logloss")


def read_metrics(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def common(tiny_data, tmp_path, *extra):
    train, test = tiny_data
    return ["-m", "mpips.train", "--train", train, "--test", test, "--batch-size", "256",
            "--fc", "64,32", "--print-every", "10", "--lr", "0.003",
            "--metrics-out", str(tmp_path / "m.jsonl")] + list(extra)


def check_run(proc, tmp_path, n_train):
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_metrics(tmp_path / "m.jsonl")
    assert len(recs) == 1
    rec = recs[0]
    for f in FIELDS:
        assert f in rec, f
    assert rec["train_examples"] == n_train
    assert rec["test_examples"] == 4000
    assert rec["test_auc"] > 0.6, rec
    assert 0 < rec["test_logloss"] < 0.69
    assert "TRAIN --> pass: 0 batch: 10 loss:" in proc.stdout
    return rec


def check_warmed(proc, ranks):
    """Every kernel signature the run used was compiled (or loaded) by the warm-up before
    training (mpips.job.warmup; MPIPS_DEBUG_JIT makes each rank list any compiled later)."""
    first_train = proc.stdout.index("TRAIN -->")
    assert 0 <= proc.stdout.find("mpips: kernels compiled or loaded") < first_train
    counts = [x for x in proc.stderr.splitlines() if x.startswith("JIT --> ") and "after" in x]
    assert len(counts) == ranks, proc.stderr[-3000:]
    assert all(" 0 kernel signature(s) compiled after warm-up" in x for x in counts), \
        proc.stderr[-3000:]


def test_local_run(tiny_data, tmp_path):
    proc = run_cmd(common(tiny_data, tmp_path, "--local"), timeout=300,
                   env={"MPIPS_DEBUG_JIT": "1"})
    check_run(proc, tmp_path, 16000)
    check_warmed(proc, 1)


def test_async_2x2(tiny_data, tmp_path):
    proc = run_cmd(common(tiny_data, tmp_path), n=4, timeout=300, env={"MPIPS_DEBUG_JIT": "1"})
    rec = check_run(proc, tmp_path, 16000)
    check_warmed(proc, 4)
    assert rec["workers"] == 2 and rec["servers"] == 2
    assert "worker 0" in proc.stdout and "server 1" in proc.stdout   # role map
    assert proc.stdout.count("PROFILE --> ") == 5
    # what the servers sent is what the workers received, and the other way round
    prof = [x.split()[2:] for x in proc.stdout.splitlines() if x.startswith("PROFILE --> ")]
    col = {name: i for i, name in enumerate(prof[0])}
    total = {(role, c): sum(float(r[col[c]]) for r in prof[1:] if r[col["role"]] == role)
             for role in ("server", "worker") for c in ("MB_sent", "MB_recv")}
    assert abs(total["server", "MB_sent"] - total["worker", "MB_recv"]) <= 0.2, total   # rounding
    assert abs(total["server", "MB_recv"] - total["worker", "MB_sent"]) <= 0.2, total
    # keys go one way: a push carries keys and rows, a pull's reply rows only (the dense
    # slices a worker fetches at start, DENSE_GET, go the other way)
    assert total["server", "MB_recv"] > total["server", "MB_sent"], total


def test_missing_path_fails_fast(tmp_path):
    proc = run_cmd(["-m", "mpips.train", "--train", str(tmp_path / "nope")], n=4, timeout=120)
    assert proc.returncode != 0
    assert "nope" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,msg", [
    (["--servers", "4"], "--servers 4 needs at least 5 ranks"),
    (["--fc", "a,b"], "--fc must be"),
])
def test_bad_config_one_clear_line(args, msg):
    proc = run_cmd(["-m", "mpips.train"] + args, n=4, timeout=120)
    assert proc.returncode != 0
    assert msg in proc.stderr
    assert "Traceback" not in proc.stderr


def test_local_run_on_prepared_shards(tiny_data, tmp_path):
    """data_prep.criteo -> shards + stats.json -> training reads them (--stats)."""
    train, _ = tiny_data
    prep = tmp_path / "prep"
    proc = run_cmd(["-m", "data_prep.criteo", "--input", train, "--out", str(prep),
                    "--parts", "4", "--no-progress"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cmd(["-m", "mpips.train", "--local", "--train", str(prep / "train"),
                    "--test", str(prep / "val"), "--stats", str(prep / "stats.json"),
                    "--batch-size", "256", "--fc", "64,32", "--lr", "0.003",
                    "--metrics-out", str(tmp_path / "m.jsonl")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = read_metrics(tmp_path / "m.jsonl")[0]
    assert rec["train_examples"] + rec["test_examples"] == 16000
    assert 0.1 * 16000 * 0.8 < rec["test_examples"] < 0.1 * 16000 * 1.2
    assert rec["test_auc"] > 0.6


@pytest.mark.exact
def test_infer_reproduces_the_test_auc_of_training(tiny_data, tmp_path):
    """2x2 training saves a checkpoint; mpips.infer on the test set gives the same AUC.

    Batch 250 divides the test files' 500 rows: a worker's evaluation batches (its files
    read one after the other) are then infer's (each file from its start), and a row's
    prediction, which depends on its batch's shape with some BLAS kernels, is the same."""
    proc = run_cmd(common(tiny_data, tmp_path, "--save-dir", str(tmp_path / "ck"),
                          "--batch-size", "250"), n=4, timeout=300)
    rec = check_run(proc, tmp_path, 16000)
    out = tmp_path / "infer.json"
    proc = run_cmd(["-m", "mpips.infer", "--checkpoint", str(tmp_path / "ck"), "--data", tiny_data[1],
                    "--metrics-out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["test_examples"] == rec["test_examples"]
    # the same predictions, so the same integer bucket counts: the AUC is exact; the logloss
    # adds the same 4000 float64 terms in another grouping: < 2 n 2**-53 = 8.9e-13 relative
    assert got["test_auc"] == rec["test_auc"]
    assert got["test_logloss"] == pytest.approx(rec["test_logloss"], rel=1e-12)


def test_strict_mode_stops_the_job_naming_rank_and_line(tiny_data, tmp_path):
    import shutil
    train = tmp_path / "train"
    shutil.copytree(tiny_data[0], train)
    with open(train / "part-00003.txt", "a") as fh:
        fh.write("1\t2\t3\n")                              # 3 fields instead of 40
    proc = run_cmd(["-m", "mpips.train", "--train", str(train), "--strict", "--fc", "16",
                    "--print-every", "100000"], n=4, timeout=120)
    assert proc.returncode != 0
    line = [x for x in proc.stderr.splitlines() if x.startswith("mpips: rank")]
    assert line and "part-00003.txt:" in line[0], proc.stderr[-2000:]
    # without --strict the line is counted, reported and skipped
    proc = run_cmd(["-m", "mpips.train", "--train", str(train), "--fc", "16",
                    "--print-every", "100000", "--metrics-out", str(tmp_path / "m.jsonl")],
                   n=4, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "part-00003.txt:" in proc.stdout + proc.stderr
    assert read_metrics(tmp_path / "m.jsonl")[0]["train_examples"] == 16000


def test_fewer_files_than_workers_share_plain_text_and_warn_for_gzip(tiny_data, tmp_path):
    """One plain file, 2 workers: each trains on its byte share (issue 35); one gzip file
    cannot be cut, so the second worker has no data and says why."""
    import gzip
    one = tiny_data[0] + "/part-00000.txt"
    packed = tmp_path / "one.txt.gz"
    with gzip.open(packed, "wb") as f:
        f.write(open(one, "rb").read())
    recs = {}
    for name, path in (("plain", one), ("gzip", str(packed))):
        proc = run_cmd(["-m", "mpips.train", "--train", path, "--test", one, "--fc", "16",
                        "--mode", "sync", "--metrics-out", str(tmp_path / f"{name}.jsonl")],
                       n=4, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        recs[name] = read_metrics(tmp_path / f"{name}.jsonl")[0], proc.stdout
    rec, out = recs["plain"]
    assert "has no training data" not in out
    assert rec["train_examples"] == rec["test_examples"] == 2000
    assert min(rec["worker_examples"]) > 900
    rec, out = recs["gzip"]
    assert ("worker 1 has no training data (1 file(s) for 2 workers, and gzip files and "
            "binary parts are not shared by bytes)") in out
    assert rec["train_examples"] == 2000 and rec["worker_examples"] == [2000, 0]


def test_garbage_input_fails_with_one_line_naming_file_and_reason(tmp_path):
    """Random bytes, and lines of `1\\t2\\t3`, as --train: exit non-zero, one clear line."""
    import numpy as np
    rand = tmp_path / "random.bin"
    rand.write_bytes(np.random.default_rng(1).integers(0, 256, 200_000).astype(np.uint8).tobytes())
    ones = tmp_path / "ones.txt"
    ones.write_text("1\t2\t3\n" * 3000)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path, want in ((rand, "binary or compressed"), (ones, "found 3"),
                       (empty, "yields no valid example")):
        proc = run_cmd(["-m", "mpips.train", "--local", "--train", str(path), "--test", str(path),
                        "--fc", "16"], timeout=120)
        assert proc.returncode != 0, proc.stdout[-1000:]
        err = [x for x in proc.stderr.splitlines() if x.startswith("mpips: local")]
        assert len(err) == 1 and str(path) in err[0] and want in err[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_garbage_part_in_2x2_fails_the_job_naming_rank_and_file(tiny_data, tmp_path):
    import shutil
    train = tmp_path / "train"
    train.mkdir()
    shutil.copy(tiny_data[0] + "/part-00000.txt", train / "part-00000.txt")
    good = (train / "part-00000.txt").read_text().splitlines(keepends=True)
    # worker 1's file: 80 good lines and 20 cut inside the dense columns (10 fields: not a
    # short line read padded, which needs the label and every dense column; 20% > 10%)
    (train / "part-00001.txt").write_text("".join(good[:80] + ["\t".join(x.split("\t")[:10]) + "\n"
                                                               for x in good[:20]]))
    proc = run_cmd(["-m", "mpips.train", "--train", str(train), "--test", str(train), "--fc", "16",
                    "--print-every", "100000"], n=4, timeout=120)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("mpips: rank")]
    assert lines and "rank 3" in lines[0] and "part-00001.txt: 20 of 100 lines malformed" in lines[0], \
        proc.stderr[-2000:]
    assert "expected 40 tab-separated fields, found 10" in lines[0]  # the reason, with a hint
    # a higher limit lets the run skip them and train
    proc = run_cmd(["-m", "mpips.train", "--train", str(train), "--test", str(train), "--fc", "16",
                    "--print-every", "100000", "--max-bad-fraction", "0.25"], n=4, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
