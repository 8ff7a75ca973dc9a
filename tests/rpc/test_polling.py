"""The poll phase over TCP: callers and pool threads read their connection briefly
before blocking. Correctness only (no timings): results, the threads user code runs on,
nested calls, timeouts, a dead peer."""

from __future__ import annotations

import operator
import threading
import time

import numpy as np
import pytest

from jdist.errors import RpcTimeoutError, WorkerUnavailableError
from jdist.rpc import _client, _pollgate, _serve
from jdist.rpc._serialize import describe_callable
from tests.rpc.conftest import make_agents, stop_all

_AGENTS: dict = {}


def thread_name():
    return threading.current_thread().name


def echo(x):
    return x


def nested(me, other, x):
    """Run on a pool thread: calls ``other`` and its own worker, back to back."""
    agent = _AGENTS[me]
    a = agent.rpc_async(other, operator.add, (x, 1)).wait()
    b = agent.rpc_async(me, operator.mul, (a, 2)).wait()
    return b


_RELEASE = threading.Event()


def wait_release(timeout):
    return _RELEASE.wait(timeout)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


@pytest.fixture
def tcp3(monkeypatch):
    # these agents share one process, where polling is off; treat them as remote peers
    monkeypatch.setattr(_client, "same_process", lambda address: address is None)
    agents = make_agents(3, transport="tcp", num_worker_threads=4)
    _AGENTS.clear()
    _AGENTS.update({a.info.name: a for a in agents})
    yield agents
    stop_all(agents, graceful=False)


def test_back_to_back_calls_run_on_pool_threads_with_results_in_order(tcp3, monkeypatch):
    a0 = tcp3[0]
    polled = []  # calls a pool thread picked up itself while polling
    real = _serve.CallServer._poll_next_call

    def spy(self, comm, peer, after):
        nxt = real(self, comm, peer, after)
        polled.append(nxt is not None)
        return nxt

    monkeypatch.setattr(_serve.CallServer, "_poll_next_call", spy)
    fut = a0.rpc_async("w1", echo, (0,))
    assert fut.waiter is not None and fut.wait() == 0  # a remote peer: the wait polls first
    names = {a0.rpc_async("w1", thread_name).wait() for _ in range(200)}
    # user code never runs on the I/O thread, polled or not (pool threads: jdist-rpc-w1_N)
    assert names and all(n.startswith("jdist-rpc-w1_") for n in names), names
    assert polled  # every synchronous reply was followed by a poll phase
    xs = [np.arange(i, dtype=np.float32) for i in range(1, 300)]
    futs = [a0.rpc_async("w1", echo, (x,)) for x in xs]  # many in flight on one socket
    for x, f in zip(xs, futs, strict=True):
        np.testing.assert_array_equal(f.wait(), x)
    big = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)  # 12 MiB
    np.testing.assert_array_equal(a0.rpc_async("w1", echo, (big,)).wait(), big)


def test_nested_calls_from_handlers_do_not_deadlock(tcp3):
    a0 = tcp3[0]
    for i in range(30):
        assert a0.rpc_async("w1", nested, ("w1", "w2", i)).wait(30) == (i + 1) * 2
    for _ in range(10):  # at most 2 blocked handlers per worker: 2 of 4 threads stay free
        futs = [a0.rpc_async(r, nested, (f"w{r}", f"w{3 - r}", r)) for r in (1, 2) for _ in "ab"]
        assert [f.wait(30) for f in futs] == [4, 4, 6, 6]


def test_poll_falls_back_to_blocking_and_times_out_naming_the_worker(tcp3):
    a0 = tcp3[0]
    assert a0.rpc_async("w1", sleep_then, (0.05, 7)).wait() == 7  # longer than a poll
    with pytest.raises(RpcTimeoutError, match=r"w1.*sleep_then.*0\.3"):
        a0.rpc_async("w1", sleep_then, (1.5, 0), timeout=0.3).wait()
    fut = a0.rpc_async("w2", sleep_then, (1, 5))
    with pytest.raises(RpcTimeoutError, match="Future.wait timed out after 0.01 s"):
        fut.wait(0.01)
    assert fut.wait() == 5


