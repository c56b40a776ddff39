"""Shared fixtures: a tiny synthetic dataset, and a helper that runs mpiexec in a subprocess."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPI_ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}


def pytest_configure(config):
    """Byte-compile the package once, in the controller, before any test starts a process.

    Where PYTHONDONTWRITEBYTECODE is set (as on our CI machines), no run writes a .pyc, so
    every python process a test starts (hundreds, several ranks each) compiled each of
    mpips' ~100 modules from source again: ~0.1-0.2 CPU-s a process. Reading a .pyc is
    allowed under that setting; py_compile writes regardless of it."""
    if hasattr(config, "workerinput"):          # an xdist worker: the controller did it
        return
    import compileall
    for d in ("mpips", "data_prep", "tests"):
        compileall.compile_dir(str(ROOT / d), quiet=2)


def mpiexec_path():
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def jsonl_records(path):
    """The records of a JSON-lines file another process may be appending to: whole lines only.

    A record's one write() that crosses a page boundary becomes visible a page at a time, so a
    reader polling a running job's --metrics-out can meet the first part of a line; that
    line is not read until its newline is there."""
    path = Path(path)
    if not path.exists():
        return []
    import json
    return [json.loads(x) for x in path.read_text().splitlines(keepends=True)
            if x.endswith("\n") and x.strip()]


def run_cmd(args, timeout=240, n=None, env=None):
    """Run `python -m ...args` (under mpiexec -n n if n) and return CompletedProcess."""
    cmd = [sys.executable] + list(args)
    if n:
        exe = mpiexec_path()
        if exe is None:
            pytest.fail("mpiexec not found: install the test extras (pip install -e '.[mpich,test]')")
        cmd = [exe, "-n", str(n)] + cmd
    full_env = dict(os.environ, **MPI_ENV, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=str(ROOT), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """(train_dir, test_dir) of a small synthetic Criteo-format set (8 train parts)."""
    from data_prep.synth import generate
    out = tmp_path_factory.mktemp("tiny")
    generate(str(out), rows=16000, parts=8, seed=3, test_rows=4000)
    return str(out / "train"), str(out / "test")


# --- the suite's parts: `pytest -m unit` (in-process, seconds), `-m e2e` (starts python
# processes), `-m mpi` (starts mpiexec).  A file's part is read from its text, so a new test
# file is placed without a list to keep: a file that starts mpiexec anywhere is `mpi`, one
# that starts other processes `e2e`, the rest `unit`.
# ("n=n": a helper given its rank count, as tests/test_resume.py calls test_modes.train; read as
# in-process, that 60 s file ran last and left the other worker idle)
_SPAWNS_MPI = ("mpiexec", "mpirun", "n=2", "n=3", "n=4", "n=5", "n=6", "n=8", "n=n", "srun",
               "sbatch")
_SPAWNS = ("run_cmd(", "subprocess", "Popen", "os.fork", "multiprocessing")
_PART = {}


def suite_part(path):
    """'mpi', 'e2e' or 'unit' for the test file at ``path``."""
    if path not in _PART:
        text = Path(path).read_text(encoding="utf-8")
        _PART[path] = ("mpi" if any(s in text for s in _SPAWNS_MPI) else
                       "e2e" if any(s in text for s in _SPAWNS) else "unit")
    return _PART[path]


_FIRST = {"mpi": 0, "e2e": 1, "unit": 2}


def pytest_collection_modifyitems(config, items):
    """Mark each test with its file's part, and order the files for the two xdist workers
    (setup.cfg: --dist loadfile --no-loadscope-reorder: whole files, in this order, each to
    the worker that runs out first): the files that start processes first, those of a Slurm
    cluster first of all (minutes of sbatch jobs), then the rest, each part by its number of
    tests; in-process files, seconds each, last, to fill in at the end. A long file started
    last leaves one core idle while it runs (xdist's own order, by test count, put the
    Slurm file, 7 tests and 90-130 s, near the end). Within a file the order is unchanged."""
    tests, slurm = {}, {}
    for item in items:
        path = str(item.fspath)
        item.add_marker(getattr(pytest.mark, suite_part(path)))
        tests[path] = tests.get(path, 0) + 1
        if path not in slurm:
            slurm[path] = "sbatch" in Path(path).read_text(encoding="utf-8")
    items.sort(key=lambda it: (_FIRST[suite_part(str(it.fspath))], not slurm[str(it.fspath)],
                               -tests[str(it.fspath)], str(it.fspath)))
