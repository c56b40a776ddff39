"""A stream stopped by a signal (issue 50): at a step boundary inside its pass, with a
checkpoint of that position, exit 75, and the same command finishing the pass exactly.

Every interruption point is sent by MPIPS_DEBUG_SIGNAL_AT (mpips.job.stop): after batch N of
pass number E, or as a phase of it begins (shrink, eval, save, wait).  Each stopped run is
resumed with the same command and compared with the uninterrupted run: the final checkpoint
array for array, each pass's evaluation and table figures, and the examples trained per pass
(the stopped part's record and the rest's add up to the pass).
"""
import os
import shutil

import numpy as np
import pytest

from mpips import checkpoint as ck
from tests.conftest import run_cmd
from tests.test_stream import args, final_state, records

PASSES = ["20261129/00", "20261129/01", "20261130/00", "20261130/01"]
ROWS = 400                                        # a pass's rows
FLAGS = ("--entry", "count:2", "--shrink-every", "pass", "--shrink-threshold", "0",
         "--batch-size", "64", "--progress-every", "0")
LOCAL = FLAGS + ("--local",)
PER_PASS = ("test_examples", "test_auc", "test_logloss", "test_mean_pred", "table_rows",
            "admitted_total", "ids_waiting", "passes_late")


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """2 days x 2 hours x 400 rows in 2 parts."""
    from data_prep.stream_synth import generate_stream
    out = tmp_path_factory.mktemp("stop_stream")
    generate_stream(str(out), days=2, hours=2, rows_per_pass=ROWS, parts=2, seed=5)
    return out


@pytest.fixture(scope="module")
def ref(stream, tmp_path_factory):
    """The uninterrupted one-process run (its dir)."""
    out = tmp_path_factory.mktemp("stop_ref")
    proc = run_cmd(args(stream, out, *LOCAL))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["pass"] for r in records(out)] == PASSES
    assert sum(r["ids_evicted"] for r in records(out)) > 0     # the shrinks evict
    return out


def stopped(stream, out, signal_at, *flags, n=None, where=None, sig="SIGTERM"):
    """Run with the signal; check it stopped (75, one line) and return the newest meta."""
    out.mkdir(exist_ok=True)
    proc = run_cmd(args(stream, out, *flags), n=n, env={"MPIPS_DEBUG_SIGNAL_AT": signal_at})
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("mpips:")]
    assert len(lines) == 1 and lines[0].startswith(f"mpips: stopped by {sig} "), lines
    assert "; continue with --resume auto (exit code 75)" in lines[0], lines
    if where:
        assert lines[0].startswith(f"mpips: stopped by {sig} {where}"), lines
    return ck.read_manifest(ck.latest(str(out / "ck")))["meta"]


def resumed(stream, out, *flags, n=None):
    """The same command again: it finishes the stream."""
    proc = run_cmd(args(stream, out, *flags), n=n)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_trained_once(run, want=None, rows=ROWS):
    """Each pass trained exactly once over the runs: its records' examples add up to its
    rows; the pass's figures (evaluation, table) are those of ``want`` (a reference run)."""
    recs = records(run)
    done = [r["pass"] for r in recs if "stopped_at_batch" not in r]
    assert done == PASSES, done                    # each pass completed once, in order
    for name in PASSES:
        mine = [r for r in recs if r["pass"] == name]
        assert sum(r["train_examples"] for r in mine) == rows, (name, mine)
        assert all("stopped_at_batch" in r for r in mine[:-1])
    if want is None:
        return
    for name, w in zip(PASSES, records(want), strict=True):
        mine = [r for r in recs if r["pass"] == name]
        assert {k: mine[-1].get(k) for k in PER_PASS} == {k: w.get(k) for k in PER_PASS}, name
        for k in ("ids_admitted", "ids_evicted"):    # the parts' add up to the pass's
            assert sum(r[k] for r in mine) == w[k], (name, k)


