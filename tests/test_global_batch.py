"""--global-batch G: W workers share a step of G examples (G // W each, the first G % W one
more), the dense rate is --lr x 1 at any W, and sync at G is one process at batch G.

- the split against dealing G examples round-robin to W workers (a plain Python count);
- the flag's errors (with --batch-size; G < W) are one line each;
- a real 2-worker sync run at an odd G (101 + 100 a step) equals --local --local-workers 2 at
  that G bit for bit (uneven parts keep the exactness), and equals --local --batch-size G
  on the same examples a step to float rounding: the sync workers' files are interleaved,
  101 rows of worker 0's then 100 of worker 1's, into the one file the local run reads.
"""
import itertools
import json
import os

import numpy as np
import pytest

from tests.conftest import run_cmd
from tests.test_modes import assert_same_params, load_params, train


def dealt(total, workers):
    """Per-worker counts when ``total`` examples are dealt one at a time, worker 0 first."""
    counts = [0] * workers
    for k in range(total):
        counts[k % workers] += 1
    return counts


def test_split_batch_deals_the_remainder_to_the_first_workers():
    from mpips.config import split_batch
    for total, workers in itertools.product([1, 2, 3, 7, 64, 100, 101, 4096, 4099],
                                            [1, 2, 3, 4, 7, 8, 64]):
        if total < workers:
            with pytest.raises(ValueError, match=f"--global-batch {total} over {workers} "
                                                 f"workers leaves a worker without examples"):
                split_batch(total, workers)
            continue
        parts = split_batch(total, workers)
        assert parts == dealt(total, workers), (total, workers)
        assert sum(parts) == total and max(parts) - min(parts) <= 1


def test_batch_in_force_start_line_and_dense_rate():
    from mpips.config import parse_args
    from mpips.job.build import dense_lr
    from mpips.job.plan import make_plan

    def plan(*argv):
        return make_plan(parse_args(["--local", "--fc", "8", *argv]))
    p = plan("--local-workers", "3", "--global-batch", "100")
    assert p.batches == (34, 33, 33) and p.global_batch == 100
    assert p.batch_line() == ("mpips: batch: --global-batch 100 over 3 worker(s): 34 for "
                              "worker 0, 33 for the other 2; dense learning rate 0.001")
    assert "4096 over 8 worker(s): 512 each" in plan("--local-workers", "8", "--global-batch",
                                                    "4096").batch_line()
    assert plan("--simulate-workers", "4", "--global-batch", "7").batches == (2, 2, 2, 1)
    assert plan("--global-batch", "300").batches == (300,)       # one process: batch G
    # the dense rate follows G, not W: one process's at batch G (--lr), at any W and rule
    for rule in ("auto", "linear", "sqrt"):
        g = parse_args(["--global-batch", "4096", "--dense-lr-rule", rule])
        assert [dense_lr(g, w) for w in (1, 2, 8, 64)] == [g.lr] * 4
    assert dense_lr(parse_args(["--global-batch", "4096", "--dense-lr-scale", "2"]), 8) == 2e-3
    plain = plan("--local-workers", "4")          # --batch-size in force: by W, as before
    assert plain.batches == (512,) * 4 and plain.global_batch == 2048
    assert dense_lr(plain.cfg, 4) == pytest.approx(4e-3)
    assert plain.batch_line() == ("mpips: batch: --batch-size 512 a worker x 4 worker(s) = "
                                  "global batch 2048; dense learning rate 0.004")


