"""End to end: a run with --table-memory (the disk tier, a cap far below the table) equals the
in-memory run: its test AUC and logloss, and every array of its final checkpoint (rows
aligned by id: the tier writes the resident rows first, then the disk rows in id order).
--local, and mpiexec -n 4 --mode sync (2 servers, 2 workers, with admission)."""
import json
import os

import h5py
import numpy as np
import pytest

from tests.conftest import run_cmd

ROW_GROUPS = ("sparse", "admission")


def checkpoint_arrays(root):
    """{dataset: array} of the newest checkpoint in ``root``, all shards: row fields ordered
    by id, evicted ids sorted, dense slices in shard order."""
    ckpt = os.path.join(root, sorted(d for d in os.listdir(root) if d.startswith("ckpt-"))[-1])
    parts = {}
    for name in sorted(os.listdir(ckpt)):
        if not name.endswith(".h5"):
            continue
        with h5py.File(os.path.join(ckpt, name), "r") as f:
            def visit(path, obj):
                if isinstance(obj, h5py.Dataset):
                    parts.setdefault(path, []).append(obj[()])
            f.visititems(visit)
    out = {k: np.concatenate([np.atleast_1d(a) for a in v]) for k, v in parts.items()}
    for g in ROW_GROUPS:
        if f"{g}/keys" in out:
            order = np.argsort(out[f"{g}/keys"])
            for k in [k for k in out if k.startswith(g + "/") and k.count("/") == 1]:
                if k not in (f"{g}/evicted", f"{g}/admitted"):
                    out[k] = out[k][order]
            out[f"{g}/evicted"] = np.sort(out[f"{g}/evicted"])
    return out


def run(tiny_data, tmp_path, name, extra, n=None):
    train, test = tiny_data
    save = tmp_path / name
    args = ["-m", "mpips.train", "--train", train, "--test", test, "--batch-size", "256",
            "--fc", "32", "--print-every", "1000", "--progress-every", "0",
            "--save-dir", str(save), "--metrics-out", str(tmp_path / f"{name}.jsonl")] + extra
    proc = run_cmd(args, timeout=400, n=n)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / f"{name}.jsonl") as fh:
        rec = [json.loads(x) for x in fh if x.strip()][-1]
    return proc, rec, checkpoint_arrays(str(save))


def assert_runs_equal(mem, tier):
    (_, rm, am), (proc, rt, at) = mem, tier
    assert rt["test_auc"] == rm["test_auc"] and rt["test_logloss"] == rm["test_logloss"]
    assert rt["train_loss"] == rm["train_loss"]
    assert am.keys() == at.keys() and "sparse/values" in am
    for k in am:
        np.testing.assert_array_equal(am[k], at[k], err_msg=k)
    assert rt["tier_disk_rows"] > rt["tier_resident_rows"] > 0, rt   # most rows were on disk
    assert 0 < rt["tier_hit_ratio"] < 1
    assert "tier: resident_rows:" in proc.stdout + proc.stderr


def test_local_tier_equals_in_memory(tiny_data, tmp_path):
    tier_dir = tmp_path / "tierdir"
    mem = run(tiny_data, tmp_path, "mem", ["--local"])
    tier = run(tiny_data, tmp_path, "tier", ["--local", "--table-memory", "64K",
                                              "--table-dir", str(tier_dir)])
    assert_runs_equal(mem, tier)
    assert os.listdir(tier_dir) == []            # the store's folder is removed at exit


@pytest.mark.parametrize("mode", ["sync"])
def test_sync_2x2_tier_equals_in_memory(tiny_data, tmp_path, mode):
    extra = ["--mode", mode, "--entry", "count:2"]
    tier_dir = tmp_path / "tierdir"
    mem = run(tiny_data, tmp_path, "mem", extra, n=4)
    tier = run(tiny_data, tmp_path, "tier", extra + ["--table-memory", "64K", "--table-dir",
                                                     str(tier_dir)], n=4)
    assert_runs_equal(mem, tier)
    assert os.listdir(tier_dir) == []


