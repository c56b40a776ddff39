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


def mpiexec_path():
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


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
