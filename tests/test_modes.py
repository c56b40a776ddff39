"""Training modes against their references (mpiexec in a subprocess, tiny data).

- sync with W workers of batch B == local with --local-workers W (the same batches), every
  parameter equal bit for bit in the checkpoints both runs save (--sync-sparse-lr each, the
  default, and none);
- resume: 2 epochs == 1 epoch + resume + 1 epoch (sync);
- GEO with one worker and K=1 == local SGD; GEO sends ~K times fewer messages than async;
- SSP: with dense replicas a slowed worker is never more than one step behind; s=0 == sync.
"""
import json

import numpy as np
import pytest

from tests.conftest import run_cmd


def load_params(ckpt_root):
    """(sorted keys, values, dense) of the latest checkpoint under ckpt_root, in one table."""
    from mpips import checkpoint as ck
    from mpips.tables.dense import DenseTable
    from mpips.tables.optim import OptimizerConfig
    from mpips.tables.sparse import SparseTable
    path = ck.resolve(str(ckpt_root))
    m = ck.read_manifest(path)
    opt = OptimizerConfig(name=m["optimizer"]["name"])
    sparse = SparseTable(m["embedding_dim"], opt, seed=0)
    dense = DenseTable(np.zeros(m["n_params"], np.float32), opt)
    ck.load_local(path, sparse, dense)
    rows = sparse.export_rows()
    order = np.argsort(rows["keys"])
    d = np.empty(m["n_params"], np.float32)
    dense.pull(d)
    return rows["keys"][order], rows["values"][order], d


def assert_same_params(a, b, rtol=1e-4, atol=1e-5):
    ka, va, da = load_params(a)
    kb, vb, db = load_params(b)
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_allclose(va, vb, rtol=rtol, atol=atol)
    np.testing.assert_allclose(da, db, rtol=rtol, atol=atol)


def metrics(path):
    return [json.loads(x) for x in open(path) if x.strip()]


