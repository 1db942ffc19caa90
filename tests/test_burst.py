"""BurstGate (engine/burst.py) on an injected clock: from idle, the first step waits until no request has
arrived for `quiet` seconds, at most `cap` after the first; nothing else waits."""

from __future__ import annotations

from kvserve.engine.burst import BurstGate


def test_a_first_step_after_idle_waits_for_the_burst_to_go_quiet():
    gate = BurstGate(quiet=0.003, cap=0.024)
    assert not gate.holding(0.0)
    gate.arrival(10.0, idle=True)
    assert gate.holding(10.001) and gate.deadline() == 10.003
    gate.arrival(10.002, idle=False)  # a second request within the quiet time: the wait starts again
    assert gate.holding(10.004) and gate.deadline() == 10.005
    assert not gate.holding(10.005)  # quiet for 3 ms: the step goes
    assert not gate.holding(10.0051)  # and the gate stays open


def test_a_steady_stream_of_arrivals_waits_no_longer_than_the_cap():
    gate = BurstGate(quiet=0.003, cap=0.024)
    gate.arrival(0.0, idle=True)
    t = 0.0
    while gate.holding(t):
        t += 0.001
        gate.arrival(t, idle=False)
    assert abs(t - 0.024) < 1e-9


def test_arrivals_while_busy_never_wait_and_zero_turns_it_off():
    gate = BurstGate(quiet=0.003, cap=0.024)
    gate.arrival(5.0, idle=False)  # others queued or running: the request joins their next step
    assert not gate.holding(5.0)
    off = BurstGate(quiet=0.0, cap=0.0)
    off.arrival(1.0, idle=True)
    assert not off.holding(1.0)