def test_dead_peer_fails_a_polled_wait(tcp3):
    a0, a1 = tcp3[0], tcp3[1]
    assert a0.rpc_async("w1", echo, (1,)).wait() == 1
    _RELEASE.clear()
    fut = a0.rpc_async("w1", wait_release, (30,))  # released below: no thread left behind
    killer = threading.Timer(0.2, a1.close)  # dies without a graceful shutdown
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailableError, match="w1"):
        fut.wait(20)
    killer.join(20)  # its close has finished before the fixture's teardown
    _RELEASE.set()
    assert time.monotonic() - t0 < 20  # failed by the drop, not by the wait's bound
    with pytest.raises(WorkerUnavailableError, match="w1"):
        a0.rpc_async("w1", echo, (1,)).wait()
    assert a0.rpc_async("w2", echo, (2,)).wait() == 2


def test_when_nothing_polls():
    """Peers in this process, busy_poll_us=0, and calls running in other threads of the
    process (they need the GIL) all turn polling off; bad values are refused."""
    from jdist.rpc import RpcBackendOptions
    from jdist.rpc._futures import _in_call, add_busy, others_running

    with pytest.raises(ValueError, match=r"busy_poll_us must be .* got -1"):
        RpcBackendOptions(busy_poll_us=-1)
    with pytest.raises(ValueError, match=r"busy_poll_max_us must be .* got '4000'"):
        RpcBackendOptions(busy_poll_max_us="4000")
    agents = make_agents(2, transport="tcp")  # same process: no polling
    try:
        assert agents[0].rpc_async("w1", echo, (1,)).waiter is None
        assert not agents[0].polls(1) and not agents[1].polls(0)
    finally:
        stop_all(agents, graceful=False)
    assert not others_running()
    add_busy(1)
    try:
        assert others_running()
        _in_call.depth = 1  # the one call counted is this thread's own
        assert not others_running()
    finally:
        _in_call.depth = 0
        add_busy(-1)


def test_busy_poll_us_zero_turns_polling_off(monkeypatch):
    monkeypatch.setattr(_client, "same_process", lambda address: address is None)
    agents = make_agents(2, transport="tcp", busy_poll_us=0)
    try:
        fut = agents[0].rpc_async("w1", echo, (2,))
        assert fut.waiter is None and fut.wait() == 2
        assert not agents[0].polls(1)
    finally:
        stop_all(agents, graceful=False)


def test_waits_for_late_messages_stop_polling_and_fast_ones_go_on(tcp3):
    """A reply that takes longer than a few poll windows (a 20 ms function), or a next
    call that comes late (the caller pauses between calls), stops those polls: the
    waiting thread sleeps at once (on the reply's connection). Arrivals are timed
    without polling too, so a kind that becomes fast polls again."""
    a0, a1 = tcp3[0], tcp3[1]
    slow, fast = describe_callable(sleep_then), describe_callable(echo)
    reply_kind = ("reply", a1.info.id, slow)
    polls = []

    class Spy(_pollgate.PollGate):
        def poll_for(self, kind):
            out = super().poll_for(kind)
            if kind == reply_kind:
                polls.append(out > 0)
            return out

    a0.poll_gate = Spy(a0._poll_s)
    readers = []  # the threads that read the replies
    on_reply = a0._on_reply
    a0._on_reply = lambda msg, frames: (readers.append(threading.get_ident()),
                                        on_reply(msg, frames))
    for i in range(10):
        assert a0.rpc_async("w1", sleep_then, (0.02, i)).wait() == i
    assert a0.poll_gate.average(reply_kind) > a0.poll_gate.limit
    assert polls and not any(polls[1:])  # only the first wait, of an unknown kind, polled
    # not polled, but the waiting thread still reads its late reply itself: it sleeps
    # on the connection (Comm.wait_until) instead of being woken by the I/O thread
    # (a thread descheduled for 20 ms between its send and its wait finds the reply
    # read already: allowed a couple of times on a loaded machine)
    assert len(readers) == 10 and readers.count(threading.get_ident()) >= 8, readers
    del a0._on_reply
    for i in range(60):  # the same function, now quick: measured, then polled again
        assert a0.rpc_async("w1", sleep_then, (0, i)).wait() == i
    assert a0.poll_gate.average(reply_kind) < 0.02
    for i in range(20):  # w1's pool thread waits for the next call after each echo
        assert a0.rpc_async("w1", echo, (i,)).wait() == i
        time.sleep(0.01)
    assert a1.poll_gate.average(("next", a0.info.id, fast)) > a1.poll_gate.limit
    assert not a1.poll_gate.should(("next", a0.info.id, fast))
    assert a0.rpc_async("w1", echo, ("still answers",)).wait() == "still answers"


