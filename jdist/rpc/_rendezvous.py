"""Rendezvous of worker names -> addresses through a key-value store, and store barriers.

Only ``set``, ``get``, ``add`` and ``compare_set`` of the store are used (TCPStore,
or :class:`jdist.store.HashStore` for in-process agents), and waits poll with ``add(key,
0)`` so every wait is bounded and can name the ranks that did not arrive.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from jdist.errors import RendezvousError, RendezvousTimeoutError
from jdist.rpc._protocol import check_worker_name

__all__ = ["rendezvous", "store_barrier", "check_name", "PREFIX"]

PREFIX = "jdist/rpc"
_POLL = 0.01
_POLL_MAX = 0.2


def check_name(name: Any) -> str:
    """Validate a worker name (torch's rule: letters, digits, ``_-:``, and ``.``; 1-128).

    Raises:
      WorkerNameError: (a ValueError and RuntimeError) the name is empty, too long or has
        other characters.
    """
    return check_worker_name(name)


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
        taken = int(holder.decode())  # reported once everyone arrived (or time ran out)
    else:
        taken = None
    store.set(f"{PREFIX}/worker/{rank}", json.dumps([name, address]))
    store.add(f"{PREFIX}/arrived/{rank}", 1)
    missing = _wait_ranks(store, "arrived", range(world_size), time.monotonic() + timeout,
                          lambda r: False)
    if missing and taken is not None:
        _not_unique(name, [taken, rank])
    if missing:
        raise RendezvousTimeoutError(
            f"init_rpc: ranks {missing} did not join within {timeout:g} s (world_size="
            f"{world_size}); check that they started and reach the same init_method")
    table = {}
    for r in range(world_size):
        n, a = json.loads(_as_bytes(store.get(f"{PREFIX}/worker/{r}")))
        table[r] = (n, a)
    for n in {n for n, _ in table.values()}:  # every rank raises, as in torch
        holders = sorted(r for r, (m, _) in table.items() if m == n)
        if len(holders) > 1:
            _not_unique(n, holders)
    return table


def _not_unique(name: str, ranks: list[int]) -> None:
    raise RendezvousError(f"RPC worker name {name!r} is not unique: ranks {ranks} use it "
                          f"('{name}' is already taken by rank {ranks[0]}); give every worker "
                          "a unique name")


def _wait_ranks(store: Any, phase: str, ranks, deadline: float,
                gone: Callable[[int], bool], pause: list[float] | None = None) -> list[int]:
    """Ranks (not ``gone``) whose ``phase`` key is still 0 at ``deadline``; [] if none.

    ``pause``: ``[seconds]`` between polls, carried over between calls (it grows).
    """
    missing = list(ranks)
    pause = [_POLL] if pause is None else pause
    while True:
        missing = [r for r in missing
                   if not gone(r) and store.add(f"{PREFIX}/{phase}/{r}", 0) < 1]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(max(0.0, min(pause[0], deadline - time.monotonic())))
        # back off: a long wait (passive workers in shutdown while the master trains)
        # must not load the store's host with hundreds of requests a second
        pause[0] = min(pause[0] * 1.5, _POLL_MAX)


def store_barrier(store: Any, phase: str, rank: int, world_size: int, deadline: float,
                  gone: Callable[[int], bool],
                  on_wait: Callable[[list[int]], bool | None] | None = None) -> list[int]:
    """Arrive at ``phase``; wait for all ranks not ``gone``; return the missing ones.

    ``on_wait(missing)`` runs about every 0.5 s while some are missing; a true result
    stops the wait (those are returned). ``deadline`` may be ``math.inf``.
    """
    store.add(f"{PREFIX}/{phase}/{rank}", 1)
    others = [r for r in range(world_size) if r != rank]
    pause = [_POLL]
    while True:
        step = min(deadline, time.monotonic() + 0.5)
        others = _wait_ranks(store, phase, others, step, gone, pause)
        if not others or time.monotonic() >= deadline:
            return others
        if on_wait is not None and on_wait(others):
            return others