def assert_same_state(run, ref_run):
    name_r, want = final_state(ref_run / "ck")
    name, got = final_state(run / "ck")
    assert name == name_r == PASSES[-1] and sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_a_stopped_pass_is_never_recorded_as_done(stream, tmp_path):
    """The regression of issue 50: SIGTERM after batch 3 of the 2nd pass.  Its checkpoint
    holds the position inside the pass, after the 1st pass; no checkpoint says the 2nd pass
    is done; its record says where it stopped."""
    run = tmp_path / "run"
    run.mkdir()
    proc = run_cmd(args(stream, run, *LOCAL), env={"MPIPS_DEBUG_SIGNAL_AT": "TERM:1:3"})
    metas = [ck.read_manifest(str(run / "ck" / d))["meta"] for d in sorted(os.listdir(run / "ck"))]
    assert [m["pass"] for m in metas if not m.get("in_pass")] == [PASSES[0]], metas
    meta = metas[-1]
    assert meta["pass"] == PASSES[0] and meta["in_pass"] == PASSES[1] and meta["steps"] == 3
    assert proc.returncode == 75, proc.stderr[-2000:]
    recs = records(run)
    assert [r["pass"] for r in recs] == PASSES[:2]
    assert recs[1]["stopped_at_batch"] == 3 and recs[1]["train_examples"] == 3 * 64
    assert "test_auc" not in recs[1]                # the pass's evaluation: in its last record


@pytest.mark.exact
@pytest.mark.parametrize("where", ["train", "eval", "shrink", "save", "between"])
def test_local_stop_then_resume_equals_the_uninterrupted_run(stream, ref, tmp_path, where):
    """SIGTERM in the 2nd pass's training (after batch 3), as its evaluation or its save
    begins, as the 3rd pass's shrink begins (the first that evicts), or while the run asks
    for the pass after the 2nd: exit 75, then the
    same command; the final checkpoint equals the uninterrupted run's, every array, and
    every pass is trained once with the uninterrupted run's evaluation and table figures."""
    spec, expect = {
        "train": ("TERM:1:3", f"in pass {PASSES[1]} after batch 3"),
        "eval": ("TERM:1:eval", f"in pass {PASSES[1]} before its first batch"),
        "shrink": ("TERM:2:shrink", f"in pass {PASSES[2]} before its first batch"),  # evicts
        "save": ("TERM:1:save", f"after pass {PASSES[1]} (waiting for the next)"),
        "between": ("TERM:2:wait", f"after pass {PASSES[1]} (waiting for the next)"),
    }[where]
    run = tmp_path / "run"
    meta = stopped(stream, run, spec, *LOCAL, where=expect)
    if where == "eval":                             # stopped before the pass's training
        assert meta["in_pass"] == PASSES[1] and meta["steps"] == 0 and meta["pass_test"]
    elif where == "shrink":                         # ... and before its evaluation
        assert meta["in_pass"] == PASSES[2] and meta["steps"] == 0
        assert meta["pass_test"] is None and meta["pass_evicted"] > 0
    elif where != "train":
        assert meta["pass"] == PASSES[1] and "in_pass" not in meta
    proc = resumed(stream, run, *LOCAL)
    assert "RESUME --> " in proc.stdout
    assert_trained_once(run, ref)
    assert_same_state(run, ref)


@pytest.mark.parametrize("sig", ["INT", "USR1"])
def test_sigint_and_sigusr1_stop_a_stream_the_same_way(stream, tmp_path, sig):
    meta = stopped(stream, tmp_path / "run", f"{sig}:0:2", *LOCAL, sig=f"SIG{sig}",
                   where=f"in pass {PASSES[0]} after batch 2")
    assert meta["pass"] is None and meta["in_pass"] == PASSES[0] and meta["steps"] == 2


def test_stopped_twice_in_one_pass(stream, ref, tmp_path):
    """Stopped in the 2nd pass after batch 2, then again 2 batches into its rest (batch 4
    of the pass): the position adds up; the third run ends as the uninterrupted one."""
    run = tmp_path / "run"
    stopped(stream, run, "TERM:1:2", *LOCAL)
    meta = stopped(stream, run, "TERM:1:4", *LOCAL, where=f"in pass {PASSES[1]} after batch 4")
    assert meta["in_pass"] == PASSES[1] and meta["steps"] == 4
    resumed(stream, run, *LOCAL)
    assert_trained_once(run, ref)
    assert_same_state(run, ref)