def train(tiny_data, out, name, *extra, n=4, env=None, stdout=False):
    """The epoch records of a run (and last, with ``stdout``, its standard output)."""
    train_dir, test_dir = tiny_data
    args = ["-m", "mpips.train", "--train", train_dir, "--test", test_dir, "--fc", "32,16",
            "--print-every", "100000", "--save-dir", str(out / name),
            "--metrics-out", str(out / f"{name}.jsonl")] + list(extra)
    proc = run_cmd(args, n=None if "--local" in extra else n, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(out / f"{name}.jsonl") + ([proc.stdout] if stdout else [])


# Adagrad starts from accumulator 0.1: from 0 its first step is lr * sign(g), a jump at
# g = 0 that turns float rounding of near-zero gradients into lr-sized differences.
# Adam: the default --sync-sparse-lr each (a sparse step per worker's push); Adagrad: none
# (one sparse step from the sum of the step's pushes: one process with the global batch),
# with --row-clip (the workers clip each part's rows before the sum: about 1 row in 20 here)
@pytest.mark.parametrize("opt", [pytest.param(("adam", "--lr", "0.003"), marks=pytest.mark.exact),
                                 ("adagrad", "--lr", "0.05", "--adagrad-init", "0.1",
                                  "--sync-sparse-lr", "none", "--row-clip", "3")])
def test_sync_equals_local_workers(tiny_data, tmp_path, opt):
    # 16000 rows, 2 workers x batch 32 -> 250 steps of batch 64
    common = ("--batch-size", "32", "--optimizer") + opt
    dist = train(tiny_data, tmp_path, "sync", "--mode", "sync", *common)
    local = train(tiny_data, tmp_path, "local", "--local", "--local-workers", "2", *common)
    assert_same_params(tmp_path / "sync", tmp_path / "local", rtol=0, atol=0)   # bit for bit
    if "--row-clip" in opt:                     # the clip ran in both (not skipped in both)
        assert dist[0]["row_clip_frac"] > 0.01 and local[0]["row_clip_frac"] > 0.01
    # the same per-batch float64 losses, added per worker then across workers against step
    # by step: k = 500 positive terms in two orders differ by < 2 k 2**-53 = 1.1e-13 relative
    assert dist[0]["train_loss"] == pytest.approx(local[0]["train_loss"], rel=1e-12)
    # test files scored per worker in both, states added as a + b in both: exact
    assert dist[0]["test_auc"] == local[0]["test_auc"]
    assert dist[0]["test_logloss"] == local[0]["test_logloss"]
    # the dense gradient noise scale (None here: by the epoch's end no signal shows above
    # the noise at a global batch of 64; measured in the test below)
    assert dist[0]["global_batch"] == local[0]["global_batch"] == 64
    d, lo = dist[0]["dense_noise_scale"], local[0]["dense_noise_scale"]
    assert d is lo is None or d == pytest.approx(lo, rel=1e-3)


def test_noise_scale_of_sync_equals_local_workers(tiny_data, tmp_path):
    """Two workers' shards of the noise-scale sums, added by the epoch's allreduce, against
    one process's whole vector: the same gradients, only float32 dot products split
    differently.  Early steps (60 a worker), where the mean gradient shows."""
    common = ("--batch-size", "32", "--optimizer", "adam", "--lr", "0.003", "--max-steps", "60")
    dist = train(tiny_data, tmp_path, "sync", "--mode", "sync", *common)
    local = train(tiny_data, tmp_path, "local", "--local", "--local-workers", "2", *common)
    assert dist[0]["global_batch"] == local[0]["global_batch"] == 64
    assert local[0]["dense_noise_scale"] > 0
    assert dist[0]["dense_noise_scale"] == pytest.approx(local[0]["dense_noise_scale"], rel=1e-3)


def test_resume_equals_uninterrupted(tiny_data, tmp_path):
    common = ("--mode", "sync", "--batch-size", "128", "--lr", "0.003")
    train(tiny_data, tmp_path, "full", *common, "--epochs", "2")
    train(tiny_data, tmp_path, "split", *common, "--epochs", "1")
    rec = train(tiny_data, tmp_path, "split", *common, "--epochs", "2", "--resume",
                str(tmp_path / "split"))
    assert [r["epoch"] for r in rec] == [0, 1]          # epoch 1 only ran in the resumed job
    assert_same_params(tmp_path / "full", tmp_path / "split", rtol=0, atol=0)


def test_geo_one_worker_k1_equals_local_sgd(tiny_data, tmp_path):
    common = ("--optimizer", "sgd", "--lr", "0.05", "--batch-size", "128")
    train(tiny_data, tmp_path, "geo", "--mode", "geo", "--geo-steps", "1", *common, n=2)
    train(tiny_data, tmp_path, "local", "--local", *common)
    assert_same_params(tmp_path / "geo", tmp_path / "local", rtol=1e-4, atol=1e-5)


def test_geo_sends_k_times_fewer_messages(tiny_data, tmp_path):
    common = ("--batch-size", "128", "--lr", "0.003")
    geo = train(tiny_data, tmp_path, "geo", "--mode", "geo", "--geo-steps", "10", *common)[0]
    asy = train(tiny_data, tmp_path, "async", "--mode", "async", *common)[0]
    assert geo["test_auc"] > 0.6
    # async: one message per step per server (the push with the next step's pull, one
    # message: PSClient.push_pull); geo: an add and a pull per 10 steps (plus the first
    # dense pull and the final sync of a partial round), so about K / 2 = 5 times fewer
    assert asy["messages_sent"] >= 4 * geo["messages_sent"], (asy["messages_sent"],
                                                              geo["messages_sent"])
    # bytes fall less than K-fold: a delta carries every id touched in the K steps
    assert asy["bytes_sent_per_example"] > geo["bytes_sent_per_example"]


def test_ssp_lead_at_most_one_with_dense_replicas(tiny_data, tmp_path):
    """With the dense weights updated by an allgather every step, a fast worker cannot run
    ahead of a slowed one: its pull of step t+1 may only overtake the other's push of step t
    (sent just after the allgather starts), so the lead is at most 1 and a staleness bound
    s >= 1 never binds (docs/modes.md)."""
    rec = train(tiny_data, tmp_path, "ssp", "--mode", "ssp", "--staleness", "2",
                "--batch-size", "128", env={"MPIPS_DEBUG_SLOW_WORKER": "1:0.01"})[0]
    assert rec["ssp_max_lead"] <= 1


def test_ssp_zero_is_sync(tiny_data, tmp_path):
    """ssp with staleness 0 trains what sync trains: checked against the one-process
    reference of sync (one step per W x B global batch), as sync itself is above."""
    common = ("--batch-size", "128", "--lr", "0.003")
    ssp0 = train(tiny_data, tmp_path, "ssp0", "--mode", "ssp", "--staleness", "0", *common)
    local = train(tiny_data, tmp_path, "local", "--local", "--local-workers", "2", *common)
    assert_same_params(tmp_path / "ssp0", tmp_path / "local")
    assert ssp0[0]["train_loss"] == pytest.approx(local[0]["train_loss"], rel=1e-5)
    assert ssp0[0]["ssp_max_lead"] == 0


@pytest.mark.parametrize("n", [None, 4])
def test_mid_epoch_checkpoint_resume_is_exact(tiny_data, tmp_path, n):
    """--save-every N batches: resuming from a mid-epoch checkpoint ends where the
    uninterrupted run ends (sync mode: the servers save exactly after step N)."""
    from mpips import checkpoint as ck
    common = ["--mode", "sync", "--batch-size", "128", "--lr", "0.003", "--epochs", "2",
              "--save-every", "20"] + (["--local", "--local-workers", "2"] if n is None else [])
    train(tiny_data, tmp_path, "full", *common, n=n)
    ckpts = ck.list_checkpoints(str(tmp_path / "full"))
    metas = [ck.read_manifest(c["path"])["meta"] for c in ckpts]
    mid = [c["path"] for c, m in zip(ckpts, metas)
           if m["epoch"] == 1 and m["steps"] == 20 and not m["complete"]]
    assert len(mid) == 1, metas
    rec = train(tiny_data, tmp_path, "resumed", *common, "--resume", mid[0], n=n)
    assert [r["epoch"] for r in rec] == [1]
    assert_same_params(tmp_path / "full", tmp_path / "resumed", rtol=0, atol=0)


@pytest.mark.parametrize("n,servers", [(4, 3), (2, 1)])
def test_reshard_on_resume_continues_exactly(tiny_data, tmp_path, n, servers):
    """A checkpoint of 2 servers resumed by `servers` servers and one worker trains on
    exactly like one process resumed from it: no id lost or misplaced by re-sharding."""
    common = ("--mode", "sync", "--batch-size", "128", "--lr", "0.003")
    train(tiny_data, tmp_path, "two", *common, "--epochs", "1")            # 2 servers
    src = str(tmp_path / "two")
    train(tiny_data, tmp_path, "resharded", *common, "--epochs", "2", "--resume", src,
          "--servers", str(servers), n=n)
    train(tiny_data, tmp_path, "local", "--local", *common, "--epochs", "2", "--resume", src)
    from mpips import checkpoint as ck
    assert ck.read_manifest(ck.resolve(str(tmp_path / "resharded")))["n_servers"] == servers
    assert_same_params(tmp_path / "resharded", tmp_path / "local", rtol=0, atol=0)
