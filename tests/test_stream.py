"""Online training: pass order, a late pass, base/delta schedule, kill and resume exactly once."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import MPI_ENV, ROOT, jsonl_records, run_cmd


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
    return jsonl_records(out / "m.jsonl")          # whole lines: a running job appends to it


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
    assert p.returncode == 75, err[-2000:]         # stopped, not finished: run it again
    assert "mpips: stopped by SIGTERM after pass 20261130/02 (waiting for the next): " \
           "checkpoint " in err, err[-2000:]
    assert [r["pass"] for r in records(tmp_path)][-1] == "20261130/02"


KILL_AT = "20261129/02:2"      # mid-stream, mid-pass: a delta chain to resume from
EXACT = ("--entry", "count:2", "--shrink-every", "pass", "--shrink-threshold", "2",
         "--mode", "sync", "--batch-size", "64")
SAME = ("pass", "train_examples", "train_loss", "train_auc", "test_examples", "test_auc",
        "test_logloss", "test_mean_pred", "table_rows", "admitted_total", "ids_admitted",
        "ids_waiting", "ids_evicted", "passes_late")


@pytest.fixture(scope="module")
def small_stream(tmp_path_factory):
    """2 days x 3 hours x 400 rows: the exact-resume tests."""
    from data_prep.stream_synth import generate_stream
    out = tmp_path_factory.mktemp("small_stream")
    generate_stream(str(out), days=2, hours=3, rows_per_pass=400, parts=2, seed=5)
    return out


@pytest.fixture(scope="module")
def local_ref(small_stream, tmp_path_factory):
    """The uninterrupted one-process run of small_stream with EXACT (its dir)."""
    ref = tmp_path_factory.mktemp("local_ref")
    proc = run_cmd(args(small_stream, ref, "--local", *EXACT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = records(ref)
    assert recs[-1]["ids_evicted"] > 0 and recs[-1]["ids_waiting"] > 0   # both at work
    return ref


def final_state(root):
    """Every field of the latest checkpoint under root (chain loaded into one table)."""
    from mpips import checkpoint as ck
    from mpips.tables.admission import AdmittedTable
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    path = ck.resolve(str(root))
    m = ck.read_manifest(path)
    opt = OptimizerConfig(name=m["optimizer"]["name"])
    sparse = SparseTable(m["embedding_dim"], opt, seed=0)
    dense = DenseTable(np.zeros(m["n_params"], np.float32), opt)
    adm = AdmittedTable(sparse, m["config"]["entry"], 0)
    ck.load_shard_into(path, sparse, dense, 0, 1, [0, m["n_params"]], adm)
    out = {f"dense/{k}": v for k, v in dense.export_state().items()}
    for name, table in (("sparse", sparse), ("admission", adm.counts)):
        rows = table.export_rows()
        order = np.argsort(rows["keys"])
        out.update({f"{name}/{k}": v[order] for k, v in rows.items()})
    out["admitted"] = adm.admitted
    return m["meta"]["pass"], out


def assert_same_run(run, ref, start=0):
    """run's records from `start` and its final checkpoint equal ref's, number for number."""
    got, want = records(run)[start:], records(ref)
    assert [r["pass"] for r in got] == [r["pass"] for r in want]  # none twice, none skipped
    for a, b in zip(got, want):
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}
    name_r, state_r = final_state(ref / "ck")
    name, state = final_state(run / "ck")
    assert name == name_r == "20261130/02" and sorted(state) == sorted(state_r)
    for k, v in state_r.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)


def killed(stream, run, *flags, n=None):
    """Run until MPIPS_DEBUG_KILL_AT SIGKILLs it mid-pass; check what it left."""
    run.mkdir()
    proc = run_cmd(args(stream, run, *flags), n=n, env={"MPIPS_DEBUG_KILL_AT": KILL_AT})
    assert proc.returncode != 0
    assert [r["pass"] for r in records(run)] == ["20261129/00", "20261129/01"]
    assert len(ckpts(run)) == 2          # the killed pass was not saved


@pytest.mark.parametrize("n", [None, 4], ids=["local", "2x2-sync"])
def test_kill_and_resume_is_exact(small_stream, local_ref, tmp_path, n):
    """SIGKILL mid-pass, then the same command again: every pass trained once, in order,
    and the per-pass numbers and the final checkpoint are those of an uninterrupted run."""
    flags = EXACT + (("--local",) if n is None else ())
    ref = local_ref
    if n:
        ref = tmp_path / "ref"
        ref.mkdir()
        proc = run_cmd(args(small_stream, ref, *flags), n=n)
        assert proc.returncode == 0, proc.stderr[-2000:]
    killed(small_stream, tmp_path / "run", *flags, n=n)
    proc = run_cmd(args(small_stream, tmp_path / "run", *flags), n=n)   # the same command
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same_run(tmp_path / "run", ref)


def test_resume_an_older_checkpoint_into_the_same_root(small_stream, local_ref, tmp_path):
    """Resumed from its 2nd checkpoint into the same --save-dir, a run's next delta builds
    on that checkpoint, not on the newest one of the abandoned run: every checkpoint it
    saves holds what the first run's checkpoint of the same pass holds."""
    import shutil
    from mpips import checkpoint as ck
    run = tmp_path / "run"
    shutil.copytree(local_ref, run)
    ckd = run / "ck"
    proc = run_cmd(args(small_stream, run, "--local", *EXACT, "--resume",
                        str(ckd / "ckpt-000002-delta")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, again = records(run)[:6], records(run)[6:]
    assert [r["pass"] for r in again] == [r["pass"] for r in first[2:]]
    for a, b in zip(again, first[2:]):
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}
    assert ck.chain(str(ckd / "ckpt-000007-delta")) == [
        str(ckd / c) for c in ("ckpt-000001-base", "ckpt-000002-delta", "ckpt-000007-delta")]
    for new, old in ((7, 3), (10, 6)):
        name, state = final_state(ckd / f"ckpt-{new:06d}-delta")
        name_o, state_o = final_state(ckd / f"ckpt-{old:06d}-delta")
        assert name == name_o and sorted(state) == sorted(state_o)
        for k, v in state_o.items():
            np.testing.assert_array_equal(state[k], v, err_msg=f"ckpt {new}: {k}")


def test_stream_resumed_into_more_servers(small_stream, local_ref, tmp_path):
    """A one-process stream killed mid-pass goes on as 2 servers x 1 worker (sync): ids,
    waiting counts and the admitted counter are re-sharded, and every number after the
    resume is that of the uninterrupted one-process run."""
    killed(small_stream, tmp_path / "run", "--local", *EXACT)
    proc = run_cmd(args(small_stream, tmp_path / "run", *EXACT, "--servers", "2"), n=3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert records(tmp_path / "run")[-1]["servers"] == 2
    assert_same_run(tmp_path / "run", local_ref)


@pytest.mark.parametrize("n", [None, 3], ids=["local", "2-servers"])
def test_corrupted_newest_checkpoint_is_passed_over(small_stream, local_ref, tmp_path, n):
    """Issue 23 D11: one flipped bit (same file size) in the newest checkpoint of a finished
    stream.  The same command again passes it over with one warning (printed once, by the
    rank that chooses), resumes from the one before, trains the last pass again, and ends
    with the uninterrupted run's numbers and checkpoint, every field."""
    import shutil

    import h5py
    run = tmp_path / "run"
    shutil.copytree(local_ref, run)
    newest = run / "ck" / "ckpt-000006-delta"
    shard = newest / "shard-00000-of-00001.h5"
    with h5py.File(shard, "r") as f:
        off = f["dense/values"].id.get_offset() + 9
    size = os.path.getsize(shard)
    with open(shard, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x10]))
    assert os.path.getsize(shard) == size
    flags = EXACT + (("--local",) if n is None else ("--servers", "2"))
    proc = run_cmd(args(small_stream, run, *flags), n=n)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [x for x in proc.stderr.splitlines() if "passing over" in x]
    assert warned == [f"mpips.checkpoint: passing over {shard}: checksum mismatch in dataset "
                      "dense/values (the file is corrupted)"], proc.stderr[-2000:]
    recs = records(run)
    assert len(recs) == 7 and recs[-1]["pass"] == "20261130/02"
    assert {k: recs[-1].get(k) for k in SAME} == {k: recs[5].get(k) for k in SAME}
    assert ckpts(run)[-1] == "ckpt-000007-delta"
    name_r, state_r = final_state(local_ref / "ck")
    name, state = final_state(run / "ck")
    assert name == name_r == "20261130/02" and sorted(state) == sorted(state_r)
    for k, v in state_r.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)


