"""What the benchmark scripts share: the repo root on sys.path, the rank environment, mpiexec."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# every rank single-threaded: 4 ranks share 2 cores
ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT)}


def mpiexec():
    """The venv's mpiexec (PyPI MPICH) if there is one, else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"
