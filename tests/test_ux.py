"""A new user's trip-ups (issue 23): resuming the other kind of checkpoint, a stream waiting
in silence, Ctrl-C under mpirun, malformed lines in the Predictor, help texts, typos."""
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import MPI_ENV, ROOT, mpiexec_path, run_cmd

SMALL = ["--fc", "16", "--batch-size", "128", "--print-every", "100000"]


@pytest.fixture(scope="module")
def tiny_stream(tmp_path_factory):
    from data_prep.stream_synth import generate_stream
    out = tmp_path_factory.mktemp("tiny_stream")
    generate_stream(str(out), days=1, hours=2, rows_per_pass=300, parts=2, seed=1)
    return str(out)


# ---------------------------------------------------------------- stream <-> batch resume
def _manifest(stream):
    meta = {"pass": "20261129/01", "epoch": -1} if stream else {"epoch": 0, "complete": True}
    return {"meta": meta, "seq": 1}


def _cfg(**kw):
    from mpips.config import Config
    return Config(**kw)


def test_check_kind_refuses_the_other_kind_unless_named(tmp_path):
    from mpips.checkpoint import CheckpointError
    from mpips.checkpoint.compat import check_kind
    path = str(tmp_path / "ck" / "ckpt-000001-full")
    # a stream finding a batch checkpoint in its own --save-dir
    stream = _cfg(stream="s", save_dir=str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match=r"holds .*ckpt-000001-full \(after epoch 0\), a "
                       r"batch \(non-stream\) run's checkpoint, and this is a stream run; give "
                       r"this run its own --save-dir, or .* --resume .*ckpt-000001-full"):
        check_kind(stream, path, _manifest(False))
    check_kind(stream, path, _manifest(True))                       # its own kind: fine
    # a batch run given a root whose newest checkpoint is a stream's
    batch = _cfg(resume=str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match=r"newest checkpoint is .* \(after pass "
                       r"20261129/01\), a stream run's checkpoint, and this is a batch run"):
        check_kind(batch, path, _manifest(True))
    check_kind(batch, path, _manifest(False))
    # named in --resume: a warm start on purpose, in both directions
    check_kind(_cfg(resume=path), path, _manifest(True))
    check_kind(_cfg(stream="s", resume=path + "/"), path, _manifest(False))


