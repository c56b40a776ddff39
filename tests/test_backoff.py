"""mpips.comm.backoff.Backoff: the sleeps of every poll loop (doubling, ceiling, reset, busy-poll)."""
import pytest

from mpips.comm import backoff


@pytest.fixture
def slept(monkeypatch):
    out = []
    monkeypatch.setattr(backoff.time, "sleep", out.append)
    return out


def test_doubles_up_to_the_ceiling_and_resets(slept):
    b = backoff.Backoff(1e-5, 5e-4)
    for _ in range(8):
        b.sleep()
    assert slept == pytest.approx([1e-5, 2e-5, 4e-5, 8e-5, 1.6e-4, 3.2e-4, 5e-4, 5e-4])
    b.reset()
    b.sleep()
    assert slept[-1] == 1e-5


def test_constant_busy_poll_and_cap(slept):
    b = backoff.Backoff(*backoff.COLLECTIVE)
    b.sleep()
    b.sleep()
    assert slept == [1e-3, 1e-3]
    backoff.Backoff(1e-5, 0.0).sleep()           # --idle-sleep 0: never sleeps
    assert len(slept) == 2
    b = backoff.Backoff(*backoff.PASS)
    b.sleep(at_most=0.01)
    b.sleep(at_most=-1.0)                        # past the deadline: no negative sleep
    b.sleep()
    assert slept[2:] == [0.01, 0.0, 0.2]
