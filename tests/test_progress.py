"""The PROGRESS line: arithmetic against a fake clock, and under mpiexec with piped output
(a test hook makes it print every N steps instead of every N seconds: no timing)."""
import json
import re

from mpips.job.progress import Progress, fmt_rate, fmt_seconds
from tests.conftest import run_cmd

LINE = re.compile(r"PROGRESS --> epoch (\d+) (~?)(\d+)% \(([\d,]+) / ~?([\d,]+) rows")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_known_total_percent_rate_eta():
    clock, out = Clock(), []
    p = Progress("epoch 3", 1000, 0, None, 10.0, write=out.append, clock=clock)
    clock.t += 4.0
    p.tick(100, 100 * 0.5)           # the first step (start-up, JIT); not due: 4 s < 10 s
    assert out == []
    clock.t += 6.0
    p.tick(420, 420 * 0.25)          # 320 rows in the 6 s since it: 53.3 ex/s, 580 left: 10.9 s
    assert out == ["PROGRESS --> epoch 3 42% (420 / 1,000 rows) 53 ex/s  loss 0.2500  ETA 0:00:11"]
    clock.t += 10.9
    p.finish(1000, 1000 * 0.25)      # the whole phase: 1000 rows in 20.9 s
    assert out[-1] == ("PROGRESS --> epoch 3 100% (1,000 / 1,000 rows) 48 ex/s  loss 0.2500  "
                       "done in 0:00:21")


def test_estimate_from_bytes_says_so_and_never_goes_down():
    # text only: 1,000,000 bytes; after the first chunk 100 bytes per row, then 125
    clock, out, parsed = Clock(), [], [(1000, 100_000)]
    p = Progress("epoch 0", 0, 1_000_000, lambda: parsed[0], 0.0, write=out.append,
                 clock=clock, worker=(0, 2))
    clock.t += 1
    p.tick(500, 500 * 0.7)           # estimate 10,000 rows: 5%
    assert out[-1].startswith("PROGRESS --> epoch 0 ~5% (500 / ~10,000 rows est. from bytes, "
                              "worker 0 of 2) rate after step 2  loss 0.7000")   # one step: no
    assert "ETA" not in out[-1]                                         # rate, no ETA yet
    parsed[0] = (1600, 200_000)      # 125 bytes per row: 8,000 rows
    clock.t += 1
    p.tick(520, 520 * 0.7)           # 6.5% by the new estimate
    assert LINE.match(out[-1]).group(3) == "6"
    parsed[0] = (1000, 100_000)      # back to 10,000 rows: 5.3% < 6% shown before
    p.tick(530, 530 * 0.7)
    assert LINE.match(out[-1]).group(3) == "6"          # not lower than before
    parsed[0] = (7900, 1_000_000)    # all bytes parsed: the count is exact, no tilde
    p.tick(7800, 0.0)
    assert out[-1].startswith("PROGRESS --> epoch 0 98% (7,800 / 7,900 rows, worker 0 of 2)")
    p.tick(7900, 0.0)                # 100% only at the end
    assert LINE.match(out[-1]).group(3) == "99"


def test_limit_offset_and_stream_lag():
    clock, out = Clock(), []
    # resumed after 200 rows, --max-steps worth 300 rows: the phase ends at row 500
    p = Progress("pass 20260101/02", 10_000, 0, None, 0.0, write=out.append, clock=clock,
                 limit=300, offset=200, lag=lambda: "2 passes behind the newest ready one")
    clock.t += 1
    p.tick(50, 25.0)                 # the first step: the rate counts from here
    clock.t += 1
    p.tick(100, 50.0)
    assert out[-1].startswith("PROGRESS --> pass 20260101/02 60% (300 / 500 rows) 50 ex/s")
    assert out[-1].endswith("ETA 0:00:04  | 2 passes behind the newest ready one")


def test_formats():
    assert [fmt_rate(x) for x in (950, 61_234, 1_234_567)] == ["950", "61.2k", "1.23M"]
    assert fmt_seconds(3725.4) == "1:02:05"


def test_passes_behind(tmp_path):
    from mpips.job.stream import passes_behind
    for h in ("00", "01", "02", "03"):
        d = tmp_path / "20260101" / h
        d.mkdir(parents=True)
        if h != "03":
            (d / "_SUCCESS").write_text("")
    assert passes_behind(str(tmp_path), "20260101/00") == \
        "2 passes behind the newest ready one (20260101/02)"
    assert passes_behind(str(tmp_path), "20260101/02") == "at the newest ready pass"


def count_lines(files):
    return sum(sum(1 for line in open(f) if line.strip()) for f in files)


def test_progress_under_mpiexec_piped_rises_to_100(tiny_data, tmp_path):
    """2x2 under mpiexec, stdout a pipe, 2 shuffled epochs: worker 0's PROGRESS lines rise
    monotonically to 100% of its share; every epoch trains on all rows."""
    from mpips.data.files import resolve_paths, worker_files
    train, test = tiny_data
    out = tmp_path / "m.jsonl"
    proc = run_cmd(["-m", "mpips.train", "--train", train, "--test", test, "--batch-size", "128",
                    "--fc", "32,16", "--print-every", "1000", "--epochs", "2", "--shuffle",
                    "--shuffle-window", "1500", "--metrics-out", str(out)], n=4, timeout=300,
                   env={"MPIPS_DEBUG_PROGRESS_STEPS": "7"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = resolve_paths(train)
    for epoch in (0, 1):
        share = count_lines(worker_files(files, 2, 0, 0, epoch))     # seed 0, worker 0
        lines = [m for m in map(LINE.match, proc.stdout.splitlines())
                 if m and int(m.group(1)) == epoch]
        assert len(lines) >= share // 128 // 7, proc.stdout
        pcts = [int(m.group(3)) for m in lines]
        rows = [int(m.group(4).replace(",", "")) for m in lines]
        assert pcts == sorted(pcts) and pcts[-1] == 100 and pcts[-2] < 100, pcts
        assert rows == sorted(rows) and rows[-1] == share
        assert int(lines[-1].group(5).replace(",", "")) == share
        for m, r in zip(lines, rows):
            if not m.group(2):          # exact total: the percentage is its floor
                assert int(m.group(3)) == min(100 * r // share, 99) or r == share
    recs = [json.loads(x) for x in open(out)]
    assert [r["train_examples"] for r in recs] == [16000, 16000]


def test_progress_off(tiny_data):
    proc = run_cmd(["-m", "mpips.train", "--local", "--train", tiny_data[0], "--batch-size",
                    "512", "--fc", "16", "--max-steps", "5", "--progress-every", "0"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PROGRESS" not in proc.stdout and "EPOCH 0" in proc.stdout
