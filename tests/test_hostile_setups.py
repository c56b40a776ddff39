"""Issue 33: a hanging pipe, a full disk, no label, a huge schema, a lost server's name,
and the messages for a corrupt .gz and a FIFO.  (Absurd dense state and a refused request
id are scenarios D6 and D8 of tests/mpi_wire_audit.py, run by tests/test_wire.py.)

Each case ends with one line naming the file, path or rank, and a non-zero exit (or a
refusal), within its timeout plus a bound; no process is left behind.
"""
import dataclasses
import gzip
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpips.data import sources
from mpips.data.files import resolve_paths
from mpips.data.reader import DataReader
from mpips.schema import Schema, SchemaError, SparseGroup, validate
from tests.conftest import MPI_ENV, ROOT, run_cmd

PIPE_TIMEOUT = 2
SLACK = 60          # s a failure may take beyond its timeout: start-up and warm-up (numba
                    # loads or compiles: 2-22 s on the shared 2-core machine)


def marker_cmd(tmp_path, script):
    """A pipe command whose processes can be found by a unique number in their command
    lines (sleep's argument: ``exec`` keeps no other trace)."""
    word = str(10 ** 9 + os.getpid() * 100 + len(os.listdir(tmp_path)))
    return word, script.replace("WORD", word)