@pytest.mark.exact
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
    # sync equals one process with the workers' batches side by side, bit for bit, admission
    # included (sync servers answer a step's training pulls in worker order); the test
    # files are scored per worker in both (the same batches), and 2 workers' metric states
    # add up as a + b in both: test AUC and logloss are exact too
    # (table_bytes differs: two tables' capacity slack against one)
    keys = ("pass", "table_rows", "ids_admitted", "ids_waiting", "ids_evicted",
            "train_examples", "test_examples", "test_auc", "test_logloss", "train_auc")
    for a, b in zip(recs, records(ref), strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
        # the same per-batch float64 losses, summed per worker then across workers against
        # step by step: k <= 12 positive terms reordered differ by < 2 k 2**-53 relative
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-13)


def test_late_pass_is_reported_counted_or_fails(tmp_path):
    """A pass whose _SUCCESS lands after a later pass was taken: a warning and a count
    (never trained, never silently), or LatePass with policy 'fail'; a resumed run does
    not report again the passes ready before its last pass."""
    from mpips.job.stream import LatePass, PassFeed

    def land(name):
        d = tmp_path / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "_SUCCESS").touch()

    for name in ("20261129/00", "20261129/02"):
        land(name)
    (tmp_path / "20261129" / "01").mkdir()                   # not ready
    lines = []
    feed = PassFeed(str(tmp_path), warn=lines.append)
    assert feed.next(None, 0).name == "20261129/00"
    assert feed.next("20261129/00", 0).name == "20261129/02"
    assert feed.next("20261129/02", 0) is None and lines == []
    land("20261129/01")                                      # too late: /02 was taken
    assert feed.next("20261129/02", 0) is None
    assert feed.late == ["20261129/01"] and len(lines) == 1
    assert "20261129/01" in lines[0] and "NOT trained" in lines[0]
    assert feed.next("20261129/02", 0) is None and len(lines) == 1    # once only
    resumed = PassFeed(str(tmp_path), "20261129/02", warn=lines.append, late=feed.late)
    assert resumed.next("20261129/02", 0) is None and resumed.late == ["20261129/01"]
    assert len(lines) == 1
    strict = PassFeed(str(tmp_path), "20261129/00", "fail")  # /01 and /02 ready later
    with pytest.raises(LatePass, match="20261129/01"):
        strict.next("20261129/02", 0)