def test_unwritable_table_dir_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_cmd(["-m", "mpips.train", "--local", "--table-memory", "1M", "--table-dir",
                    str(blocker / "sub")], timeout=120)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert "not a writable directory" in err[-1] and len(err[-1]) < 300, proc.stderr[-2000:]


# --- a stream (admission, shrink every pass, base and delta saves) killed mid-pass and
# resumed under the tier equals the uninterrupted in-memory stream (tests/test_stream.py's
# runs and checks)
from tests.test_stream import (EXACT, args, assert_same_run, ckpts, killed,  # noqa: E402
                               local_ref, records, small_stream)  # noqa: F401 (fixtures)


def test_stream_killed_and_resumed_under_the_tier(small_stream, local_ref, tmp_path):
    tier = ("--table-memory", "64K", "--table-dir", str(tmp_path / "tierdir"))
    run = tmp_path / "run"
    killed(small_stream, run, "--local", *EXACT, *tier)
    assert os.listdir(tmp_path / "tierdir")       # SIGKILL left its folder: never read again
    proc = run_cmd(args(small_stream, run, "--local", *EXACT, *tier))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same_run(run, local_ref)


def test_stream_resumed_into_two_tiered_servers(small_stream, local_ref, tmp_path):
    """Killed in memory as one process, resumed into 2 servers with tiers (re-shard)."""
    run = tmp_path / "run"
    killed(small_stream, run, "--local", *EXACT)
    proc = run_cmd(args(small_stream, run, *EXACT, "--servers", "2", "--table-memory", "64K",
                        "--table-dir", str(tmp_path / "tierdir")), n=3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same_run(run, local_ref)
    assert os.listdir(tmp_path / "tierdir") == []


def stored_rows(path, like):
    """Every row of a store folder left on disk, read with LMDB directly (read-only), as
    ``like``'s fields in id order."""
    import lmdb
    from mpips.tables.disk import decode_keys, row_dtype
    dtype = row_dtype({f: a for f, a in like.items() if f != "path"})
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
    with env.begin() as txn:
        items = list(txn.cursor().iternext())
    env.close()
    rec = np.frombuffer(b"".join(v for _, v in items), dtype)
    return {"keys": decode_keys(b"".join(k for k, _ in items)),
            **{f: rec[f] for f in dtype.names}}


def test_kill_inside_a_write_back_then_resume(small_stream, local_ref, tmp_path):
    """SIGKILL inside a write-back transaction (tests/tier_fault_driver.py): the folder left
    holds exactly the last committed rows (LMDB's transactions), the next start removes it
    with one line, and resuming from the last checkpoint equals the uninterrupted
    in-memory stream."""
    tier_dir = tmp_path / "tierdir"
    run, report = tmp_path / "run", tmp_path / "report.npz"
    run.mkdir()
    cmd = args(small_stream, run, "--local", *EXACT, "--table-memory", "64K",
               "--table-dir", str(tier_dir))
    proc = run_cmd(["tests/tier_fault_driver.py", "40", str(report)] + cmd[2:])
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len(records(run)) == 3 and len(ckpts(run)) == 3      # killed in the 4th pass
    with np.load(report) as rep:
        left, committed = str(rep["path"]), {f: rep[f] for f in rep.files if f != "path"}
    assert os.listdir(tier_dir) == [os.path.basename(left)] and len(committed["keys"])
    got = stored_rows(left, committed)
    assert got.keys() == committed.keys()
    for f in got:
        np.testing.assert_array_equal(got[f], committed[f], err_msg=f)
    proc = run_cmd(cmd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    note = [x for x in proc.stderr.splitlines() if "left by a killed run" in x]
    assert note == [f"mpips: removed 1 disk-tier folder(s) left by a killed run: {left}"]
    assert os.listdir(tier_dir) == []
    assert_same_run(run, local_ref)
