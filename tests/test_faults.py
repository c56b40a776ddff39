"""Fault suite: dead and stuck peers mid-training, committed checkpoints survive, resume.

Each test starts `mpiexec -n 4 python -m mpips.train` (2 servers x 2 workers, 3 epochs,
a checkpoint after each) with its output going to files, waits until worker 0 logs a
batch of epoch 2 (so checkpoint 2 = epoch 1 is committed and epoch 2 is half done), then
SIGKILLs or SIGSTOPs one rank, found by the PID the job prints in its role map.
Worker 0 sleeps a little per step (MPIPS_DEBUG_SLOW_WORKER) so epoch 2 lasts about a
second.  Stopped ranks are resumed and every rank is killed in teardown.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import MPI_ENV, ROOT, jsonl_records, mpiexec_path, run_cmd

PEER_TIMEOUT = 4
START_DEADLINE = 120        # s for the job to reach epoch 2
KILL_DEADLINE = 10          # s from SIGKILL to the job's exit
STOP_DEADLINE = PEER_TIMEOUT + 8    # s from SIGSTOP to the job's exit


def train_args(data, out, *extra):
    train, test = data
    return ["-m", "mpips.train", "--train", train, "--test", test, "--batch-size", "256",
            "--fc", "32,16", "--print-every", "5", "--epochs", "3", "--lr", "0.003",
            "--save-dir", str(out / "ck"), "--metrics-out", str(out / "m.jsonl"),
            "--peer-timeout", str(PEER_TIMEOUT)] + list(extra)


def rank_pids(text):
    """{rank: pid} from the role map lines `  rank R host H ... pid P`."""
    return {int(r): int(p) for r, p in re.findall(r"^  rank (\d+) .* pid (\d+)$", text, re.M)}


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _teardown(proc, pids):
    for pid in pids.values():           # a stopped rank cannot die of SIGTERM; resume it
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    for pid in pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def inject(data, out, rank, sig, *extra, launcher=()):
    """Run the job, hit `rank` with `sig` mid epoch 2; return (rc, seconds to exit, out, err)."""
    out.mkdir(exist_ok=True)
    so, se = out / "stdout.txt", out / "stderr.txt"
    cmd = [mpiexec_path(), *launcher, "-n", "4", sys.executable] + train_args(data, out, *extra)
    env = dict(os.environ, **MPI_ENV, MPIPS_DEBUG_SLOW_WORKER="0:0.03")
    with open(so, "w") as fo, open(se, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, cwd=str(ROOT),
                                stdin=subprocess.DEVNULL)
    pids = {}
    try:
        deadline = time.monotonic() + START_DEADLINE
        while "TRAIN --> pass: 2 batch: 5 " not in so.read_text():     # the job's own log
            assert proc.poll() is None, se.read_text()[-3000:]
            assert time.monotonic() < deadline, "job did not reach epoch 2"
            time.sleep(0.02)
        pids = rank_pids(so.read_text())
        assert sorted(pids) == [0, 1, 2, 3], so.read_text()[:2000]
        t0 = time.monotonic()
        os.kill(pids[rank], sig)
        limit = KILL_DEADLINE if sig == signal.SIGKILL else STOP_DEADLINE
        try:
            rc = proc.wait(timeout=limit + 20)      # measured below, not only bounded
        except subprocess.TimeoutExpired:
            pytest.fail(f"job still running {limit + 20} s after {sig.name} of rank {rank}")
        seconds = time.monotonic() - t0
    finally:
        _teardown(proc, pids)
    assert seconds < limit, f"failure detected after {seconds:.1f} s (limit {limit})"
    return rc, seconds, so.read_text(), se.read_text()


def committed(out):
    """(latest valid checkpoint dir name, its epoch), after checking it loads in full."""
    from mpips import checkpoint as ck
    from tests.test_modes import load_params
    path = ck.latest(str(out / "ck"))
    keys, values, dense = load_params(out / "ck")          # CRC-checked load of all shards
    assert len(keys) > 1000 and np.isfinite(values).all() and np.isfinite(dense).all()
    return os.path.basename(path), ck.read_manifest(path)["meta"]["epoch"]


def test_killed_worker_fails_fast_and_resume_continues(tiny_data, tmp_path):
    rc, seconds, out, err = inject(tiny_data, tmp_path, 2, signal.SIGKILL)
    assert rc != 0
    # hydra takes the job down (SIGKILL to every rank: mpips cannot print a line) and
    # prints its banner; the PID in it is any rank's, so the role map PIDs are the key
    assert "Killed (signal 9)" in out + err and "BAD TERMINATION" in out + err
    assert committed(tmp_path) == ("ckpt-000002-full", 1)    # epoch 1, untouched
    proc = run_cmd(train_args(tiny_data, tmp_path, "--resume", str(tmp_path / "ck")), n=4,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EPOCH 2 -->" in proc.stdout and "EPOCH 0 -->" not in proc.stdout
    recs = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert [r["epoch"] for r in recs] == [0, 1, 2]           # epoch 2 once, after resume
    assert recs[-1]["train_examples"] == 16000
    assert committed(tmp_path) == ("ckpt-000003-full", 2)


def test_killed_server_fails_fast_checkpoint_intact(tiny_data, tmp_path):
    rc, seconds, out, err = inject(tiny_data, tmp_path, 1, signal.SIGKILL)
    assert rc != 0 and "Killed (signal 9)" in out + err
    assert committed(tmp_path) == ("ckpt-000002-full", 1)
    assert not (tmp_path / "ck" / "ckpt-000003-full" / "MANIFEST.json").exists()


def test_stopped_worker_is_named_by_the_servers(tiny_data, tmp_path):
    rc, seconds, out, err = inject(tiny_data, tmp_path, 2, signal.SIGSTOP, "--mode", "sync")
    assert rc != 0
    assert seconds >= PEER_TIMEOUT
    # the failing line names the stopped rank (the only one not answering a status request),
    # and what the servers saw: rank 2 silent alone (worker 1 waits in a sync PULL the
    # servers hold), or both workers silent (worker 1 waits in the workers' dense exchange;
    # which one depends on timing)
    assert re.search(r"mpips: rank \d: PeerTimeout: rank\(s\) \[2\] stopped answering", err), err
    assert re.search(r"server rank \d: worker rank\(s\) \[2(, 3)?\] sent nothing for 4 s", err), err
    # the dump: every live rank says what it waits for
    assert "peer status dump" in err
    assert re.search(r"rank 3 \(worker 1\): (PULL|PUSH|BARRIER|dense \w+ of the [\w ]+ of step)",
                     err), err
    assert re.search(r"rank 0 \(server 0\): serving, mode sync", err), err
    assert "rank 2: NO ANSWER" in err
    assert "Traceback" not in err
    assert committed(tmp_path) == ("ckpt-000002-full", 1)


def test_stopped_server_is_named_by_the_workers(tiny_data, tmp_path):
    rc, seconds, out, err = inject(tiny_data, tmp_path, 1, signal.SIGSTOP)
    assert rc != 0
    assert seconds >= PEER_TIMEOUT
    assert re.search(r"mpips: rank \d: PeerTimeout: rank\(s\) \[1\] stopped answering", err), err
    # a worker was mid-step: its dump line gives op, step and the server it waits for (async:
    # a step's push goes with the next step's pull, PUSH+PULL).  Which worker: the other may
    # be in the dense replicas' exchange, waiting for this one (seen on worker 0, once), but
    # both cannot be there, since the exchange would then complete.
    assert re.search(r"rank [23] \(worker [01]\): (PULL|PUSH|PUSH\+PULL) step \d+: waiting for "
                     r"server rank\(s\) \[1\]", err), err
    assert "rank 1: NO ANSWER" in err
    assert committed(tmp_path) == ("ckpt-000002-full", 1)


# ---- resource hygiene over a long-ish stream --------------------------------------------
HIDDEN_FROM = 3             # passes from this index on land after the first sample


def proc_usage(pid):
    """(open file descriptors, OS threads, RSS MB) of a live process, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return fds, int(status["Threads"]), int(status["VmRSS"].split()[0]) / 1024


