"""Hostile wire input: crafted and fuzzed (hypothesis) requests against real servers (mpiexec -n 5).

The MPI side is tests/mpi_wire_probe.py (its docstring lists the checks); here we start it
under a subprocess timeout and check its verdict and the servers' rejection lines.
"""
import os
import re

from tests.conftest import run_cmd

N_FUZZ = int(os.environ.get("MPIPS_FUZZ_CASES", "2000"))   # more for a longer local run


def test_servers_reject_bad_requests_name_sender_and_keep_serving(tmp_path):
    proc = run_cmd(["-m", "tests.mpi_wire_probe", str(tmp_path), str(N_FUZZ)], n=5, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "failed checks per rank [0, 0, 0, 0, 0]" in proc.stdout
    m = re.search(r"(\d+) crafted bad messages, rejected per server \[(\d+), (\d+), (\d+)\]; "
                  r"fuzz: (\d+) cases, rejected (\d+)", proc.stdout)
    n_bad, per_server, n_fuzz, fuzz_rejected = int(m[1]), [int(m[i]) for i in (2, 3, 4)], \
        int(m[5]), int(m[6])
    assert sum(per_server) == n_bad >= 45 and min(per_server) >= 9
    assert n_fuzz >= N_FUZZ * 0.9 and n_fuzz * 0.2 < fuzz_rejected < n_fuzz * 0.8   # both kinds
    lines = [x for x in proc.stderr.splitlines() if "rejected malformed request" in x]
    # one line per rejected request (up to 100 per server), each naming the sender
    # by pattern, not by line: mpiexec may splice one rank's line into another's
    total = {int(r): int(n) for r, n in
             re.findall(r"wire probe server (\d+): rejected (\d+)", proc.stdout)}
    assert len(total) == 3, proc.stdout
    assert sum(min(n, 100) for n in total.values()) == len(lines), proc.stderr[-3000:]
    assert sum(total.values()) == n_bad + fuzz_rejected + 3      # + the outsider's, per server
    senders = [int(re.search(r"request from rank (\d+)", x).group(1)) for x in lines]
    assert set(senders) == {3, 4}
    assert sum(1 for x in lines if "not a worker of this job" in x) == 3
    for reason in ("unknown op code 99", "unknown table 3", "bad sizes count=-3",
                   "dim=-1", "header says", "is not a valid message", "non-finite",
                   "rows of width 3", "dense slice of 9", "no --save-dir",
                   "mode flag 3", "mode flag -1", "not an uncommitted checkpoint directory",
                   "threshold -1", "occurrence counts", "the phase collects step 1",
                   "would wait for good", "wait for itself", "steps are >= 0"):
        assert any(reason in x for x in lines), reason
    assert "Traceback" not in proc.stderr


def test_audit_requests_are_refused_with_one_line_and_valid_ones_still_served(tmp_path):
    """Issue 23 D1-D7 and issue 33's absurd dense state (D6) and refused request id (D8)
    (tests/mpi_wire_audit.py has the scenarios and their numpy references)."""
    proc = run_cmd(["-m", "tests.mpi_wire_audit", str(tmp_path)], n=4, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "wire audit: failed checks per rank [0, 0, 0, 0]" in proc.stdout
    counts = {int(m[1]): tuple(map(int, m.groups()[1:])) for m in re.finditer(
        r"wire audit server (\d): rejected (\d+) duplicates (\d+) ignored (\d+)", proc.stdout)}
    assert counts == {0: (14, 2, 2), 1: (13, 0, 1)}, proc.stdout
    err = proc.stderr.splitlines()
    refused = [x for x in err if "rejected malformed request" in x]
    assert len(refused) == 27 and all(re.search(r"request from rank [23]: ", x) for x in refused)
    for reason in ("over the largest request", "this server does not own", "PULL for step 0 twice",
                   "(id 3 listed 20000 times), beyond 1e+15", "after this worker's BARRIER",
                   "FINISH with 1 of its requests still held", "SAVE for checkpoint 1 twice",
                   "'v' must be >= 0", "'beta1_pow' must be beta ** t", "'accum' must be >= 0",
                   "'m' must be <= 1e+15", "'values' must be <= 1e+06", "out of reach of v",
                   "beta powers of different steps", "is not 0.9 ** t for a whole step"):
        assert sum(reason in x for x in refused) >= 1, reason
    dups = [x for x in err if "dropped a duplicate request from rank 2" in x]
    assert len(dups) == 2 and "PULL" in dups[0] and "SAVE" in dups[1]
    ignored = [x for x in err if "ignored a message of" in x]
    assert len(ignored) == 5 and all("from rank 2 on tag" in x for x in ignored)
    assert sum("(audit worker B): ignored" in x for x in ignored) == 2
    assert "Traceback" not in proc.stderr