def test_stream_after_batch_in_one_dir_refused_then_named_resumes(tiny_data, tiny_stream,
                                                                   tmp_path):
    """The README's old trip-up: a batch run and then a stream run with the same --save-dir.
    The stream refuses (one line, the fix, exit 2); named in --resume it starts from the
    batch tables, and under mpirun the first worker says so (RESUME); after the last pass
    it says what it waits for and until when, then that it finishes."""
    ck = tmp_path / "ck"
    proc = run_cmd(["-m", "mpips.train", "--local", "--train", tiny_data[0], "--max-steps", "2",
                    "--save-dir", str(ck)] + SMALL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (saved,) = os.listdir(ck)
    proc = run_cmd(["-m", "mpips.train", "--stream", tiny_stream, "--save-dir", str(ck)] + SMALL,
                   n=2)
    assert proc.returncode == 2
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and "a batch (non-stream) run's checkpoint" in err[0], proc.stderr
    assert f"--resume {ck / saved}" in err[0] and "Traceback" not in proc.stderr
    proc = run_cmd(["-m", "mpips.train", "--stream", tiny_stream, "--save-dir", str(ck),
                    "--resume", str(ck / saved), "--stream-timeout", "0.5"] + SMALL, n=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.splitlines()
    assert [x for x in out if x.startswith("RESUME")] == [
        f"RESUME --> {ck / saved} (after epoch 0)"]
    assert sum(x.startswith("PASS ") for x in out) == 2
    waiting = [x for x in out if x.startswith("STREAM --> ")]
    assert len(waiting) == 2, out
    assert re.fullmatch(r"STREAM --> waiting for the pass after 20261129/01 \(a folder .*"
                        r"with a _SUCCESS file\) until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
                        r"\(--stream-timeout; \d+ s left\), then finishing", waiting[0])
    assert waiting[1].endswith("within --stream-timeout 0.5 s; finishing")
    assert out.index(waiting[0]) > max(i for i, x in enumerate(out) if x.startswith("PASS "))


def test_waiting_line_once_per_interval(tmp_path, monkeypatch):
    """No pass ready: one line on entering the wait, none more within WAIT_REPORT_EVERY,
    one when the timeout ends it; without a timeout, the one line saying why it ends."""
    from mpips.job import stream
    lines = []
    feed = stream.PassFeed(str(tmp_path), say=lines.append)
    assert feed.next(None, 0) is None
    assert lines == [f"STREAM --> no new pass in {tmp_path} (--stream-timeout 0: not "
                     "waiting); finishing"]
    lines.clear()
    assert feed.next(None, 0.3) is None
    assert len(lines) == 2 and "waiting for a first pass" in lines[0]
    assert "finishing" in lines[1]
    lines.clear()
    monkeypatch.setattr(stream, "WAIT_REPORT_EVERY", 0.0)          # a line at every look
    assert feed.next("20261129/00", 0.3) is None
    assert len(lines) >= 3 and all("after 20261129/00" in x for x in lines[:-1])
    lines.clear()
    assert feed.next("20261129/00", 0) is None
    assert lines == [f"STREAM --> no new pass after 20261129/00 in {tmp_path} "
                     "(--stream-timeout 0: not waiting); finishing"]


# ---------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("n", [None, 3], ids=["local", "mpiexec-3"])
def test_ctrl_c_one_line_exit_130_no_traceback(tiny_data, n):
    """SIGINT to the launcher's process group (what Ctrl-C in a terminal does) once
    training runs: the run stops at a step boundary (no --save-dir: nothing to save), exit
    code 130, one line on stderr, no traceback, no MPICH banner."""
    cmd = [sys.executable, "-m", "mpips.train", "--train", tiny_data[0], "--epochs", "100",
           "--fc", "16", "--batch-size", "64", "--print-every", "2"]
    if n:
        cmd = [mpiexec_path(), "-n", str(n)] + cmd
    else:
        cmd.append("--local")
    p = subprocess.Popen(cmd, cwd=str(ROOT), env=dict(os.environ, **MPI_ENV), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        for line in p.stdout:                   # training has started: a TRAIN line
            if line.startswith("TRAIN -->"):
                break
        else:
            pytest.fail(f"no TRAIN line; stderr: {p.stderr.read()[-2000:]}")
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "Traceback" not in err, err[-3000:]
    ours = [x for x in err.splitlines() if x.startswith("mpips:")]
    assert len(ours) == 1 and ours[0].startswith("mpips: stopped by SIGINT at epoch "), ours
    assert "nothing saved (no --save-dir" in ours[0], ours
    if not n:
        assert p.returncode == 130 and err.strip() == ours[0], (p.returncode, err[-3000:])
        return
    # Every rank exits 130 after meeting the others.  On a quiet machine they leave together
    # and mpiexec prints nothing else; on a loaded one the first rank to exit non-zero can make
    # Hydra kill a slower one (exit 9 and its BAD TERMINATION banner), so only the contract
    # holds there: a non-zero exit, our one line, no traceback.
    assert p.returncode != 0, err[-3000:]


# ---------------------------------------------------------------- --help and typos
def test_help_says_each_default_once_and_nothing_stale():
    from mpips.config import build_parser
    parser = build_parser()
    fmt = parser._get_formatter()
    for action in parser._actions:
        text = fmt._expand_help(action) if action.help else ""
        assert text.count("default") <= 1, text
        assert "(default: )" not in text and "(default: False)" not in text, text
    full = parser.format_help()
    assert "server optimizer" not in full          # dense weights live on the workers now
    assert "--save-every epochs" not in full       # --save-every is 'epoch' or N batches
    shuffle = next(a for a in parser._actions if "--shuffle" in a.option_strings)
    assert fmt._expand_help(shuffle).endswith("window (default: off, file order)")
    lr = next(a for a in parser._actions if "--lr" in a.option_strings)
    assert fmt._expand_help(lr).endswith("(default: 0.001)")


@pytest.mark.parametrize("argv,hint", [
    (["--shufle"], "unrecognized arguments: --shufle (did you mean --shuffle?) (see --help)"),
    (["--epoch", "2", "--batchsize=64"],
     "--batchsize=64 (did you mean --batch-size?) (see --help)"),
    (["--lr-scale", "2", "--stream-timout", "3"],
     "(--lr-scale: did you mean --dense-lr-scale?; --stream-timout: did you mean "
     "--stream-timeout?) (see --help)"),
])
def test_unknown_flag_one_line_did_you_mean(capsys, argv, hint):
    from mpips.config import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(hint + "\n"), err


def test_unknown_toml_key_did_you_mean(tmp_path):
    from mpips.config import parse_args
    path = tmp_path / "run.toml"
    for text, msg in (("epoch = 2\n", "unknown key 'epoch' (did you mean 'epochs'?)"),
                      ("batch-sise = 64\n", "unknown key 'batch-sise' (did you mean "
                                            "'batch-size'?)"),
                      ("zzz = 1\n", "unknown key 'zzz' (known: adagrad_init, batch_size, ")):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(msg)):
            parse_args(["--config", str(path)])
