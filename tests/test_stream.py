"""Online training: pass order, a late pass, base/delta schedule, kill and resume exactly once."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import MPI_ENV, ROOT, run_cmd
from tests.test_modes import load_params


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory):
    from data_prep.stream_synth import generate_stream
    out = tmp_path_factory.mktemp("stream")
    generate_stream(str(out), days=2, hours=3, rows_per_pass=1500, parts=2, seed=5)
    return out


def args(stream, out, *extra):
    return ["-m", "mpips.train", "--stream", str(stream), "--fc", "32,16", "--batch-size", "128",
            "--lr", "0.003", "--print-every", "100000", "--save-dir", str(out / "ck"),
            "--metrics-out", str(out / "m.jsonl")] + list(extra)


def records(out):
    path = out / "m.jsonl"
    return [json.loads(x) for x in open(path) if x.strip()] if path.exists() else []


def ckpts(out):
    return sorted(os.listdir(out / "ck"))


def test_local_stream_schedule_and_audit(stream_dir, tmp_path):
    proc = run_cmd(args(stream_dir, tmp_path, "--local", "--entry", "count:2",
                        "--shrink-every", "pass", "--shrink-threshold", "0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = records(tmp_path)
    names = [r["pass"] for r in recs]
    assert names == ["20261129/00", "20261129/01", "20261129/02",
                     "20261130/00", "20261130/01", "20261130/02"]
    # base after the first pass of each day, delta after the others
    assert [c.split("-")[2] for c in ckpts(tmp_path)] == ["base", "delta", "delta"] * 2
    for r in recs:
        assert 0.4 < r["test_auc"] < 1 and r["train_examples"] == 1500
        for k in ("table_rows", "table_bytes", "ids_admitted", "ids_waiting", "ids_evicted"):
            assert r[k] >= 0
    # the first shrink (before pass 1) only ages; rows unseen in pass 1 go before pass 2
    assert recs[0]["ids_evicted"] == recs[1]["ids_evicted"] == 0 and recs[2]["ids_evicted"] > 0
    for a, b in zip(recs, recs[1:]):       # rows = before - evicted + admitted
        assert b["table_rows"] == a["table_rows"] - b["ids_evicted"] + b["ids_admitted"]
    assert recs[0]["ids_admitted"] == recs[0]["table_rows"]
    # progressive validation improves as the model learns
    assert recs[-1]["test_auc"] > recs[0]["test_auc"]


def test_late_pass_is_picked_up(stream_dir, tmp_path):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(stream_dir, src)
    late = src / "20261130" / "02"
    os.remove(late / "_SUCCESS")                   # not ready yet
    cmd = [sys.executable] + args(src, tmp_path, "--local", "--stream-timeout", "120")
    p = subprocess.Popen(cmd, cwd=str(ROOT), env=dict(os.environ, **MPI_ENV),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(records(tmp_path)) < 5:          # poll the job's own output
            assert p.poll() is None, p.communicate()[1][-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        open(late / "_SUCCESS", "w").close()       # the pass lands
        while len(records(tmp_path)) < 6:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGTERM)              # ends the wait for a 7th pass
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    assert [r["pass"] for r in records(tmp_path)][-1] == "20261130/02"


def test_kill_and_resume_trains_each_pass_once(stream_dir, tmp_path):
    common = ("--local", "--shrink-every", "day", "--shrink-threshold", "1")
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = run_cmd(args(stream_dir, ref, *common))
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    run.mkdir()
    cmd = [sys.executable] + args(stream_dir, run, *common)
    p = subprocess.Popen(cmd, cwd=str(ROOT), env=dict(os.environ, **MPI_ENV),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(records(run)) < 2 and p.poll() is None:      # two passes done, third started
        assert time.monotonic() < deadline
        time.sleep(0.02)
    p.kill()
    p.communicate()
    done_before = [r["pass"] for r in records(run)]
    assert 2 <= len(done_before) < 6, done_before
    proc = run_cmd(args(stream_dir, run, *common))           # the same command again
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESUME --> " in proc.stdout
    from mpips import checkpoint as ck
    saved = [ck.read_manifest(os.path.join(run / "ck", c))["meta"]["pass"]
             for c in ckpts(run) if ck.list_checkpoints(str(run / "ck"))]
    after = [r["pass"] for r in records(run)][len(done_before):]
    trained = [n for n in done_before if n in saved] + after
    assert sorted(trained) == sorted(set(trained))           # none twice
    assert trained == [r["pass"] for r in records(ref)]      # none skipped, in order
    kr, vr, dr = load_params(ref / "ck")
    k, v, d = load_params(run / "ck")
    np.testing.assert_array_equal(k, kr)
    np.testing.assert_array_equal(v, vr)
    np.testing.assert_array_equal(d, dr)


def test_distributed_stream_sync(stream_dir, tmp_path):
    proc = run_cmd(args(stream_dir, tmp_path, "--mode", "sync", "--entry", "count:2"), n=4)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = records(tmp_path)
    assert len(recs) == 6 and recs[-1]["workers"] == 2
    assert [c.split("-")[2] for c in ckpts(tmp_path)] == ["base", "delta", "delta"] * 2
    ref = tmp_path / "local"
    ref.mkdir()
    proc = run_cmd(args(stream_dir, ref, "--local", "--local-workers", "2", "--entry", "count:2"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # admission counts occurrences, so both runs admit nearly the same ids; the step at which
    # an id crosses N can differ by one worker's half-batch (the two pulls of a step race)
    for a, b in zip(recs, records(ref)):
        assert a["table_rows"] == pytest.approx(b["table_rows"], rel=0.02)
    assert recs[-1]["test_auc"] == pytest.approx(records(ref)[-1]["test_auc"], abs=0.01)
