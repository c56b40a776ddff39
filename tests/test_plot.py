"""python -m mpips.plot: PNGs of an epoch file and a stream file, runs overlaid, clear errors."""
import json

import pytest

matplotlib = pytest.importorskip("matplotlib")

from mpips import plot  # noqa: E402
from tests.conftest import run_cmd  # noqa: E402


def write(path, recs):
    with open(path, "w") as fh:
        for r in recs:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def epoch_recs(mode, auc0):
    return [{"epoch": e, "mode": mode, "train_examples": 1000, "train_seconds": 1.0,
             "examples_per_sec": 30000.0 + 100 * e, "train_loss": 0.5 - 0.01 * e,
             "train_auc": auc0 - 0.02 + 0.01 * e, "test_auc": auc0 + 0.01 * e,
             "test_logloss": 0.48 - 0.01 * e} for e in range(3)]


def stream_recs():
    return [{"epoch": i, "pass": f"20260101/{i:02d}", "mode": "async", "train_examples": 500,
             "examples_per_sec": 20000.0, "train_loss": 0.5, "test_auc": 0.6 + 0.02 * i,
             "table_rows": 1000 * (i + 1), "ids_admitted": 900 - 10 * i, "ids_waiting": 40,
             "ids_evicted": 5 * i} for i in range(5)]


def lines_of(ax):
    return {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}


def check_png(path, width, height):
    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (height, width)
    assert img.std() > 0.05           # something was drawn


def test_epoch_runs_overlaid(tmp_path):
    a = write(tmp_path / "async.jsonl", epoch_recs("async", 0.74))
    b = write(tmp_path / "sync.jsonl", epoch_recs("sync", 0.75))
    fig = plot.plot_epochs([(plot.run_label(p, plot.load_run(p), [a, b]), plot.load_run(p))
                            for p in (a, b)])
    auc, logloss, rate = (lines_of(ax) for ax in fig.axes)
    assert auc["sync (sync) test"] == [0.75, 0.76, 0.77]
    assert auc["async (async) train"] == pytest.approx([0.72, 0.73, 0.74])
    assert logloss["async (async) test"] == pytest.approx([0.48, 0.47, 0.46])
    assert rate["sync (sync)"] == [30000.0, 30100.0, 30200.0]
    out = tmp_path / "run.png"
    assert plot.main([a, b, "--out", str(out)]) == 0
    check_png(out, 12 * 80, round(3.4 * 80))
    assert plot.main([a, b, "--out", str(out), "--labels", "only-one"]) == 2


def test_stream_file_default_output(tmp_path):
    s = write(tmp_path / "stream.jsonl", stream_recs())
    fig = plot.plot_stream([("s", plot.load_run(s))])
    auc, rows, ids, _ = (lines_of(ax) for ax in fig.axes)
    assert auc["s"] == pytest.approx([0.6, 0.62, 0.64, 0.66, 0.68])
    assert rows["s"] == [1000, 2000, 3000, 4000, 5000]
    assert sorted(map(tuple, ids.values())) == sorted([(900, 890, 880, 870, 860), (40,) * 5,
                                                       (0, 5, 10, 15, 20)])
    proc = run_cmd(["-m", "mpips.plot", s], timeout=120)     # the command line, end to end
    assert proc.returncode == 0, proc.stderr
    check_png(tmp_path / "stream.png", 11 * 80, 6 * 80)


@pytest.mark.parametrize("content,msg", [
    ("", "no metrics records (empty file"),
    ('{"loss": 1}\n', ":1: not an mpips metrics record"),
    ("epoch,auc\n0,0.7\n", ":1: not a JSON line"),
    ('{"epoch": 0, "train_examples": 5}\n{"epoch": 0, "train_examples": 5, "pass": "x"}\n',
     "mixes epoch and stream records"),
])
def test_bad_files_fail_clearly(tmp_path, capsys, content, msg):
    path = tmp_path / "m.jsonl"
    path.write_text(content)
    assert plot.main([str(path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpips.plot: error: {path}") and msg in err
    assert not (tmp_path / "x.png").exists()


def test_epoch_and_stream_not_overlaid(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", epoch_recs("async", 0.7))
    s = write(tmp_path / "s.jsonl", stream_recs())
    assert plot.main([a, s]) == 2
    assert "cannot overlay epoch runs and stream runs" in capsys.readouterr().err


def test_missing_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    a = write(tmp_path / "a.jsonl", epoch_recs("async", 0.7))
    monkeypatch.setattr(plot, "plt", None)
    assert plot.main([a]) == 2
    assert "needs matplotlib: pip install 'mpips[plot]'" in capsys.readouterr().err
