"""jobs/slurm/*.sbatch under a real Slurm: the one-machine cluster of jobs/slurm/local_cluster.sh.

Each test submits a script with `sbatch`, polls `scontrol show job` until the job ends, and
checks its final state, its log and its files. Runs only where Slurm is installed (`sbatch`
on PATH) and the local cluster can be brought up (as root) or is up already; otherwise the
tests skip, or fail when MPIPS_REQUIRE_SLURM=1 (CI, after `jobs/slurm/local_cluster.sh up`).
The session fixture brings the cluster up and stops it again if it started it.
"""
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.stream_synth import generate_stream
from tests.conftest import MPI_ENV

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "jobs" / "slurm"
SLURM_DIR = Path(os.environ.get("MPIPS_SLURM_DIR", "/tmp/mpips-slurm"))
REQUIRED = os.environ.get("MPIPS_REQUIRE_SLURM") == "1"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
JOB_TIMEOUT = 150   # seconds for one job to finish (the train job takes ~15 s alone)
POLL = 0.5          # seconds between `scontrol show job` polls
# batch 125 = the rows of each of the 8 synthetic test files: a worker's evaluation batches
# (its files one after the other) are then infer's (each file from its start)
TINY = ["--synth-rows", "4000", "--synth-test-rows", "1000", "--fc", "32,16", "--batch-size", "125"]

pytestmark = pytest.mark.skipif(shutil.which("sbatch") is None and not REQUIRED,
                                reason="Slurm is not installed (no sbatch); as root: "
                                       "jobs/slurm/local_cluster.sh up")


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"{reason} (MPIPS_REQUIRE_SLURM=1)")
    pytest.skip(reason)


