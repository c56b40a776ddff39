"""Hostile wire input: crafted malformed requests against a real server (mpiexec -n 3).

The MPI side is tests/mpi_wire_probe.py (its docstring lists the checks); here we start it
under a subprocess timeout and check its verdict and the server's rejection lines.
"""
import re

from tests.conftest import run_cmd


def test_server_rejects_bad_requests_names_sender_and_keeps_serving():
    proc = run_cmd(["-m", "tests.mpi_wire_probe"], n=3, timeout=90)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "failed checks per rank [0, 0, 0]" in proc.stdout
    n_bad = int(re.search(r"wire probe: (\d+) bad messages", proc.stdout).group(1))
    assert n_bad >= 20
    lines = [x for x in proc.stderr.splitlines() if "rejected malformed request" in x]
    # one line per bad request, each naming the sender; the stranger's too
    assert len(lines) == n_bad + 1, proc.stderr[-3000:]
    senders = sorted(int(re.search(r"request from rank (\d+)", x).group(1)) for x in lines)
    assert senders == [1] * n_bad + [2]
    assert any("not a worker of this job" in x for x in lines)
    for reason in ("unknown op code 99", "unknown table 3", "bad sizes count=-3",
                   "dim=-1", "header says", "is not a valid message", "non-finite",
                   "rows of width 3", "dense slice of 9", "no --save-dir"):
        assert any(reason in x for x in lines), reason
    assert "Traceback" not in proc.stderr