def test_an_idle_server_sleeps_on_the_connection_for_the_next_call(tcp3, monkeypatch):
    """After replying, a pool thread of an otherwise idle process sleeps on the caller's
    connection for the next call (longer than a poll, shorter than NEXT_SLEEP_S) and runs
    it itself; a kind whose next calls come later than that stops sleeping."""
    a0, a1 = tcp3[0], tcp3[1]
    monkeypatch.setattr(_pollgate, "NEXT_SLEEP_S", 0.05)
    a1.sleep_gate = _pollgate.PollGate(0.05 / _pollgate.WINDOWS)
    kept = []  # per call after the first: did the thread that replied run it?
    real = _serve.CallServer._poll_next_call

    def spy(self, comm, peer, after):
        nxt = real(self, comm, peer, after)
        if self is a1:
            kept.append(nxt is not None)
        return nxt

    monkeypatch.setattr(_serve.CallServer, "_poll_next_call", spy)
    names = []
    for _ in range(10):
        names.append(a0.rpc_async("w1", thread_name).wait())
        time.sleep(0.01)  # far longer than a poll (busy_poll_us=200), within the sleep
    assert all(n.startswith("jdist-rpc-w1_") for n in names)  # pool threads only
    assert sum(kept[:9]) >= 6, kept  # read and run by the thread that slept for them
    kind = ("next", a0.info.id, describe_callable(thread_name))
    assert a1.sleep_gate.average(kind) > 0.005
    kept.clear()
    for _ in range(12):  # now the next call comes after 0.1 s: longer than the sleep
        assert a0.rpc_async("w1", thread_name).wait().startswith("jdist-rpc-w1_")
        time.sleep(0.1)
    assert a1.sleep_gate.average(kind) > 0.05
    assert not any(kept[-3:])  # gave up sleeping for that kind


def test_a_server_sleeps_for_a_callers_next_call_while_another_callers_call_runs(
        tcp3, monkeypatch):
    """The pool thread that replied to w0 sleeps on w0's connection for its next call
    while a call of w2 runs in the process (sleeping holds no GIL; the HybridModel's
    parameter server serves two trainers so), but not while another call of w0 itself
    runs there."""
    a0, a1, a2 = tcp3
    monkeypatch.setattr(_pollgate, "NEXT_SLEEP_S", 0.05)
    a1.sleep_gate = _pollgate.PollGate(0.05 / _pollgate.WINDOWS)
    kept = []  # per call of w0 after the first: did the thread that replied run it?
    real = _serve.CallServer._poll_next_call

    def spy(self, comm, peer, after):
        nxt = real(self, comm, peer, after)
        if self is a1 and peer == a0.info.id and after.endswith("thread_name"):
            kept.append(nxt is not None)
        return nxt

    monkeypatch.setattr(_serve.CallServer, "_poll_next_call", spy)

    def calls_of_w0_while(holder):
        _RELEASE.clear()
        held = holder.rpc_async("w1", wait_release, (10.0,))
        try:
            kept.clear()
            for _ in range(10):
                assert a0.rpc_async("w1", thread_name).wait().startswith("jdist-rpc-w1_")
                time.sleep(0.01)  # longer than a poll, within the sleep
            assert not held.done()  # it ran all along
        finally:
            _RELEASE.set()
        assert held.wait() is True
        return list(kept)

    other = calls_of_w0_while(a2)
    assert sum(other[:9]) >= 6, other  # w2's call running: w0's calls still kept
    own = calls_of_w0_while(a0)
    # the first: the thread still sleeping from before runs w0's wait_release itself;
    # then with that call of w0 running, w0's calls are handed to the pool
    assert not any(own[1:]), own


def test_a_caller_reads_its_late_reply_itself_with_other_requests_in_flight(tcp3):
    a0 = tcp3[0]
    readers = []
    on_reply = a0._on_reply
    a0._on_reply = lambda msg, frames: (readers.append(threading.get_ident()),
                                        on_reply(msg, frames))
    try:
        other = a0.rpc_async("w1", sleep_then, (0.6, "other"))  # in flight meanwhile
        assert a0.rpc_async("w1", sleep_then, (0.2, "mine")).wait() == "mine"
        assert readers == [threading.get_ident()]  # the waiting thread read it
        assert other.wait() == "other"
    finally:
        del a0._on_reply