def settled(pids, proc, deadline):
    """Per-rank usage once two looks in a row agree (the job idles between passes)."""
    prev = None
    while True:
        assert proc.poll() is None and time.monotonic() < deadline
        now = {r: proc_usage(p) for r, p in pids.items()}
        if prev is not None and all(now[r][:2] == prev[r][:2] for r in pids):
            return now
        prev = now
        time.sleep(0.1)


@pytest.mark.parametrize("ranks", [1, 4])
def test_stream_leaks_no_fds_threads_or_inflight_replies(tmp_path, ranks):
    from data_prep.stream_synth import generate_stream
    stream = tmp_path / "stream"
    generate_stream(str(stream), days=2, hours=9, rows_per_pass=300, parts=2, seed=9)
    passes = sorted(p.parent for p in stream.glob("*/*/_SUCCESS"))
    for p in passes[HIDDEN_FROM:]:
        os.remove(p / "_SUCCESS")                # they land later
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "mpips.train", "--stream", str(stream), "--fc", "16",
           "--batch-size", "64", "--print-every", "100000", "--save-dir", str(tmp_path / "ck"),
           "--metrics-out", str(metrics), "--stream-timeout", "60", "--peer-timeout", "30"]
    cmd = cmd + ["--local"] if ranks == 1 else [mpiexec_path(), "-n", "4"] + cmd
    so = tmp_path / "stdout.txt"
    with open(so, "w") as fo:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, **MPI_ENV), cwd=str(ROOT))
    pids = {}
    deadline = time.monotonic() + 150
    recs = lambda: jsonl_records(metrics)  # noqa: E731 (whole lines: the job appends to it)
    try:
        while len(recs()) < HIDDEN_FROM:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        pids = {0: proc.pid} if ranks == 1 else rank_pids(so.read_text())
        before = settled(pids, proc, deadline)
        for p in passes[HIDDEN_FROM:]:
            open(p / "_SUCCESS", "w").close()
        while len(recs()) < len(passes):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        after = settled(pids, proc, deadline)
        os.kill(pids[0 if ranks == 1 else 2], signal.SIGTERM)   # the stream's poller ends it
        _, err = proc.communicate(timeout=60)
    finally:
        _teardown(proc, pids)
    assert proc.returncode == 75, err[-3000:]       # stopped while waiting: resumable (75)
    print(f"ranks={ranks} passes={len(passes)} before={before} after={after}")
    for r in pids:
        assert after[r][0] == before[r][0], f"rank {r}: fds {before[r][0]} -> {after[r][0]}"
        assert after[r][1] == before[r][1], f"rank {r}: threads {before[r][1]} -> {after[r][1]}"
    if ranks > 1:       # servers' replies are all taken at every pass boundary
        for rec in recs():
            assert rec["requests_rejected"] == 0 and rec["replies_in_flight"] <= 4, rec
