"""What lets a pipeline's micro-batches overlap under distributed autograd.

- A differentiable ``remote()``'s backward rule does not wait for the cotangents that
  come back from the worker its RRef was handed to: it sends them on to the owner when
  they arrive (``_Link.collect_then``), so the next micro-batch's backward message goes
  out meanwhile.
- A call of a ``pure`` function that waits for the caller's previous call starts
  fetching the other workers' RRefs among its arguments while it waits
  (``RRef._prefetch``); its ``to_here()`` then takes that fetch, once.

The whole pattern is trained and checked against torch in tests/rpc/test_pipeline_grad.py
and tests/examples/test_ports.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jdist.rpc import _rref, dist_autograd
from jdist.rpc._futures import Future
from jdist.rpc.autograd._engine import _prefetch_rrefs
from jdist.rpc.autograd._slots import _Link
from tests.rpc.conftest import make_agents, stop_all


def _answer(ct):
    """A backward answer ``(ct_xs, rref_cts)`` carrying ``ct`` for the RRef sent along."""
    return [], [None if ct is None else [np.asarray(ct, np.float32)]]


def test_link_sends_once_every_answer_is_in_without_blocking():
    link = _Link()
    link.add([np.float32(1.0)])  # from a to_here() in the caller's own trace
    first, second = Future(), Future()
    link.add_pending(first, 0)
    link.add_pending(second, 0)
    sent, reply = [], Future()

    def send(cts):
        sent.append(cts)
        return reply

    out = link.collect_then(send)  # returns at once: nothing has answered yet
    assert not out.done() and sent == []
    first.set_result(_answer(2.0))
    assert sent == []  # the second answer is still out
    second.set_result(_answer(None))  # that worker never fetched the value
    assert len(sent) == 1 and [float(c) for c in sent[0]] == [3.0]
    assert not out.done()  # waits for the owner's own answer
    reply.set_result(("ct_xs", "rref_cts"))
    assert out.wait(5) == ("ct_xs", "rref_cts")
    assert link.cts is None  # the cotangents went out once


def test_link_without_answers_in_flight_sends_at_once_and_errors_reach_the_pass():
    link = _Link()
    now = Future()
    now.set_result("answer")
    assert link.collect_then(lambda cts: (now if cts is None else None)).wait(5) == "answer"

    failing = Future()
    link.add_pending(failing, 0)
    out = link.collect_then(lambda cts: pytest.fail("sent despite a failed answer"))
    failing.set_exception(RuntimeError("worker2 died"))
    with pytest.raises(RuntimeError, match="worker2 died"):
        out.wait(5)

    broken = Future()
    link.add_pending(broken, 0)
    out = link.collect_then(lambda cts: 1 / 0)  # the send itself fails
    broken.set_result(_answer(1.0))
    with pytest.raises(ZeroDivisionError):
        out.wait(5)


# ---- remote functions (module level: they pickle by reference) ----
def make_value():
    return np.arange(4, dtype=np.float32)


@dist_autograd.pure
def pure_scaled(x_rref, k):
    return x_rref.to_here() * k


def plain_scaled(x_rref, k):
    return x_rref.to_here() * k


def probe(rref):
    """On w2: prefetch, then count the owner's fetches around two to_here() calls."""
    rref._prefetch()
    deadline = time.monotonic() + 10
    while FETCHES["n"] < 1 and time.monotonic() < deadline:  # served while we wait
        time.sleep(0.01)
    served_before = FETCHES["n"]
    first = rref.to_here()
    after_first = FETCHES["n"]
    second = rref.to_here()
    return served_before, after_first, FETCHES["n"], first, second


def prefetched_by(func, rref):
    """On w2: whether a differentiable call of ``func`` would prefetch ``rref``."""
    rref._prefetched = None
    _prefetch_rrefs(func, ((rref, 2.0), {}))
    started = rref._prefetched is not None
    if started:
        rref.to_here()  # take it (the call would)
    return started


FETCHES = {"n": 0}
_lock = threading.Lock()


@pytest.fixture
def counting_fetch(monkeypatch):
    """rref_fetch that counts the fetches its owner serves (same process: all agents)."""
    real = _rref.rref_fetch

    def rref_fetch(rref):
        with _lock:
            FETCHES["n"] += 1
        return real(rref)

    rref_fetch.__qualname__ = rref_fetch.__name__ = "rref_fetch"
    rref_fetch.__module__ = real.__module__
    rref_fetch._jdist_async_execution = True
    monkeypatch.setattr(_rref, "rref_fetch", rref_fetch)
    FETCHES["n"] = 0
    yield
    FETCHES["n"] = 0


def test_prefetch_is_taken_by_the_next_to_here_once(counting_fetch):
    agents = make_agents(3)
    try:
        a0 = agents[0]
        rref = a0.remote("w1", make_value)
        rref.to_here()
        FETCHES["n"] = 0
        before, after_first, after_second, first, second = a0.rpc_async("w2", probe, (rref,)).wait()
        assert (before, after_first, after_second) == (1, 1, 2)
        np.testing.assert_array_equal(first, make_value())
        np.testing.assert_array_equal(second, make_value())
        # only a pure function's call fetches early (it fetches every RRef argument
        # before it runs anyway); a plain one may never call to_here()
        assert a0.rpc_async("w2", prefetched_by, (pure_scaled, rref)).wait() is True
        assert a0.rpc_async("w2", prefetched_by, (plain_scaled, rref)).wait() is False
    finally:
        stop_all(agents, graceful=False)