def _pythonpath():
    """The repo first on PYTHONPATH, so jobs import this checkout's mpips."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def _cluster_env():
    return dict(os.environ, SLURM_CONF=str(SLURM_DIR / "slurm.conf"),
                MPIPS_SLURM_DIR=str(SLURM_DIR))


def run(cmd, env, timeout=30, cwd=None):
    """Run a command to completion, capturing text output; the caller checks returncode."""
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _node_ready(env):
    if not (SLURM_DIR / "slurm.conf").exists():
        return False
    r = run(["sinfo", "-h", "-o", "%T"], env)
    return r.returncode == 0 and r.stdout.split()[:1] in (["idle"], ["mixed"], ["allocated"])


@pytest.fixture(scope="session")
def slurm_env():
    """Environment (SLURM_CONF) of a running local cluster; started here if needed."""
    if shutil.which("sbatch") is None:
        _unavailable("Slurm is not installed (no sbatch): as root, jobs/slurm/local_cluster.sh up")
    env = _cluster_env()
    was_up = _node_ready(env)
    if not was_up:
        if os.geteuid() != 0:
            _unavailable("the local Slurm cluster is down and starting it needs root")
        r = run(["bash", str(JOBS / "local_cluster.sh"), "up"], env, timeout=300)
        if r.returncode != 0:
            _unavailable(f"local_cluster.sh up failed: {r.stderr.strip()[-2000:]}")
    yield env
    if not was_up:
        run(["bash", str(JOBS / "local_cluster.sh"), "down"], env, timeout=60)


@pytest.fixture(scope="session")
def layout(slurm_env):
    """(sbatch options, extra mpips flags) for 2 servers + 2 workers on this cluster.

    With 2+ nodes (local_cluster.sh's default) the scripts run as they are: 2 nodes x 2 tasks,
    one server per node. On a one-node cluster: 1 node x 4 tasks and --servers 2."""
    r = run(["sinfo", "-h", "-N", "-o", "%N"], slurm_env)
    if len(set(r.stdout.split())) >= 2:
        return [], []
    return ["-N1", "--ntasks-per-node=4"], ["--servers", "2"]


def job_env(slurm_env, **extra):
    """Job environment: this interpreter's venv as MPIPS_VENV, this checkout importable."""
    env = dict(slurm_env, MPIPS_VENV=str(Path(sys.executable).parent.parent),
               PYTHONPATH=_pythonpath())
    env.update(extra)
    return env


def submit(script, args, env, cwd, opts=()):
    """sbatch SCRIPT with sbatch options `opts` and script arguments `args`; return the job id."""
    cmd = ["sbatch", "--parsable", "-o", str(Path(cwd) / "%x-%j.out"), *opts, str(JOBS / script),
           *args]
    r = run(cmd, env, cwd=str(cwd))
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def job_info(job_id, env):
    """Fields of `scontrol show job -o` as a dict (JobState, ExitCode, Restarts, ...)."""
    r = run(["scontrol", "show", "job", "-o", job_id], env)
    assert r.returncode == 0, f"scontrol show job {job_id}: {r.stderr}"
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def wait_until(job_id, env, done, what, log=None, timeout=JOB_TIMEOUT):
    """Poll the job until done(info) is true; on timeout cancel it and fail with its log."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id, env)
        if done(info):
            return info
        if time.monotonic() > deadline:
            run(["scancel", job_id], env)
            text = log.read_text() if log is not None and log.exists() else "(no log)"
            pytest.fail(f"job {job_id} not {what} after {timeout}s: {info.get('JobState')}\n{text}")
        time.sleep(POLL)


def wait_job(job_id, env, log=None):
    return wait_until(job_id, env, lambda i: i.get("JobState") in FINAL, "finished", log)


@functools.cache
def module_help(module):
    """`python -m module --help` output ('' if it fails): which features exist yet."""
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    r = run([sys.executable, "-m", module, "--help"], env, timeout=120, cwd=str(ROOT))
    return r.stdout if r.returncode == 0 else ""


def assert_clean(text):
    """No error in the job's log (Slurm's own `slurmstepd: ... CANCELLED` notices aside)."""
    ours = "\n".join(ln for ln in text.splitlines() if not ln.startswith("slurmstepd"))
    for bad in ("Traceback", "BAD TERMINATION", "error:", "Error:"):
        assert bad not in ours, f"{bad!r} in the job log:\n{text}"


@pytest.fixture(scope="module")
def train_job(slurm_env, layout, tmp_path_factory):
    """train.sbatch as in production, tiny synthetic data: (info, log, run_dir, cache)."""
    work = tmp_path_factory.mktemp("slurm_train")
    run_dir, cache = work / "run", work / "cache"
    env = job_env(slurm_env, MPIPS_RUN_DIR=str(run_dir))
    t0 = time.monotonic()
    opts, extra = layout
    job = submit("train.sbatch", [*TINY, "--cache-dir", str(cache), *extra], env, work, opts)
    log = work / f"mpips-train-{job}.out"
    info = wait_job(job, env, log)
    print(f"train job {job}: {info['JobState']} in {time.monotonic() - t0:.1f}s "
          f"(RunTime {info.get('RunTime')})")
    return info, log, run_dir, cache


def test_train_job_completes_with_role_map_and_metrics(train_job, layout):
    info, log, run_dir, _ = train_job
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert_clean(text)
    assert "4 ranks, 2 servers x 2 workers" in text, text
    roles = re.findall(r"^  rank (\d) host \S+ (server|worker) \d", text, re.MULTILINE)
    assert sorted(int(r[0]) for r in roles) == [0, 1, 2, 3], text
    servers = [int(r[0]) for r in roles if r[1] == "server"]
    # 2 nodes x 2 tasks: ranks 0,1 on the first node, 2,3 on the second; one server on each.
    assert servers == ([0, 2] if layout == ([], []) else [0, 1]), text
    assert re.search(r"^EPOCH 0 --> examples: 4000 ", text, re.MULTILINE), text
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["train_examples"] == 4000, recs
    assert recs[0]["test_examples"] == 1000 and (recs[0]["servers"], recs[0]["workers"]) == (2, 2)
    assert 0.0 < recs[0]["test_auc"] < 1.0 and recs[0]["test_logloss"] > 0.0


def test_train_job_saves_a_checkpoint(train_job, slurm_env):
    info, log, run_dir, _ = train_job
    if "--save-dir" not in module_help("mpips.train"):
        _unavailable("mpips.train has no --save-dir (checkpoint feature)")
    assert info["JobState"] == "COMPLETED", log.read_text()
    assert list((run_dir / "ckpt").rglob("MANIFEST.json")), sorted(run_dir.rglob("*"))


def test_infer_job_scores_the_trained_checkpoint(train_job, slurm_env, tmp_path):
    _, _, run_dir, cache = train_job
    env = job_env(slurm_env, MPIPS_RUN_DIR=str(tmp_path / "run"))
    if "--checkpoint" not in module_help("mpips.infer"):
        _unavailable("python -m mpips.infer --help does not work (checkpoint feature)")
    if not list((run_dir / "ckpt").rglob("MANIFEST.json")):
        _unavailable("the train job saved no checkpoint (mpips.train has no --save-dir?)")
    test_dirs = sorted(cache.glob("*/test"))
    assert len(test_dirs) == 1, test_dirs
    job = submit("infer.sbatch", ["--checkpoint", str(run_dir / "ckpt"), "--data", str(test_dirs[0])],
                 env, tmp_path)
    log = tmp_path / f"mpips-infer-{job}.out"
    done = wait_job(job, env, log)
    text = log.read_text()
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", text
    assert_clean(text)
    assert re.search(r"^TEST --> examples: 1000 auc: ", text, re.MULTILINE), text
    rec = json.loads((tmp_path / "run" / "metrics.json").read_text())
    trained = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["test_examples"] == 1000
    # the same parameters on the same rows in the same batches (TINY) give the same
    # predictions, so the same integer bucket counts: the AUC is exact; the logloss adds the
    # same 1000 float64 terms in another grouping: < 2 n 2**-53 = 2.2e-13 relative
    assert rec["test_auc"] == trained["test_auc"], (rec, trained)
    assert rec["test_logloss"] == pytest.approx(trained["test_logloss"], rel=1e-12), (rec, trained)


STREAM_FLAGS = ["--fc", "32,16", "--mode", "sync", "--batch-size", "64", "--entry", "count:2",
                "--shrink-every", "pass", "--shrink-threshold", "2"]


def make_stream(data, hours):
    """A small synthetic stream of `hours` passes of 1000 rows in `data`; its pass names."""
    return [p["name"] for p in generate_stream(str(data), days=1, hours=hours, rows_per_pass=1000,
                                               parts=2, seed=1)["passes"]]


def start_stream(slurm_env, layout, tmp_path, stream=None, **env_extra):
    """Submit stream.sbatch running mpips on a small synthetic stream (`stream`: (data, pass
    names) to read, else 24 passes made here); return (job id, log, env, data, ckpt, pass
    names) once the job has trained a pass."""
    env = job_env(slurm_env, **env_extra)
    if "--stream" not in module_help("mpips.train"):
        _unavailable("mpips.train has no --stream (streaming feature, issue 6)")
    ckpt = tmp_path / "ckpt"
    data, names = stream or (tmp_path / "stream", make_stream(tmp_path / "stream", 24))
    job = submit("stream.sbatch", [str(data), str(ckpt), "--stream-timeout", "0", *STREAM_FLAGS,
                                   "--print-every", "1", *layout[1]], env, tmp_path, layout[0])
    log = tmp_path / f"mpips-stream-{job}.out"
    wait_until(job, env, lambda i: i["JobState"] in FINAL or
               (log.exists() and "PASS " in log.read_text()), "training a pass", log)
    return job, log, env, data, ckpt, names


def test_stream_job_cancelled_is_not_requeued(slurm_env, layout, tmp_path):
    job, log, env, *_ = start_stream(slurm_env, layout, tmp_path)
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    info = wait_until(job, env, lambda i: i["JobState"] in FINAL and
                      "finished, not requeueing" in log.read_text(), "done", log)
    text = log.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", text
    assert "SIGTERM (cancelled, preempted or requeued)" in text and "requeueing job" not in text


def assert_every_pass_once(text, names):
    """Each pass completed once, in order, over the runs, and its PASS lines' examples (a
    stopped part's and the rest's) add up to its 1000 rows."""
    done = re.findall(r"^PASS (\S+) --> (?!stopped)", text, re.MULTILINE)
    assert done == names, f"passes completed {done}, expected each of {names} once\n{text}"
    for name in names:
        got = re.findall(rf"^PASS {re.escape(name)} --> .*?train examples: (\d+)", text, re.M)
        assert sum(map(int, got)) == 1000, (name, got, text)


@pytest.fixture(scope="module")
def stream_ref(slurm_env, tmp_path_factory):
    """The stream requeue tests' data and yardstick, made once for both ways of stopping:
    (data, pass names, final checkpoint state of the uninterrupted run, 2x2 outside Slurm).

    8 passes (in the tests, a worker-0 pass is 8 steps of >= 0.3 s, plus its save and
    evaluation): the stop, sent once a batch of the second pass shows, lands with that
    pass's last 7 steps and 6 more passes (>= 16 s) still to train."""
    from tests.test_stream import final_state
    tmp = tmp_path_factory.mktemp("stream_ref")
    data, ref = tmp / "stream", tmp / "ref"
    names = make_stream(data, 8)
    p = run([str(Path(sys.executable).parent / "mpiexec"), "-n", "4", sys.executable, "-m",
             "mpips.train", "--stream", str(data), "--save-dir", str(ref), "--stream-timeout",
             "0", "--servers", "2", *STREAM_FLAGS],
            dict(os.environ, **MPI_ENV), timeout=300, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    return data, names, final_state(ref)


@pytest.mark.parametrize("how", ["time-limit", "scontrol-requeue"])
def test_stream_job_stopped_mid_pass_and_requeued_trains_every_example_once(
        slurm_env, layout, tmp_path, stream_ref, how):
    """mpips itself (not a stand-in), sync: stopped inside a pass by what Slurm does before
    the time limit (SIGUSR1 to the script, which stops the step and requeues the job) or by
    `scontrol requeue` (SIGTERM, Slurm requeues): a checkpoint of the position in the pass,
    exit 75; the next run finishes that pass and the rest.  Every example trained once, and
    the final checkpoint equals the uninterrupted run's (2 servers x 2 workers), every array."""
    from tests.test_stream import final_state
    # worker 0 sleeps 0.3 s a step (8 steps a pass) and the stop is sent once the log shows
    # a batch of the second pass (a TRAIN line a batch): >= 2.1 s of that pass are left for
    # the signal's way through Slurm, so it lands inside a pass, not between two (sent at
    # the first PASS line, with 0.1 s a step, it met the next pass before its first batch
    # in 2 of 4 runs under load)
    data, names, (name_r, want) = stream_ref
    job, log, env, _, ckpt, _ = start_stream(slurm_env, layout, tmp_path, (data, names),
                                             MPIPS_DEBUG_SLOW_WORKER="0:0.3")
    deadline = time.monotonic() + JOB_TIMEOUT
    while not re.search(r"^PASS .*?^TRAIN --> ", log.read_text(), re.M | re.S):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)                  # polling the log, bounded by the deadline
    if how == "time-limit":
        cmd = ["scancel", "--batch", "--signal=USR1", job]
    else:
        cmd = ["scontrol", "requeue", job]
    subprocess.run(cmd, env=env, check=True, timeout=30)
    info = wait_until(job, env, lambda i: i["JobState"] in FINAL and i["Restarts"] == "1",
                      "requeued and finished", log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert_clean(text)
    first, _, second = text.partition("restart 1:")
    assert "restart 0:" in first and "step ended with exit code 75" in first, text
    assert re.search(r"^mpips: stopped by SIGTERM in pass \S+ after batch \d+ \(all 4 "
                     r"ranks\): checkpoint \S+; continue with --resume auto", first, re.M), text
    if how == "time-limit":
        assert "SIGUSR1 (time limit near)" in first and f"requeueing job {job}" in first, text
    assert "finished, not requeueing" in second and f"--resume {ckpt}" in second, text
    assert re.search(r"^RESUME --> \S+ \(pass \S+, \d+ batches done: stopped inside it",
                     second, re.M), text
    assert_every_pass_once(text, names)
    name, got = final_state(ckpt)
    assert name == name_r == names[-1] and sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def requeue_flags(cache):
    return [*TINY, "--cache-dir", str(cache), "--mode", "sync", "--epochs", "3",
            "--print-every", "5"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The yardstick of the requeue tests: (checkpoint root, last record, cache) of
    --local --local-workers 2 (sync's equal, bit for bit) on the same data and flags."""
    tmp = tmp_path_factory.mktemp("slurm_ref")
    ref, cache = tmp / "ck", tmp / "cache"
    p = run([sys.executable, "-m", "mpips.train", *requeue_flags(cache), "--local",
             "--local-workers", "2", "--save-dir", str(ref), "--metrics-out",
             str(tmp / "ref.jsonl")],
            dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1",
                 NUMBA_NUM_THREADS="1"), timeout=300, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    return ref, json.loads((tmp / "ref.jsonl").read_text().splitlines()[-1]), cache


@pytest.mark.parametrize("how", ["time-limit", "scontrol-requeue"])
def test_train_job_stopped_and_requeued_ends_as_the_uninterrupted_run(
        slurm_env, layout, tmp_path, uninterrupted, how):
    """train.sbatch as in production (--resume auto, --requeue, --signal=B:USR1@120), sync
    mode, stopped mid-epoch 0 by what Slurm does before the time limit (SIGUSR1 to the batch
    script, which stops the step and requeues the job) or by `scontrol requeue` (SIGTERM to
    the job, Slurm requeues it): every rank finishes its step, a checkpoint, exit 75; the
    job's next run continues from that checkpoint.  The final model and test AUC equal the
    uninterrupted run's, bit for bit."""
    from tests.test_modes import assert_same_params
    ref, want, cache = uninterrupted
    run_dir = tmp_path / "run"
    # worker 0 sleeps 0.1 s a step, so that the stop surely comes mid-run
    env = job_env(slurm_env, MPIPS_RUN_DIR=str(run_dir), MPIPS_DEBUG_SLOW_WORKER="0:0.1")
    opts, extra = layout
    job = submit("train.sbatch", [*requeue_flags(cache), *extra], env, tmp_path, opts)
    log = tmp_path / f"mpips-train-{job}.out"
    wait_until(job, env, lambda i: i["JobState"] in FINAL or
               (log.exists() and "TRAIN --> pass: 0 batch: 5 " in log.read_text()),
               "training", log)
    if how == "time-limit":
        cmd = ["scancel", "--batch", "--signal=USR1", job]
    else:
        cmd = ["scontrol", "requeue", job]
    subprocess.run(cmd, env=env, check=True, timeout=30)
    info = wait_until(job, env, lambda i: i["JobState"] in FINAL and i["Restarts"] == "1",
                      "requeued and finished", log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert_clean(text)
    first, _, second = text.partition("restart 1:")
    assert "step ended with exit code 75" in first, text
    assert re.search(r"^mpips: stopped by SIG\w+ at epoch 0 after batch \d+ \(all 4 ranks\): "
                     r"checkpoint \S+; continue with --resume auto", first, re.M), text
    if how == "time-limit":
        assert "SIGUSR1 (time limit near)" in first and f"requeueing job {job}" in first, text
    assert "finished, not requeueing" in second, text
    assert re.search(r"^RESUME --> \S+ \(epoch 0, \d+ batches done\)", second, re.M), text
    assert_same_params(run_dir / "ckpt", ref, rtol=0, atol=0)
    got = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert got["epoch"] == want["epoch"] == 2 and got["test_auc"] == want["test_auc"]
