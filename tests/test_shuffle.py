"""--shuffle: a seeded reshuffle of files over workers and of rows in a worker's window.

Checked against the set of input rows read in file order: every row exactly once per
epoch; the same seed gives the same order, another seed or epoch another; and a local
run resumed mid-epoch with --shuffle ends where the uninterrupted run ends.
"""
from collections import Counter

import pytest

from mpips.data.files import resolve_paths, split_files, worker_files
from mpips.data.reader import DataReader
from tests.conftest import run_cmd
from tests.test_modes import assert_same_params, train


def rows_of(files, window=0, seed=None, batch=100):
    """Every row read, in order, as bytes (dense + ids + label)."""
    r = DataReader(files, batch, prefetch=False, shuffle_window=window, shuffle_seed=seed)
    out = []
    for b in r:
        for i in range(len(b)):
            out.append(b.dense[i].tobytes() + b.sparse[i].tobytes() + b.label[i:i + 1].tobytes())
    return out


def epoch_rows(files, W, seed, epoch, window):
    return [rows_of(worker_files(files, W, w, seed, epoch), window, [seed, epoch, w])
            for w in range(W)]


def test_worker_files_partition_and_seeding():
    files = [f"f{i}" for i in range(10)]
    assert [worker_files(files, 3, w) for w in range(3)] == [split_files(files, 3, w)
                                                             for w in range(3)]
    orders = {}
    for seed in (0, 1):
        for epoch in (0, 1, 2):
            blocks = [worker_files(files, 3, w, seed, epoch) for w in range(3)]
            assert sorted(sum(blocks, [])) == sorted(files)          # a partition
            assert blocks == [worker_files(files, 3, w, seed, epoch) for w in range(3)]
            orders[seed, epoch] = sum(blocks, [])
    assert len(set(map(tuple, orders.values()))) == len(orders)      # all six differ
    few = [worker_files(files[:2], 3, w, 5, 1) for w in range(3)]     # fewer files than workers
    assert sorted(sum(few, [])) == files[:2] and few[2] == []


def test_every_row_once_per_epoch_same_seed_same_order(tiny_data):
    files = resolve_paths(tiny_data[0])                  # 8 files of 2000 rows
    reference = Counter(rows_of(files))
    assert len(reference) == 16000                       # rows are distinct
    runs = {}
    for seed, epoch in ((0, 0), (0, 1), (7, 0)):
        per_worker = epoch_rows(files, 2, seed, epoch, window=3000)
        assert Counter(sum(per_worker, [])) == reference  # each row exactly once
        runs[seed, epoch] = per_worker
    assert epoch_rows(files, 2, 0, 0, window=3000) == runs[0, 0]     # same seed: same order
    assert runs[0, 0] != runs[0, 1] and runs[0, 0] != runs[7, 0]
    in_file_order = [rows_of(split_files(files, 2, w)) for w in range(2)]
    assert runs[0, 0] != in_file_order
    # the window really mixes rows across files: the first 2000 rows of worker 0 come
    # from more than one file, and not in file order
    first_file = set(rows_of(worker_files(files, 2, 0, 0, 0)[:1]))
    head = runs[0, 0][0][:2000]
    assert 0 < sum(r in first_file for r in head) < 2000


def test_window_zero_keeps_rows_in_file_order(tiny_data):
    files = resolve_paths(tiny_data[0])
    shuffled_files = worker_files(files, 1, 0, 3, 0)
    assert rows_of(shuffled_files, 0, [3, 0, 0]) == sum((rows_of([f]) for f in shuffled_files), [])


def test_resume_mid_epoch_with_shuffle_equals_uninterrupted(tiny_data, tmp_path):
    from mpips import checkpoint as ck
    common = ["--local", "--local-workers", "2", "--batch-size", "128", "--lr", "0.003",
              "--epochs", "2", "--save-every", "20"]
    shuffle = ["--shuffle", "--shuffle-window", "2500"]
    full = train(tiny_data, tmp_path, "full", *common, *shuffle)
    ckpts = ck.list_checkpoints(str(tmp_path / "full"))
    metas = [ck.read_manifest(c["path"])["meta"] for c in ckpts]
    mid = [c["path"] for c, m in zip(ckpts, metas)
           if m["epoch"] == 1 and m["steps"] == 20 and not m["complete"]]
    assert len(mid) == 1, metas
    rec = train(tiny_data, tmp_path, "resumed", *common, *shuffle, "--resume", mid[0])
    assert [r["epoch"] for r in rec] == [1]
    assert_same_params(tmp_path / "full", tmp_path / "resumed", rtol=0, atol=0)
    assert rec[0]["train_loss"] != full[1]["train_loss"]      # the second half only
    # the order really changed: file order gives another first epoch
    plain = train(tiny_data, tmp_path, "plain", *common[:-4], "--epochs", "1")
    assert plain[0]["train_loss"] != pytest.approx(full[0]["train_loss"], rel=1e-6)
    # resuming with another seed is refused: it would skip other rows than were trained
    proc = run_cmd(["-m", "mpips.train", "--train", tiny_data[0], "--fc", "32,16", *common, *shuffle,
                    "--seed", "1", "--resume", mid[0]], timeout=300)
    assert proc.returncode == 2
    assert "saved mid-epoch with --seed 0; this run has --seed 1" in proc.stderr
