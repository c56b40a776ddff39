"""Run ``python -m mpips.train`` with a fault inside the disk tier's write-back (a test aid).

    python tests/tier_fault_driver.py N REPORT.npz ... (any mpips.train flags, with --table-memory)

The N-th write-back of rows moved out of the cache (``TieredTable._move_out`` returning more
than one row) is cut short: half of its rows are put into an LMDB write transaction that
is never committed, and the process SIGKILLs itself inside it.  Just before, the store's
committed rows (a scan: every field of every row, in id order) and its folder are saved
to REPORT.npz, so that the test can check the folder the kill left holds exactly the last
committed state (tests/test_tiered_e2e.py).
"""
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpips.tables import tiered  # noqa: E402


def kill_inside(store, rows, report):
    parts = list(store.scan(1 << 16))
    committed = {f: np.concatenate([p[f] for p in parts]) for f in parts[0]} if parts else {}
    np.savez(report, path=store.path, **committed)
    keys, vals = store._encode(rows)
    half = len(keys) // 2
    txn = store.env.begin(write=True)
    txn.cursor().putmulti(zip(keys[:half], vals[:half]), overwrite=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    at, report = int(sys.argv[1]), sys.argv[2]
    sys.argv = [sys.argv[0]] + sys.argv[3:]
    move_out, seen = tiered.TieredTable._move_out, [0]

    def faulty(self, room):
        out = move_out(self, room)
        if out is not None and len(out["keys"]) > 1:
            seen[0] += 1
            if seen[0] == at:
                kill_inside(self.store, out, report)
        return out
    tiered.TieredTable._move_out = faulty
    from mpips.train import main as train
    return train()


if __name__ == "__main__":
    sys.exit(main())
