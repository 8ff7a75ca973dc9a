"""wait_ready names dead peers and times out instead of hanging; short steps are polled."""

from __future__ import annotations

import re
import threading

import jax.numpy as jnp
import pytest

from jdist.collectives._group import local_group
from jdist.ddp import _wait as W
from jdist.ddp._wait import wait_ready
from jdist.errors import CollectiveTimeoutError, PeerFailedError


class _Never:
    def is_ready(self):
        return False


class _Watchdog:
    def __init__(self, dead):
        self.dead, self.calls = dead, 0

    def diagnose(self, ranks, wait=None):
        self.calls += 1
        return {r: why for r, why in self.dead.items() if r in ranks}


class _Group:
    ranks, timeout, name = (0, 1), 0.3, "WORLD"


def test_ready_outputs_return_at_once():
    wait_ready({"a": jnp.ones(3)}, local_group(), "step", timeout=0.0)


def test_dead_peer_is_named():
    wd = _Watchdog({1: "its process (pid 4242) has exited"})
    with pytest.raises(PeerFailedError, match=re.escape(
            "DDP step #3 cannot finish: rank 1: its process (pid 4242) has exited")):
        wait_ready([_Never()], _Group(), "DDP step #3", watchdog=wd, check_every=0.01)
    assert wd.calls >= 1


def test_timeout_names_the_step_and_group():
    with pytest.raises(CollectiveTimeoutError, match=r"DDP step #7 did not finish within 0.3 s"):
        wait_ready([_Never()], _Group(), "DDP step #7", watchdog=_Watchdog({}),
                   check_every=0.05)


class _ReadyAfter:
    """Ready from the ``n``-th time it is asked on."""

    def __init__(self, n):
        self.n, self.asked = n, 0

    def is_ready(self):
        self.asked += 1
        return self.asked >= self.n


class _Group2:
    ranks, timeout, name = (0, 1), 5.0, "polled"


@pytest.fixture
def fresh_gate(monkeypatch):
    monkeypatch.setattr(W, "_waits", {})
    started = []
    real = W._start_wait
    monkeypatch.setattr(W, "_start_wait", lambda leaves: started.append(1) or real(leaves))
    return started


@pytest.fixture
def spare(monkeypatch):
    """This host has a core to spare (see jdist/_cores.py): polling is allowed."""
    monkeypatch.setattr(W, "spare_core", lambda processes: True)


def test_a_short_step_is_polled_without_the_waiter_thread(fresh_gate, monkeypatch, spare):
    monkeypatch.setattr(W, "SPIN_S", 5.0)  # a loaded machine may take the core a while
    leaf = _ReadyAfter(50)
    wait_ready([leaf], _Group2(), "DDP step #1")
    assert leaf.asked == 50 and fresh_gate == []  # no hand-off to the thread
    kind = ("polled", "DDP step")
    assert 0.0 <= W._waits[kind] <= W.SPIN_S


@pytest.mark.parametrize("cores, local, polls", [(2, "2", False), (3, "2", True),
                                                  (1, None, False), (8, None, True),
                                                  (4, "4", False), (16, "8", True)])
def test_polling_needs_a_core_to_spare(fresh_gate, monkeypatch, cores, local, polls):
    """No more usable cores than the job's processes here (LOCAL_WORLD_SIZE, else the
    group's size): the wait goes to the thread at once, polling nothing."""
    from jdist import _cores

    monkeypatch.setattr(_cores, "usable_cores", lambda: cores)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    monkeypatch.setattr(W, "SPIN_S", 5.0)
    leaf = _ReadyAfter(50)
    wait_ready([leaf], _Group2(), "DDP step #1")
    assert fresh_gate == ([] if polls else [1])  # polled here, or handed to the thread
    assert leaf.asked == 50


def test_a_long_kind_of_step_goes_to_the_thread_at_once_and_is_learnt(fresh_gate, spare):
    kind = ("polled", "DDP step")
    W._waits[kind] = 3 * W.SPIN_S  # its steps took longer than a poll lasts
    leaf = _ReadyAfter(3)  # the first look, then the waiter thread's polls
    wait_ready([leaf], _Group2(), "DDP step #9")
    assert fresh_gate == [1]
    # a step that polls in vain for its whole budget also ends on the thread, and the
    # average learns from every wait (capped, so one stall is soon forgotten)
    W._waits[kind] = 0.0
    slow = _ReadyAfter(10**9)
    t = threading.Timer(0.05, lambda: setattr(slow, "n", 0))
    t.start()
    wait_ready([slow], _Group2(), "DDP step #10")
    t.join()
    assert fresh_gate == [1, 1]
    assert W._waits[kind] == pytest.approx(W._WEIGHT * 4 * W.SPIN_S)