def processes_with(word):
    """PIDs whose command line holds ``word`` (not this process)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if word.encode() in f.read() and int(pid) != os.getpid():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def gone(word, within=10.0):
    """True once no process holds ``word`` (bounded: a killed group is reaped by init)."""
    deadline = time.monotonic() + within
    while processes_with(word):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------- 1. a hanging pipe
@pytest.mark.parametrize("script, said", [
    ("exec sleep WORD", "sent nothing for 2 s (--pipe-timeout)"),
    ("cat; exec >&-; sleep WORD", "closed its output but did not exit within 2 s"),
])
def test_silent_pipe_fails_the_read_naming_file_and_command(tiny_data, tmp_path, script, said):
    word, cmd = marker_cmd(tmp_path, script)
    files = resolve_paths(tiny_data[0])[:2]
    schema = dataclasses.replace(Schema.criteo(), pipe_command=cmd)
    warm = dataclasses.replace(Schema.criteo(), pipe_command="cat")
    for _ in DataReader(files[:1], 256, schema=warm):
        pass                    # the parser's kernels for piped input loaded: not in the timing
    t0 = time.monotonic()
    with pytest.raises(sources.PipeError) as err:
        for _ in DataReader(files, 256, schema=schema, pipe_timeout=PIPE_TIMEOUT):
            pass
    took = time.monotonic() - t0
    line = str(err.value)
    assert "\n" not in line and line.startswith(files[0] + ":") and cmd in line and said in line
    assert took < PIPE_TIMEOUT + 20, took       # a bound, not a speed: a hang never ends
    assert gone(word), processes_with(word)     # this file's and the next ones' (ahead)


def test_pipe_groups_die_with_mpips_however_it_ends(tmp_path):
    """SIGKILL, SIGTERM and a normal exit of the reading process: its commands' groups are
    killed (the guard process; a shell's child holds the pipe too)."""
    data = tmp_path / "part.txt"
    data.write_text("1\t" + "\t" * 38 + "\n")
    for how in ("kill", "term", "exit"):
        word, cmd = marker_cmd(tmp_path, "sleep WORD & sleep WORD")
        (tmp_path / how).mkdir()
        code = ("import os, signal, sys\n"
                "from mpips.data import sources\n"
                f"r = sources.PipeRunner({cmd!r}, [{str(data)!r}])\n"
                f"s = r.open({str(data)!r})\n"
                "print(s.proc.pid, flush=True)\n"
                f"how = {how!r}\n"
                "if how == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
                "if how == 'term': os.kill(os.getpid(), signal.SIGTERM)\n"
                "sys.exit(3)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, **MPI_ENV), cwd=str(ROOT))
        assert proc.returncode in (-signal.SIGKILL, -signal.SIGTERM, 3), proc.stderr
        assert proc.stdout.strip().isdigit(), proc.stderr
        assert gone(word), (how, processes_with(word))


@pytest.mark.parametrize("script", ["exec sleep WORD",            # warm-up: rank 0
                                    "head -n 1500; exec sleep WORD"])  # the workers
def test_hanging_pipe_under_mpirun_fails_the_job(tiny_data, tmp_path, script):
    word, cmd = marker_cmd(tmp_path, script)
    t0 = time.monotonic()
    proc = run_cmd(["-m", "mpips.train", "--train", tiny_data[0], "--test", tiny_data[1],
                    "--fc", "16", "--epochs", "1", "--peer-timeout", "5", "--pipe-command", cmd,
                    "--pipe-timeout", str(PIPE_TIMEOUT)], n=4, timeout=PIPE_TIMEOUT + 5 + SLACK)
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < PIPE_TIMEOUT + 5 + SLACK, (took, proc.stderr[-2000:])
    lines = [x for x in proc.stderr.splitlines() if "PipeError" in x]
    assert lines and all(re.search(r"^mpips: rank \d: PipeError: \S+part-\d+\.txt: "
                                   r"--pipe-command .* sent nothing for 2 s", x) for x in lines)
    assert gone(word), processes_with(word)


def test_worker_waiting_on_its_pipe_answers_the_status_dump(tiny_data, tmp_path):
    """--pipe-timeout above --peer-timeout: the servers time out first, and their dump
    shows each worker waiting for its pipe's file (not NO ANSWER)."""
    word, cmd = marker_cmd(tmp_path, "head -n 1500; exec sleep WORD")
    proc = run_cmd(["-m", "mpips.train", "--train", tiny_data[0], "--fc", "16", "--epochs", "1",
                    "--peer-timeout", "3", "--pipe-command", cmd, "--pipe-timeout", "60"],
                   n=4, timeout=3 + 5 + SLACK)
    assert proc.returncode != 0 and "PeerTimeout" in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"rank [23] \(worker [01]\): reading data: waiting for the next batch of "
                     r"\S+part-\d+\.txt \(its --pipe-command\) \[for \d", proc.stderr)
    assert "NO ANSWER" not in proc.stderr
    assert gone(word), processes_with(word)


def test_hanging_pipe_local_cli(tiny_data, tmp_path):
    word, cmd = marker_cmd(tmp_path, "cat; exec >&-; sleep WORD")
    t0 = time.monotonic()
    proc = run_cmd(["-m", "mpips.train", "--local", "--train", tiny_data[0], "--fc", "16",
                    "--epochs", "1", "--pipe-command", cmd, "--pipe-timeout",
                    str(PIPE_TIMEOUT)], timeout=PIPE_TIMEOUT + SLACK)
    assert proc.returncode == 1 and time.monotonic() - t0 < PIPE_TIMEOUT + SLACK
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mpips: local: PipeError: ") and "closed its output" in last
    assert gone(word), processes_with(word)


def test_pipe_timeout_defaults_below_the_peer_timeout(tiny_data, tmp_path):
    """Without --pipe-timeout a hanging pipe fails after 3/4 of --peer-timeout when that is
    under 90 s (the pipe's line, naming file and command, before the servers' timeout)."""
    from mpips.config import Config, pipe_timeout
    assert pipe_timeout(Config()) == 90.0 and pipe_timeout(Config(peer_timeout=4)) == 3.0
    assert pipe_timeout(Config(peer_timeout=4, pipe_timeout=10)) == 10.0
    word, cmd = marker_cmd(tmp_path, "exec sleep WORD")
    t0 = time.monotonic()
    proc = run_cmd(["-m", "mpips.train", "--local", "--train", tiny_data[0], "--fc", "16",
                    "--epochs", "1", "--peer-timeout", "4", "--pipe-command", cmd],
                   timeout=3 + SLACK)
    assert proc.returncode == 1 and time.monotonic() - t0 < 3 + SLACK
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mpips: local: PipeError: ") and "sent nothing for 3 s" in last, last
    assert gone(word), processes_with(word)


# ---------------------------------------------------------------- 2. a full disk
SAVE_IN_A_SMALL_FILE_LIMIT = """
import resource, sys
import numpy as np
from mpips import checkpoint as ck
from mpips.tables.dense import DenseTable
from mpips.tables.optim import OptimizerConfig
from mpips.tables.sparse import SparseTable
opt = OptimizerConfig("adam")
sparse = SparseTable(8, opt, seed=1)
sparse.pull(np.arange(1, 20001, dtype=np.int64), np.zeros((20000, 8), np.float32))
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))   # the shard needs ~2.5 MB
d = ck.new_checkpoint_dir(sys.argv[1], "full")
try:
    ck.save_shard(d, 0, 1, sparse, DenseTable(np.zeros(50, np.float32), opt), 0, "full")
except OSError as e:
    print(e)
    sys.exit(1)
"""


def test_failed_shard_write_leaves_no_tmp_and_says_path_and_errno(tmp_path):
    """A file-size limit (any user; Python ignores SIGXFSZ) refuses the space the shard
    reserves before HDF5 writes: one line, exit 1, not a signal, nothing left behind."""
    proc = subprocess.run([sys.executable, "-c", SAVE_IN_A_SMALL_FILE_LIMIT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **MPI_ENV), cwd=str(ROOT))
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    line = proc.stdout.strip()
    assert "\n" not in line and "shard-00000-of-00001.h5.tmp: writing the checkpoint shard " \
        "failed: [Errno 27] File too large" in line and "last committed checkpoint is kept" in line
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == []


@pytest.fixture(scope="module")
def audit_data(tmp_path_factory):
    """The audit's set: 8000 rows in 2 parts (a checkpoint of it is 1.2 MB)."""
    from data_prep.synth import generate
    out = tmp_path_factory.mktemp("audit")
    generate(str(out), rows=8000, parts=2, seed=3, test_rows=2000)
    return str(out / "train")


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (needs root: skipped otherwise)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                                            str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("ranks", [None, 4])
def test_full_disk_keeps_the_last_checkpoint_and_exits_with_one_line(audit_data, small_disk,
                                                                     ranks):
    """The audit's case (exit 139 locally before): a 2 MB disk holds one checkpoint."""
    args = ["-m", "mpips.train", "--train", audit_data, "--fc", "16", "--epochs", "3",
            "--save-dir", str(small_disk / "ck"), "--peer-timeout", "10"]
    proc = run_cmd(args + (["--local"] if ranks is None else []), n=ranks, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    line = [x for x in proc.stderr.splitlines() if "OSError" in x]
    assert line and all(re.search(r"shard-0000\d-of-0000\d\.h5\.tmp: writing the checkpoint "
                                  r"shard failed: \[Errno 28\] No space left", x)
                        for x in line), proc.stderr[-2000:]     # one line per server that failed
    files = [os.path.join(d, f) for d, _, fs in os.walk(small_disk) for f in fs]
    assert not [f for f in files if f.endswith(".tmp")], files
    from mpips import checkpoint as ck
    newest = ck.resolve(str(small_disk / "ck"))
    assert newest.endswith("ckpt-000001-full") and ck.read_manifest(newest)["meta"]["epoch"] == 0


# ---------------------------------------------------------------- 3. no label
def test_training_without_a_label_is_refused_at_start(tmp_path):
    from mpips.config import parse_args
    from mpips.train import precheck
    toml = tmp_path / "s.toml"
    toml.write_text('format = "csv"\nlabel = ""\n[[sparse]]\nnames = ["a", "b"]\n')
    with pytest.raises(ValueError, match=r's.toml: label = "" \(no label\): training needs'):
        precheck(parse_args(["--schema", str(toml), "--train", str(tmp_path)]))


def test_a_label_column_missing_from_the_data_is_an_error(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("a,b\n1,2\n3,4\n")
    schema = Schema(format="csv", label="click", delimiter=",", header=True,
                    sparse=(SparseGroup(("a", "b")),))
    with pytest.raises(ValueError, match=r"d.csv: the header has no column \['click'\]"):
        list(DataReader([str(data)], 2, schema=schema))


# ---------------------------------------------------------------- 4. a huge schema
def test_schema_validation_is_linear():
    """200,000 names, each listed in fields too (multislot): was names.count per name."""
    names = tuple(f"s{i}" for i in range(200_000))
    s = Schema(format="multislot", label="click", fields=("click",) + names,
               sparse=(SparseGroup(names),))
    t0 = time.perf_counter()
    validate(s)
    assert time.perf_counter() - t0 < 5.0
    dup = dataclasses.replace(s, sparse=(SparseGroup(names + ("s7",)),))
    with pytest.raises(SchemaError, match=r"\['s7'\] declared more than once"):
        validate(dup)


# ---------------------------------------------------------------- messages
def test_corrupt_or_truncated_gzip_names_the_file(tmp_path):
    text = b"".join(b"%d\t" % (i % 2) + b"1\t" * 12 + b"a\t" * 25 + b"b\n" for i in range(3000))
    whole = gzip.compress(text)
    cut, flipped = tmp_path / "cut.gz", tmp_path / "crc.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    flipped.write_bytes(whole[:-8] + bytes([whole[-8] ^ 1]) + whole[-7:])
    for path, why in ((cut, "EOFError"), (flipped, "BadGzipFile")):
        with pytest.raises(sources.GzipError, match=rf"^{re.escape(str(path))}: a corrupt or "
                           rf"truncated gzip file \({why}"):
            list(DataReader([str(path)], 64))


def test_fifo_as_data_is_named_as_a_fifo(tmp_path):
    fifo = tmp_path / "train.fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileNotFoundError, match=r"a named pipe \(FIFO\), not a regular file"):
        resolve_paths(str(fifo))


def test_symlink_loop_and_broken_link_as_data_are_named(tmp_path):
    a, b, broken = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    a.symlink_to(b)
    b.symlink_to(a)
    broken.symlink_to(tmp_path / "gone.txt")
    with pytest.raises(FileNotFoundError, match=r"a\.txt.*: a symbolic link loop \("):
        resolve_paths(str(a))
    with pytest.raises(FileNotFoundError, match=r"c\.txt.*: a broken symbolic link \(to "
                       r".*gone\.txt"):
        resolve_paths(str(broken))
    with pytest.raises(FileNotFoundError, match=r"no such file, directory or glob match"):
        resolve_paths(str(tmp_path / "none.txt"))


def test_no_writable_numba_cache_folder_compiles_without_it_in_one_line(tmp_path):
    """numba can write its cache nowhere (here: only NUMBA_CACHE_DIR is tried, and it is
    below a file): the kernels import and run uncached after one line, no traceback."""
    (tmp_path / "file").write_text("")
    env = dict(os.environ, NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator",
               NUMBA_CACHE_DIR=str(tmp_path / "file" / "cache"))
    code = ("import numpy as np; from mpips.kernels.pages import *; import mpips.kernels as k; "
            "from mpips.data.files import resolve_paths; print('cache off', k.CACHE_OFF_NOW)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=str(ROOT), timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stdout.strip() == "cache off True"
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpips: warning: numba finds no folder"), lines
    assert "NUMBA_CACHE_DIR a writable folder" in lines[0]


LOST_SERVER = """
import numpy as np
from mpi4py import MPI
from mpips.worker.client import Handle
st = [MPI.Status(), MPI.Status()]
st[0].Set_error(MPI.SUCCESS)
st[1].Set_error(MPI.ERR_OTHER)
h = Handle(None, [], [0, 1], [], "PULL", 7)
print(h._failure(MPI.Exception(MPI.ERR_IN_STATUS), st))
st[1].Set_error(MPI.ERR_TRUNCATE)
print(h._failure(MPI.Exception(MPI.ERR_IN_STATUS), st))
"""


def test_a_failed_request_names_only_its_server():
    """The statuses say which server's request failed (the audit saw both servers named
    after one was killed)."""
    proc = subprocess.run([sys.executable, "-c", LOST_SERVER], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, **MPI_ENV), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lost, cut = proc.stdout.strip().splitlines()
    assert lost.startswith("PULL step 7: MPI could not complete the request(s) of server "
                           "rank(s) [1] (")
    assert cut.startswith("PULL step 7: a reply from server rank(s) [1] does not fit")
