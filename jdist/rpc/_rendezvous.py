"""Rendezvous of worker names -> addresses through a key-value store, and store barriers.

Only ``set``, ``get``, ``add`` and ``compare_set`` of the store are used (TCPStore,
HashStore, or :class:`MemoryStore` for in-process agents), and waits poll with ``add(key,
0)`` so every wait is bounded and can name the ranks that did not arrive.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from jdist.errors import RendezvousError, RendezvousTimeoutError

__all__ = ["MemoryStore", "rendezvous", "store_barrier", "check_name", "PREFIX"]

PREFIX = "jdist/rpc"
_NAME = re.compile(r"^[A-Za-z0-9_\-:.]{1,128}$")
_POLL = 0.01


class MemoryStore:
    """A thread-safe in-memory store with TCPStore's ``set/get/add/compare_set/wait``."""

    def __init__(self, timeout: float = 60.0):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self.timeout = timeout

    def set(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            v = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(v).encode()
            self._cond.notify_all()
            return v

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        des = desired.encode() if isinstance(desired, str) else bytes(desired)
        with self._cond:
            cur = self._data.get(key)
            if (cur is None and exp == b"") or cur == exp:
                self._data[key] = des
                self._cond.notify_all()
                return des
            return cur if cur is not None else exp

    def wait(self, keys: list[str], timeout: float | timedelta | None = None) -> None:
        t = self.timeout if timeout is None else timeout
        t = t.total_seconds() if isinstance(t, timedelta) else t
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), t):
                missing = [k for k in keys if k not in self._data]
                raise TimeoutError(f"MemoryStore.wait timed out after {t} s for keys {missing}")


def check_name(name: Any) -> str:
    """Validate a worker name (torch's rule: letters, digits, ``_-:.``, up to 128).

    Raises:
      ValueError: the name is empty, too long or has other characters.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"worker name must be 1-128 characters of letters, digits, '_', '-', "
                         f"':' or '.', got {name!r}")
    return name


def _as_bytes(v: Any) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def rendezvous(store: Any, name: str, rank: int, world_size: int, address: str,
               timeout: float) -> dict[int, tuple[str, str]]:
    """Publish ``(name, address)`` for ``rank``; return every rank's once all arrived.

    Raises:
      RendezvousError: the name is taken by another rank, or world sizes disagree.
      RendezvousTimeoutError: some ranks did not arrive in ``timeout`` s (named).
    """
    ws = _as_bytes(store.compare_set(f"{PREFIX}/world_size", "", str(world_size)))
    if ws != str(world_size).encode():
        raise RendezvousError(f"rank {rank} has world_size={world_size} but another rank "
                              f"registered world_size={ws.decode()}; give all the same")
    holder = _as_bytes(store.compare_set(f"{PREFIX}/name/{name}", "", str(rank)))
    if holder != str(rank).encode():
        raise RendezvousError(f"worker name {name!r} is already taken by rank "
                              f"{holder.decode()}; give every worker a unique name")
    store.set(f"{PREFIX}/worker/{rank}", json.dumps([name, address]))
    store.add(f"{PREFIX}/arrived/{rank}", 1)
    missing = _wait_ranks(store, "arrived", range(world_size), time.monotonic() + timeout,
                          lambda r: False)
    if missing:
        raise RendezvousTimeoutError(
            f"init_rpc: ranks {missing} did not join within {timeout:g} s (world_size="
            f"{world_size}); check that they started and reach the same init_method")
    table = {}
    for r in range(world_size):
        n, a = json.loads(_as_bytes(store.get(f"{PREFIX}/worker/{r}")))
        table[r] = (n, a)
    return table


def _wait_ranks(store: Any, phase: str, ranks, deadline: float,
                gone: Callable[[int], bool]) -> list[int]:
    """Ranks (not ``gone``) whose ``phase`` key is still 0 at ``deadline``; [] if none."""
    missing = list(ranks)
    while True:
        missing = [r for r in missing
                   if not gone(r) and store.add(f"{PREFIX}/{phase}/{r}", 0) < 1]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(_POLL)


def store_barrier(store: Any, phase: str, rank: int, world_size: int, deadline: float,
                  gone: Callable[[int], bool], on_wait: Callable[[list[int]], None] | None = None
                  ) -> list[int]:
    """Arrive at ``phase``; wait for all ranks not ``gone``; return the missing ones."""
    store.add(f"{PREFIX}/{phase}/{rank}", 1)
    others = [r for r in range(world_size) if r != rank]
    while True:
        step = min(deadline, time.monotonic() + 0.5)
        others = _wait_ranks(store, phase, others, step, gone)
        if not others or time.monotonic() >= deadline:
            return others
        if on_wait is not None:
            on_wait(others)
