"""The busy-poll gate: which waits poll, from how long waits of each kind lasted; and
the whole poll / sleep / hand-off decision of a waiting thread (``plan_wait``), as a
table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jdist.rpc import _pollgate as G
from jdist.rpc._agent import co_located

WINDOW = 200e-6  # busy_poll_us=200


def test_a_kind_whose_message_comes_late_stops_polling_and_others_do_not():
    gate = G.PollGate(WINDOW)
    assert gate.limit == G.WINDOWS * WINDOW
    assert gate.should(("reply", 1, "forward"))  # never seen: polls
    gate.record(("reply", 1, "forward"), 1.4e-3)  # a parameter server's forward
    assert not gate.should(("reply", 1, "forward"))
    for _ in range(50):
        gate.record(("reply", 1, "release"), 80e-6)
    assert gate.should(("reply", 1, "release"))
    assert gate.should(("reply", 2, "forward"))  # another peer: its own kind


def test_a_kind_that_speeds_up_polls_again_and_one_stall_does_not_silence_it():
    gate = G.PollGate(WINDOW)
    kind = ("next", 3, "step")
    for _ in range(50):
        gate.record(kind, 5e-3)  # slow: no polls
    assert not gate.should(kind)
    waits = 0
    while not gate.should(kind):  # fast again (measured without polling too)
        gate.record(kind, 150e-6)
        waits += 1
    assert waits <= 20  # the stall cap bounds how long a slow past counts
    for _ in range(50):
        gate.record(kind, 100e-6)
    gate.record(kind, 10.0)  # one 10 s stall (capped): polling resumes within a few waits
    assert gate.average(kind) <= 100e-6 + G.WEIGHT * 4 * gate.limit + 1e-12
    n = 0
    while not gate.should(kind):
        gate.record(kind, 100e-6)
        n += 1
    assert n <= 8


def test_a_gate_without_a_longer_poll_polls_one_window_or_not_at_all():
    gate = G.PollGate(WINDOW)
    assert gate.longest == WINDOW and gate.poll_for("new") == WINDOW
    for wait, polls in ((50e-6, WINDOW), (550e-6, WINDOW), (650e-6, 0.0)):
        gate.record(wait, wait)
        assert gate.poll_for(wait) == polls


def test_a_widened_gate_polls_twice_the_average_up_to_the_longest():
    """Where cores are spare (busy_poll_max_us=4000): a parameter server's 1 ms reply
    is polled for (2 ms), a 3 ms one is not; short waits still poll one window."""
    gate = G.PollGate(WINDOW)
    gate.widen(4e-3)
    assert gate.limit == 2e-3 and gate.poll_for("new") == WINDOW
    for wait, polls in ((50e-6, WINDOW), (1e-3, 2e-3), (1.9e-3, 3.8e-3), (3e-3, 0.0)):
        gate.record(wait, wait)
        assert abs(gate.poll_for(wait) - polls) < 1e-12, (wait, gate.poll_for(wait))
        assert gate.should(wait) == (polls > 0)
    gate.widen(WINDOW / 2)  # never below one window: back to the plain gate
    assert gate.longest == WINDOW and gate.limit == G.WINDOWS * WINDOW


def test_co_located_counts_the_addresses_at_this_host():
    here = "tcp://127.0.0.1:4000#local=jdist-rpc-a"
    table = [here, "tcp://127.0.0.1:4001#local=jdist-rpc-b", "tcp://10.0.0.2:4000#local=c",
             "tcp://[::1]:4002", "inproc://w3"]
    assert co_located(here, table) == 2
    assert co_located("tcp://[::1]:9", table) == 1
    assert co_located("inproc://w3", table) == 1


def test_the_table_starts_over_when_full():
    gate = G.PollGate(WINDOW)
    for k in range(G.MAX_KINDS):
        gate.record(k, 1.0)
    gate.record("one more", 1.0)
    assert gate.average(0) is None and gate.should(0)  # forgotten: polls again
    assert not gate.should("one more")


@given(st.lists(st.floats(min_value=-1.0, max_value=100.0), min_size=1, max_size=200),
       st.sampled_from([None, 1e-3, 4e-3]))
def test_the_average_stays_within_the_samples_and_the_cap(waits, longest):
    gate = G.PollGate(WINDOW, longest)
    for w in waits:
        gate.record("k", w)
    avg = gate.average("k")
    clipped = [min(max(w, 0.0), 4 * gate.limit) for w in waits]
    assert min(clipped) - 1e-12 <= avg <= max(clipped) + 1e-12
    assert gate.should("k") == (avg <= gate.limit)
    span = gate.poll_for("k")
    if avg > gate.limit:
        assert span == 0.0
    else:
        assert WINDOW <= span <= gate.longest


# ---- the whole wait decision (plan_wait): one table ----------------------------------
W, N = G.WAIT_MAX, G.NEXT_SLEEP_S
PLANS = [
    # for_reply, polling_on, others_running, lone, poll_for, sleep_ok -> (poll, sleep)
    ((True, False, False, True, 0.004, False), (0.0, 0.0)),  # off / peer in this process
    ((True, True, False, True, 0.004, False), (0.004, W)),   # a lone reply: poll, sleep
    ((True, True, True, True, 0.004, False), (0.0, W)),      # others run: sleep only
    ((True, True, False, False, 0.004, False), (0.0, W)),    # more in flight: sleep only
    ((True, True, False, True, 0.0, False), (0.0, W)),       # its replies came late
    ((False, False, False, True, 0.004, True), (0.0, 0.0)),  # server, polling off
    ((False, True, False, True, 0.004, True), (0.004, N)),   # next call: poll, then sleep
    ((False, True, True, True, 0.004, True), (0.0, N)),      # others run: no poll
    ((False, True, False, False, 0.004, True), (0.004, 0.0)),  # own request in flight
    ((False, True, False, True, 0.004, False), (0.004, 0.0)),  # the gate says: late
    ((False, True, False, True, 0.0, False), (0.0, 0.0)),    # late and not to sleep: hand off
]


@pytest.mark.parametrize("facts,plan", PLANS)
def test_the_wait_decision_table(facts, plan):
    assert G.plan_wait(G.WaitFacts(*facts)) == G.WaitPlan(*plan)
