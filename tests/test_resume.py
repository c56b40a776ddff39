"""Resume is exact where the maths is deterministic, and safe where it is not.

- GEO: `--save-every N` saves mid-epoch; a resumed worker pulls the servers' rows of ids
  new to its local copy, so 1 worker resumed == uninterrupted, bit for bit (SGD: GEO keeps
  no optimizer state outside the checkpoint); 2 workers, K > 1: resumes and trains on;
- `--resume` with `--max-steps`: the skipped batches count towards the limit;
- async and ssp mid-epoch saves: consistent, loadable, the batches done recorded, and the
  resumed run trains only the rest of the epoch.
"""

import numpy as np
import pytest

from tests.test_modes import assert_same_params, load_params, train


def mid_checkpoint(root, epoch, steps):
    """The one mid-epoch checkpoint of `epoch` after `steps` batches under root."""
    from mpips import checkpoint as ck
    found = [c["path"] for c in ck.list_checkpoints(str(root))
             if ck.read_manifest(c["path"])["meta"] == {"epoch": epoch, "steps": steps,
                                                         "complete": False}]
    assert len(found) == 1, [c["name"] for c in ck.list_checkpoints(str(root))]
    return found[0]


GEO = ("--mode", "geo", "--geo-steps", "5", "--optimizer", "sgd", "--lr", "0.05",
       "--batch-size", "128")


def test_geo_resume_from_epoch_end_is_exact(tiny_data, tmp_path):
    """Fails if a resumed GEO worker starts rows it has not seen from their init values."""
    train(tiny_data, tmp_path, "full", "--local", *GEO, "--epochs", "2")
    train(tiny_data, tmp_path, "split", "--local", *GEO, "--epochs", "1")
    rec = train(tiny_data, tmp_path, "split", "--local", *GEO, "--epochs", "2",
                "--resume", str(tmp_path / "split"))
    assert [r["epoch"] for r in rec] == [0, 1]
    assert_same_params(tmp_path / "full", tmp_path / "split", rtol=0, atol=0)


def test_geo_save_every_n_and_mid_epoch_resume_is_exact(tiny_data, tmp_path):
    common = ("--local", *GEO, "--epochs", "2", "--save-every", "12")
    full = train(tiny_data, tmp_path, "full", *common)
    mid = mid_checkpoint(tmp_path / "full", 1, 12)
    rec = train(tiny_data, tmp_path, "resumed", *common, "--resume", mid)
    assert [r["epoch"] for r in rec] == [1]
    assert rec[0]["train_examples"] == full[1]["train_examples"] - 12 * 128
    assert_same_params(tmp_path / "full", tmp_path / "resumed", rtol=0, atol=0)


def test_resume_with_max_steps_trains_only_the_rest(tiny_data, tmp_path):
    """--max-steps 10 resumed after 4 batches trains 6 more: the result of one 10-step run."""
    common = ("--local", "--batch-size", "64", "--lr", "0.003", "--max-steps", "10",
              "--save-every", "4")
    train(tiny_data, tmp_path, "full", *common)
    rec = train(tiny_data, tmp_path, "resumed", *common, "--resume",
                mid_checkpoint(tmp_path / "full", 0, 4))
    assert rec[0]["train_examples"] == 6 * 64
    assert_same_params(tmp_path / "full", tmp_path / "resumed", rtol=0, atol=0)


def test_geo_admission_counts_occurrences(tiny_data, tmp_path):
    """count:2 in GEO admits exactly the ids that occur at least twice in the data (the
    final sync counts the last round), not the ids seen in two sync rounds."""
    from mpips.data.files import resolve_paths
    from mpips.data.reader import DataReader
    train(tiny_data, tmp_path, "geo", "--local", *GEO, "--entry", "count:2")
    reader = DataReader(resolve_paths(tiny_data[0]), 4096, prefetch=False)
    ids = np.concatenate([b.sparse.reshape(-1) for b in reader])
    reader.close()
    uniq, n = np.unique(ids, return_counts=True)
    keys, _, _ = load_params(tmp_path / "geo")
    np.testing.assert_array_equal(keys, uniq[n >= 2])


def test_geo_two_workers_resume_mid_epoch(tiny_data, tmp_path):
    """2 workers x K=5 (timing decides the order of their deltas, so not bit-exact): the
    mid-epoch checkpoint is saved and loads, the resumed run trains exactly the batches
    not yet trained, and ends where the uninterrupted run ends, within noise."""
    common = (*GEO, "--epochs", "2", "--save-every", "10")
    full = train(tiny_data, tmp_path, "full", *common)
    mid = mid_checkpoint(tmp_path / "full", 1, 10)
    keys, values, dense = load_params(mid)
    assert len(keys) > 1000 and np.isfinite(values).all() and np.isfinite(dense).all()
    rec = train(tiny_data, tmp_path, "resumed", *common, "--resume", mid)
    assert [r["epoch"] for r in rec] == [1]
    assert rec[0]["train_examples"] == full[1]["train_examples"] - 2 * 10 * 128
    assert rec[0]["test_auc"] == pytest.approx(full[1]["test_auc"], abs=0.01)
    ka, va, _ = load_params(tmp_path / "full")
    kb, vb, _ = load_params(tmp_path / "resumed")
    np.testing.assert_array_equal(ka, kb)                 # the same ids trained
    assert np.abs(va - vb).max() < 0.05 * np.abs(va).max()


@pytest.mark.parametrize("mode,n", [(("async",), 4), (("ssp", "--staleness", "2"), 5)],
                         ids=["async-2x2", "ssp-2x3"])
def test_mid_epoch_save_and_resume_async_ssp(tiny_data, tmp_path, mode, n):
    """What async/ssp guarantee: a consistent checkpoint mid-epoch (every shard at a
    request boundary, CRC-checked on load), the batches done recorded, and a resume that
    trains only the rest (no batch twice).  ssp runs 3 workers, one slowed: with dense
    replicas no worker gets more than one step ahead of it."""
    W = n - 2
    common = ("--mode", *mode, "--servers", "2", "--batch-size", "128", "--lr", "0.003",
              "--epochs", "2", "--save-every", "10")
    env = {"MPIPS_DEBUG_SLOW_WORKER": f"{W - 1}:0.01"} if mode[0] == "ssp" else None
    full = train(tiny_data, tmp_path, "full", *common, n=n, env=env)
    assert [r["train_examples"] for r in full] == [16000, 16000] and full[0]["workers"] == W
    if mode[0] == "ssp":        # the dense allgather keeps even the slowed worker in step
        assert full[0]["ssp_max_lead"] <= 1
    mid = mid_checkpoint(tmp_path / "full", 1, 10)
    keys, values, dense = load_params(mid)
    assert len(keys) > 1000 and np.isfinite(values).all() and np.isfinite(dense).all()
    rec = train(tiny_data, tmp_path, "resumed", *common, "--resume", mid, n=n)
    assert [r["epoch"] for r in rec] == [1]
    assert rec[0]["train_examples"] == 16000 - W * 10 * 128
    assert rec[0]["test_auc"] == pytest.approx(full[1]["test_auc"], abs=0.01)