@pytest.mark.parametrize("policy", ["warn", "fail"])
def test_a_pass_landing_late_while_stopped_is_late(stream, tmp_path, policy):
    """Stopped inside pass 20261129/01 while 20261129/00 was not ready; 20261129/00 lands
    before the resume: the resumed run finishes 20261129/01 first and 20261129/00 is late
    (warned and counted, never trained; or, with --late-pass fail, the run stops there)."""
    src, run, want = tmp_path / "src", tmp_path / "run", tmp_path / "want"
    shutil.copytree(stream, src)
    first = src / "20261129" / "00" / "_SUCCESS"
    os.remove(first)
    flags = LOCAL + ("--late-pass", policy)
    want.mkdir()
    assert run_cmd(args(src, want, *flags)).returncode == 0     # without the late pass
    meta = stopped(src, run, "TERM:0:3", *flags, where=f"in pass {PASSES[1]} after batch 3")
    assert meta["pass"] is None and meta["in_pass"] == PASSES[1]
    first.touch()                                   # lands while the run is stopped
    proc = run_cmd(args(src, run, *flags))
    recs = records(run)
    assert [r["pass"] for r in recs][:3] == [PASSES[1]] * 2 + ([PASSES[2]] if policy ==
                                                                "warn" else [])
    assert sum(r["train_examples"] for r in recs[:2]) == ROWS
    if policy == "fail":
        assert proc.returncode == 1 and "LatePass" in proc.stderr, proc.stderr[-2000:]
        assert f"pass {PASSES[0]} became ready after pass {PASSES[1]}" in proc.stderr
        assert ck.read_manifest(ck.latest(str(run / "ck")))["meta"]["pass"] == PASSES[1]
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"pass {PASSES[0]} became ready after pass {PASSES[1]}" in proc.stderr
    assert PASSES[0] not in [r["pass"] for r in recs] and recs[-1]["passes_late"] == 1
    name_r, state_r = final_state(want / "ck")
    name, state = final_state(run / "ck")
    assert name == name_r == PASSES[-1]
    for k, v in state_r.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)


@pytest.mark.exact
def test_sigterm_to_mpiexec_sync_stream_then_resume_equals_the_uninterrupted_run(
        stream, tmp_path):
    """2 servers x 2 workers, sync: SIGTERM to mpiexec (which passes it on to every rank)
    after worker 0's batch 2 of the 2nd pass; exit 75 from every rank; the same command
    again; the final checkpoint equals the uninterrupted run's, every array."""
    flags = FLAGS + ("--mode", "sync")
    full = tmp_path / "full"
    full.mkdir()
    proc = run_cmd(args(stream, full, *flags), n=4)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    meta = stopped(stream, run, "TERM:1:2:launcher", *flags, n=4, where=f"in pass {PASSES[1]}")
    assert meta["in_pass"] == PASSES[1] and meta["steps"] >= 2
    resumed(stream, run, *flags, n=4)
    assert_trained_once(run, full)
    assert_same_state(run, full)


def test_signal_to_one_async_worker_stops_all_and_every_example_trains_once(stream, tmp_path):
    """2 servers x 2 workers, async: SIGUSR1 to worker 0 only, after its batch 2 of the 2nd
    pass; every worker stops after the same step (the flag travels with the dense
    exchange); after the resume the passes' examples add up to the stream's rows."""
    run = tmp_path / "run"
    meta = stopped(stream, run, "USR1:1:2", *FLAGS, n=4, sig="SIGUSR1",
                   where=f"in pass {PASSES[1]} after batch 3 (all 4 ranks)")
    assert meta["in_pass"] == PASSES[1] and meta["steps"] == 3
    resumed(stream, run, *FLAGS, n=4)
    assert_trained_once(run)
    assert sum(r["train_examples"] for r in records(run)) == len(PASSES) * ROWS
