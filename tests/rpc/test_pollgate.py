"""The busy-poll gate: which waits poll, from how long waits of each kind lasted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jdist.rpc import _pollgate as G

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


def test_the_table_starts_over_when_full():
    gate = G.PollGate(WINDOW)
    for k in range(G.MAX_KINDS):
        gate.record(k, 1.0)
    gate.record("one more", 1.0)
    assert gate.average(0) is None and gate.should(0)  # forgotten: polls again
    assert not gate.should("one more")


@given(st.lists(st.floats(min_value=-1.0, max_value=100.0), min_size=1, max_size=200))
def test_the_average_stays_within_the_samples_and_the_cap(waits):
    gate = G.PollGate(WINDOW)
    for w in waits:
        gate.record("k", w)
    avg = gate.average("k")
    clipped = [min(max(w, 0.0), 4 * gate.limit) for w in waits]
    assert min(clipped) - 1e-12 <= avg <= max(clipped) + 1e-12
    assert gate.should("k") == (avg <= gate.limit)
