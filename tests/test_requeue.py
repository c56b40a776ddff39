"""Production-job hygiene (issue 35): --resume auto, a used --save-dir refused, --keep N.

Unit tests build real (tiny) checkpoints with ``mpips.checkpoint.save_local``; the e2e
tests run ``python -m mpips.train --local`` on a few hundred rows.
"""
import os

import h5py
import numpy as np
import pytest

from mpips import checkpoint as ck
from mpips.config import parse_args
from mpips.job.resume import choose, choose_at_start, pin
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
from tests.conftest import run_cmd

OPT = OptimizerConfig(name="adam", lr=0.05)


def save(root, mode, step):
    """A one-shard checkpoint of a tiny table trained ``step`` times; its directory name."""
    sparse, dense = SparseTable(4, OPT, seed=1), DenseTable(np.zeros(5), OPT)
    for s in range(step + 1):
        sparse.push(np.arange(s, s + 3, dtype=np.int64), np.ones((3, 4), np.float32))
    return os.path.basename(ck.save_local(str(root), sparse, dense, mode, meta={"step": step}))


def names(root):
    return [c["name"] for c in ck.list_checkpoints(str(root))]


def cfg_of(*flags):
    return parse_args(["--local", *flags])


# ------------------------------------------------------------------ --resume auto
def test_resume_auto_with_none_one_and_a_corrupt_newest(tmp_path):
    root = tmp_path / "ck"
    cfg = cfg_of("--save-dir", str(root), "--resume", "auto")
    assert choose(cfg) is None                               # no directory yet
    assert pin(cfg, None).resume == ""                       # a fresh start
    root.mkdir()
    assert choose(cfg) is None                               # an empty one
    first = save(root, "full", 0)
    assert os.path.basename(choose(cfg)) == first            # one
    assert pin(cfg, choose(cfg)).resume == str(root / first)
    second = save(root, "full", 1)
    shard = next((root / second).glob("*.h5"))
    with h5py.File(shard, "r+") as f:                        # a changed value in the newest
        f["sparse/values"][0, 0] += 1.0
    lines = []
    assert os.path.basename(choose(cfg, lines.append)) == first
    assert len(lines) == 1 and second in lines[0] and "passing over" in lines[0], lines


def test_resume_auto_needs_a_save_dir():
    with pytest.raises(ValueError, match="--resume auto .* give --save-dir"):
        cfg_of("--resume", "auto")


# ------------------------------------------------------------------ a used --save-dir
def test_a_used_save_dir_is_refused_naming_the_choices(tmp_path):
    root = tmp_path / "ck"
    cfg = cfg_of("--save-dir", str(root))
    assert choose_at_start(cfg) is None                      # a new dir: fine
    save(root, "full", 0)
    with pytest.raises(ValueError) as e:
        choose_at_start(cfg)
    text = str(e.value)
    assert "\n" not in text and "holds 1 checkpoint(s)" in text
    for choice in ("--resume auto", "a new --save-dir", "--overwrite"):
        assert choice in text, text
    assert choose_at_start(cfg_of("--save-dir", str(root), "--overwrite")) is None
    assert choose_at_start(cfg_of("--save-dir", str(root), "--resume", "auto")) is not None


# ------------------------------------------------------------------ --keep N
def test_keep_removes_whole_chains(tmp_path):
    root = tmp_path / "ck"
    b1 = save(root, "base", 0)
    d2 = save(root, "delta", 1)
    d3 = save(root, "delta", 2)
    f4 = save(root, "full", 3)
    b5 = save(root, "base", 4)
    d6 = save(root, "delta", 5)
    assert ck.prune(str(root), keep=0) == []                 # 0 = keep all
    assert ck.prune(str(root), keep=4) == []                 # the 4th newest, d3, needs d2, b1
    assert names(root) == [b1, d2, d3, f4, b5, d6]
    assert ck.prune(str(root), keep=1) == [f4, d3, d2, b1]   # d6 needs b5; newest first
    assert names(root) == [b5, d6]
    ck.verify(str(root / d6))                                # the kept delta loads whole
    assert ck.prune(str(root), keep=1) == []


def test_overwrite_drops_what_came_before_the_runs_first_save(tmp_path):
    root = tmp_path / "ck"
    old = [save(root, "base", 0), save(root, "delta", 1)]
    mine = save(root, "full", 2)
    seq = int(mine.split("-")[1])
    assert ck.prune(str(root), 0, drop_before=seq) == old[::-1]
    assert names(root) == [mine]


def test_uncommitted_directories_are_left_alone(tmp_path):
    root = tmp_path / "ck"
    a = save(root, "full", 0)
    partial = root / "ckpt-000002-full"
    partial.mkdir()                                          # a save being written
    b = save(root, "full", 1)
    assert ck.prune(str(root), keep=1) == [a]
    assert names(root) == [partial.name, b]


