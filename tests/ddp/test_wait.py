"""wait_ready names dead peers and times out instead of hanging."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from jdist.collectives._group import local_group
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