@pytest.mark.parametrize("argv, says", [
    (["--local", "--global-batch", "64", "--batch-size", "32"],
     "--global-batch G and --batch-size B exclude each other"),
    (["--local", "--local-workers", "4", "--global-batch", "3"],
     "--global-batch 3 over 4 workers leaves a worker without examples: give at least 4"),
    (["--local", "--simulate-workers", "8", "--global-batch", "7"],
     "--global-batch 7 over 8 workers"),
])
def test_bad_global_batch_is_one_line(argv, says):
    proc = run_cmd(["-m", "mpips.train", *argv, "--epochs", "1"], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


def test_global_batch_below_the_real_workers_is_one_line():
    proc = run_cmd(["-m", "mpips.train", "--global-batch", "2"], n=6, timeout=120)  # 3 x 3
    assert proc.returncode == 2
    assert "--global-batch 2 over 3 workers leaves a worker without examples" in proc.stderr
    assert proc.stderr.count("mpips: error") == 1, proc.stderr


def test_simulated_workers_take_their_share_and_say_so(tiny_data, tmp_path):
    """--simulate-workers 3 at G = 100: 34 + 33 + 33 examples a step, stated at start."""
    train_dir, test_dir = tiny_data
    out = tmp_path / "m.jsonl"
    proc = run_cmd(["-m", "mpips.train", "--local", "--simulate-workers", "3", "--global-batch",
                    "100", "--max-steps", "7", "--train", train_dir, "--fc", "16",
                    "--metrics-out", str(out)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("mpips: batch: --global-batch 100 over 3 worker(s): 34 for worker 0, 33 for the "
            "other 2; dense learning rate 0.001") in proc.stdout
    rec = [json.loads(x) for x in open(out)][0]
    assert rec["train_examples"] == 7 * 100 and rec["global_batch"] == 100
    assert rec["batch_flag"] == "global_batch"
    assert "batch_size" not in rec       # --batch-size (its default 512) is not in force


def interleave(parts, batches, out):
    """One text file holding, step by step, batches[k] lines of parts[k]'s files in turn:
    what W workers read in a step, in worker order, for a one-process reader."""
    lines = []
    for files in parts:
        rows = []
        for path in files:
            with open(path) as fh:
                rows.extend(fh.readlines())
        lines.append(rows)
    pos = [0] * len(parts)
    with open(out, "w") as fh:
        while any(p < len(rows) for p, rows in zip(pos, lines)):
            for k, rows in enumerate(lines):
                fh.writelines(rows[pos[k]:pos[k] + batches[k]])
                pos[k] += batches[k]
    return out


# 16000 rows in 8 files, 2 workers of 8000 rows: G = 201 is 101 + 100, 80 steps each (the
# last 21 + 100): the same examples a step as a one-process batch of 201 over the
# interleaved file.  --sync-sparse-lr none: a sparse step from the sum of the step's pushes,
# one process's step of batch G (with `each` a row steps once per worker's batch).
@pytest.mark.exact
def test_sync_at_global_batch_equals_local_at_that_batch(tiny_data, tmp_path):
    from mpips.config import split_batch
    from mpips.data.files import resolve_paths, worker_files
    G, common = 201, ("--optimizer", "adam", "--lr", "0.003", "--sync-sparse-lr", "none")
    dist = train(tiny_data, tmp_path, "sync", "--mode", "sync", "--global-batch", str(G),
                 *common, stdout=True)
    assert ("mpips: batch: --global-batch 201 over 2 worker(s): 101 for worker 0, 100 for "
            "the other 1; dense learning rate 0.003") in dist.pop()
    local_w = train(tiny_data, tmp_path, "local_w", "--local", "--local-workers", "2",
                    "--global-batch", str(G), *common)
    # the same order of sums as today: bit for bit, with uneven parts
    assert_same_params(tmp_path / "sync", tmp_path / "local_w", rtol=0, atol=0)
    assert dist[0]["test_auc"] == local_w[0]["test_auc"]
    assert dist[0]["global_batch"] == local_w[0]["global_batch"] == G
    assert dist[0]["batch_flag"] == "global_batch"
    assert dist[0]["worker_examples"] == [8000, 8000]

    train_dir, test_dir = tiny_data
    files = resolve_paths(train_dir)
    one = interleave([worker_files(files, 2, i) for i in range(2)], split_batch(G, 2),
                     tmp_path / "steps.txt")
    one_dir = tmp_path / "one"
    one_dir.mkdir()
    os.replace(one, one_dir / "part-00000.txt")
    local = train((str(one_dir), test_dir), tmp_path, "local", "--local", "--batch-size",
                  str(G), *common)
    assert local[0]["train_examples"] == dist[0]["train_examples"] == 16000
    # one backward of 201 rows against 101 + 100 added: float32 sums in another order,
    # through 80 Adam steps.  Measured: dense weights within 1.1e-7, sparse values equal
    # but for 3 of 131,220 beyond 1e-6 (the largest 3.5e-5: Adam's step is lr-sized
    # whatever the gradient's size, so a near-zero gradient's rounding moves a row by up
    # to lr), test AUC equal, logloss within 1e-9
    ks, vs, ds = load_params(tmp_path / "sync")
    kl, vl, dl = load_params(tmp_path / "local")
    np.testing.assert_array_equal(ks, kl)
    np.testing.assert_allclose(ds, dl, rtol=0, atol=1e-6)
    np.testing.assert_allclose(vs, vl, rtol=0, atol=0.003 / 10)      # a tenth of a step
    assert np.count_nonzero(np.abs(vs - vl) > 1e-6) <= vs.size // 10_000
    assert dist[0]["test_auc"] == pytest.approx(local[0]["test_auc"], abs=1e-6)
    assert dist[0]["test_logloss"] == pytest.approx(local[0]["test_logloss"], abs=1e-6)
    assert dist[0]["train_loss"] == pytest.approx(local[0]["train_loss"], rel=1e-6)


def test_plot_labels_name_the_batch_in_force():
    from mpips.plot import label_of
    rec = {"run_id": "abcdef123", "model": "dnn", "mode": "async", "workers": 8, "servers": 2,
           "batch_size": 512, "lr": 0.001, "global_batch": 4096}
    assert label_of(rec | {"batch_flag": "batch_size"}) == "abcdef dnn async 8x2 b512 lr0.001"
    assert label_of(rec | {"batch_flag": "global_batch"}) == "abcdef dnn async 8x2 G4096 lr0.001"