# ------------------------------------------------------------------ end to end
TINY = ["--synth-rows", "600", "--synth-test-rows", "200", "--fc", "8", "--batch-size", "50",
        "--print-every", "1000", "--progress-every", "0"]


def test_train_refuses_a_used_save_dir_then_keep_and_overwrite(tmp_path):
    root = tmp_path / "ck"
    common = ["-m", "mpips.train", "--local", *TINY, "--cache-dir", str(tmp_path / "data"),
              "--save-dir", str(root)]
    p = run_cmd(common + ["--save-every", "4", "--keep", "2"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(names(root)) == 2 and "KEEP --> removed" in p.stdout, (names(root), p.stdout)
    p = run_cmd(common)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "--resume auto" in p.stderr and "--overwrite" in p.stderr, p.stderr
    before = names(root)
    p = run_cmd(common + ["--overwrite"])
    assert p.returncode == 0, p.stderr[-2000:]
    after = names(root)
    assert len(after) == 1 and after[0] not in before, (before, after)


# ------------------------------------------------------------------ stop on a signal
STOP_RUN = ["--fc", "16", "--batch-size", "200", "--lr", "0.003", "--print-every", "100000",
            "--progress-every", "0", "--epochs", "2"]


def stop_run(tiny_data, root, *extra, n=None, signal_at=None, timeout=300):
    args = ["-m", "mpips.train", "--train", tiny_data[0], "--test", tiny_data[1], *STOP_RUN,
            "--save-dir", str(root), "--metrics-out", str(root) + ".jsonl", *extra]
    env = {"MPIPS_DEBUG_SIGNAL_AT": signal_at} if signal_at else {}
    return run_cmd(args, n=n, env=env, timeout=timeout)


def our_lines(err):
    return [x for x in err.splitlines() if x.startswith("mpips:")]


def stopped_at(root):
    """(meta, name) of the newest checkpoint of root."""
    path = ck.latest(str(root))
    return ck.read_manifest(path)["meta"], os.path.basename(path)


@pytest.mark.parametrize("sig", ["TERM", "INT", "USR1"])
def test_a_signal_stops_a_local_run_at_the_step_with_a_checkpoint(tiny_data, tmp_path, sig):
    p = stop_run(tiny_data, tmp_path / "ck", "--local", signal_at=f"{sig}:0:7")
    assert p.returncode == 75, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    lines = our_lines(p.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"mpips: stopped by SIG{sig} at epoch 0 "
                                                   "after batch 7: checkpoint "), lines
    assert "--resume auto" in lines[0] and "(exit code 75)" in lines[0]
    assert stopped_at(tmp_path / "ck")[0] == {"epoch": 0, "steps": 7, "complete": False}


def test_a_stop_without_save_dir_says_nothing_was_saved(tiny_data, tmp_path):
    args = ["-m", "mpips.train", "--local", "--train", tiny_data[0], *STOP_RUN]
    p = run_cmd(args, env={"MPIPS_DEBUG_SIGNAL_AT": "TERM:1:3"})
    assert p.returncode == 128 + 15, p.stderr[-2000:]
    lines = our_lines(p.stderr)
    assert len(lines) == 1 and "SIGTERM at epoch 1 after batch 3: nothing saved" in lines[0]


@pytest.mark.exact
def test_local_stop_then_resume_auto_equals_the_uninterrupted_run(tiny_data, tmp_path):
    from tests.test_modes import assert_same_params, metrics
    assert stop_run(tiny_data, tmp_path / "full", "--local").returncode == 0
    p = stop_run(tiny_data, tmp_path / "cut", "--local", signal_at="USR1:1:4")
    assert p.returncode == 75, p.stderr[-2000:]
    assert stopped_at(tmp_path / "cut")[0] == {"epoch": 1, "steps": 4, "complete": False}
    p = stop_run(tiny_data, tmp_path / "cut", "--local", "--resume", "auto")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "RESUME --> " in p.stdout
    assert_same_params(tmp_path / "full", tmp_path / "cut", rtol=0, atol=0)     # bit for bit
    full, cut = metrics(str(tmp_path / "full") + ".jsonl"), metrics(str(tmp_path / "cut") + ".jsonl")
    assert cut[-1]["test_auc"] == full[-1]["test_auc"]


@pytest.mark.exact
def test_sigterm_to_mpiexec_sync_then_resume_auto_equals_the_uninterrupted_run(tiny_data,
                                                                              tmp_path):
    """The bar: SIGTERM to `mpiexec -n 4 ... --mode sync` mid-epoch (sent by worker 0 after
    its batch 5, to the mpiexec above it, which passes it on to every rank), then --resume
    auto: final parameters and AUC equal to the uninterrupted run's, bit for bit."""
    from tests.test_modes import assert_same_params, metrics
    sync = ("--mode", "sync")
    assert stop_run(tiny_data, tmp_path / "full", *sync, n=4).returncode == 0
    p = stop_run(tiny_data, tmp_path / "cut", *sync, n=4, signal_at="TERM:0:5:launcher")
    assert p.returncode == 75, p.stderr[-3000:]
    lines = our_lines(p.stderr)
    assert len(lines) == 1 and "mpips: stopped by SIGTERM at epoch 0 after batch" in lines[0]
    assert "(all 4 ranks)" in lines[0] and "BAD TERMINATION" not in p.stdout + p.stderr, lines
    meta = stopped_at(tmp_path / "cut")[0]
    assert meta["epoch"] == 0 and 5 < meta["steps"] < 40 and not meta["complete"], meta
    p = stop_run(tiny_data, tmp_path / "cut", *sync, "--resume", "auto", n=4)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_params(tmp_path / "full", tmp_path / "cut", rtol=0, atol=0)
    full, cut = metrics(str(tmp_path / "full") + ".jsonl"), metrics(str(tmp_path / "cut") + ".jsonl")
    assert cut[-1]["test_auc"] == full[-1]["test_auc"]
    assert cut[-1]["test_logloss"] == full[-1]["test_logloss"]


def test_a_signal_to_one_worker_stops_every_rank_at_the_same_step(tiny_data, tmp_path):
    """Only worker 0 gets SIGUSR1, after its batch 5 (async, 2 servers x 2 workers): the
    others hear of it with the next step's dense exchange and all stop after batch 6, a
    checkpoint is saved there, every rank exits 75; the resumed run trains exactly the rest
    of the data."""
    from tests.test_modes import metrics
    p = stop_run(tiny_data, tmp_path / "cut", n=4, signal_at="USR1:0:5")
    assert p.returncode == 75, p.stderr[-3000:]
    assert stopped_at(tmp_path / "cut")[0] == {"epoch": 0, "steps": 6, "complete": False}
    p = stop_run(tiny_data, tmp_path / "cut", "--resume", "auto", n=4)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = metrics(str(tmp_path / "cut") + ".jsonl")
    assert [r["epoch"] for r in recs] == [0, 1]
    assert recs[0]["train_examples"] == 16000 - 2 * 6 * 200 and recs[1]["train_examples"] == 16000


def test_a_signal_in_the_last_step_of_an_epoch_stops_after_it(tiny_data, tmp_path):
    """SIGTERM in the epoch's last step (80 batches of 200 of 16000 rows): the epoch ends,
    is evaluated and saved as usual, and the run stops there; the resume starts epoch 1."""
    from tests.test_modes import metrics
    p = stop_run(tiny_data, tmp_path / "ck", "--local", signal_at="TERM:0:80")
    assert p.returncode == 75, p.stderr[-2000:]
    assert "at epoch 0 after batch 80: checkpoint" in our_lines(p.stderr)[0]
    assert stopped_at(tmp_path / "ck")[0] == {"epoch": 0, "steps": 80, "complete": True}
    assert [r["epoch"] for r in metrics(str(tmp_path / "ck") + ".jsonl")] == [0]
    p = stop_run(tiny_data, tmp_path / "ck", "--local", "--resume", "auto")
    assert p.returncode == 0, p.stderr[-2000:]
    assert [r["epoch"] for r in metrics(str(tmp_path / "ck") + ".jsonl")] == [0, 1]


def test_keep_with_delta_saves_keeps_the_chain_a_resume_needs(tmp_path):
    """--save-mode delta --save-every 3: a batch run's saves are one chain (a base, then each
    delta on the one before), so --keep 2 keeps all of it (the newest needs every one); the
    chain verifies and --resume auto continues from its newest."""
    root = tmp_path / "ck"
    common = ["-m", "mpips.train", "--local", *TINY, "--cache-dir", str(tmp_path / "data"),
              "--save-dir", str(root), "--save-mode", "delta", "--save-every", "3", "--keep", "2"]
    p = run_cmd(common)                               # 12 batches: a base and 4 deltas
    assert p.returncode == 0, p.stderr[-2000:]
    assert names(root) == ["ckpt-000001-base"] + [f"ckpt-{i:06d}-delta" for i in range(2, 6)]
    assert "KEEP -->" not in p.stdout
    p = run_cmd(common + ["--resume", "auto", "--epochs", "2"])
    assert p.returncode == 0, p.stderr[-2000:]
    kept = names(root)
    assert len(kept) == 10 and kept[0] == "ckpt-000001-base", kept
    ck.verify(str(root / kept[-1]))
    assert ck.read_manifest(str(root / kept[-1]))["meta"]["epoch"] == 1
