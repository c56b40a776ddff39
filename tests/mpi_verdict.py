"""The verdict shared by the MPI scripts of tests/test_wire.py: failed checks are listed on
stderr per rank and counted; rank 0 prints the count per rank and exits with their sum."""
import sys
import traceback

import numpy as np
from mpi4py import MPI


def check(failures, cond, what, label):
    """Record `what` as failed unless `cond`; return bool(cond)."""
    if not cond:
        failures.append(what)
        print(f"{label} rank {MPI.COMM_WORLD.rank}: FAILED: {what}", file=sys.stderr,
              flush=True)
    return bool(cond)


def verdict(comm, failures, label, body):
    """Run body(); an exception is one failed check and aborts the job.  Rank 0 prints
    "<label>: failed checks per rank [...]" and returns their sum (the exit code)."""
    try:
        body()
    except Exception as e:  # noqa: BLE001 - reported through the exit code
        check(failures, False, f"{type(e).__name__}: {e} at "
              f"{traceback.extract_tb(e.__traceback__)[-1]}", label)
        comm.Abort(len(failures))
    counts = np.zeros(comm.size, np.int64) if comm.rank == 0 else None
    comm.Gather(np.array([len(failures)], np.int64), counts, root=0)
    if comm.rank == 0:
        print(f"{label}: failed checks per rank {counts.tolist()}", flush=True)
        return int(counts.sum())
    return 0
