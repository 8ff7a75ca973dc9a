"""The store side of a round: joining, sealing the quorum, voting, deciding.

Keys (under the manager's prefix): ``round`` (the last sealed round + 1),
``r<n>/joined`` (one JSON line per joiner, appended), ``r<n>/sealed`` (the quorum,
written once by ``compare_set``: whoever seals first wins and everyone reads that),
``r<n>/oks`` and ``r<n>/err`` (the votes), ``r<n>/decision`` (``commit`` or ``abort``,
written once the same way), ``committed`` (the last committed round + 1: the job's
lineage), ``want/<id>`` (a replica outside the quorum wants in), ``forgot`` (rounds
below it are deleted, ``KEEP_ROUNDS`` behind), ``stop`` and ``done``. Counters only
rise (``_raise_to``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import NamedTuple

from jdist.errors import StoreError, StoreTimeoutError
from jdist.ft._rules import may_seal
from jdist.store import Store

__all__ = ["Quorum", "join", "seal_wait", "sealed_round", "preseal", "decide",
           "last_sealed", "last_committed", "forget_through"]

_POLL_S = 0.02


class Quorum(NamedTuple):
    """One sealed round: who takes part and what each brought."""

    round: int
    members: tuple[int, ...]  # replica ids, ascending: the order of every reduction
    info: dict[int, dict]  # id -> {"step", "last", "synced", "addr", "inc", "pid"}
    stop: bool  # a replica asked the job to stop (``Manager.request_stop``)
    pre: bool = False  # sealed by the last round's commit, not by joins

    def rank(self, replica: int) -> int:
        return self.members.index(replica)

    @property
    def incarnations(self) -> dict[int, int]:
        return {r: int(i["inc"]) for r, i in self.info.items()}


def last_sealed(store: Store) -> int:
    """The newest sealed round (-1: none yet)."""
    return int(store.add("round", 0)) - 1


def join(store: Store, r: int, replica: int, info: dict) -> None:
    store.append(f"r{r}/joined", json.dumps({"id": replica, **info}) + "\n")


def _joined(store: Store, r: int) -> dict[int, dict]:
    if not store.check([f"r{r}/joined"]):
        return {}
    out = {}
    for line in store.get(f"r{r}/joined").decode().splitlines():
        item = json.loads(line)
        out[int(item.pop("id"))] = item  # a later line of the same id wins
    return out


def _expected(store: Store, r: int, world_size: int) -> list[int]:
    previous = sealed_round(store, r - 1) if r > 0 else None
    return list(previous.members) if previous is not None else list(range(world_size))


def sealed_round(store: Store, r: int) -> Quorum | None:
    """Round ``r``'s quorum if it is sealed (and not forgotten)."""
    if r < forgotten(store) or not store.check([f"r{r}/sealed"]):
        return None
    try:
        q = json.loads(store.get(f"r{r}/sealed"))
    except StoreError:  # (forgotten between the check and the get)
        return None
    return Quorum(r, tuple(q["members"]), {int(k): v for k, v in q["info"].items()},
                  bool(q["stop"]), bool(q.get("pre", False)))


def seal_wait(store: Store, r: int, world_size: int, min_replicas: int,
              live: Callable[[], set[int]], join_timeout: float,
              deadline: float) -> Quorum | None:
    """Wait for round ``r``'s quorum, sealing it when :func:`may_seal` allows; None
    when the round was sealed and forgotten meanwhile (this replica fell behind).

    Rounds are sealed in order: while round ``r - 1`` is undecided and any of its
    members lives, ``r`` waits (and ``join_timeout`` has not started), so a replica
    that fell behind can never start a round beside the one in progress. A quorum
    needs a member whose last commit is the job's last (``committed``): replicas that
    are behind, or new, never go on without one that carries the state.

    Raises:
      StoreTimeoutError: no quorum by ``deadline`` (``time.monotonic``).
    """
    sealed, clock = f"r{r}/sealed", None
    expected = _expected(store, r, world_size)
    while not store.check([sealed]):
        if store.check(["done"]):  # the job ended: nothing to seal
            return None
        if last_sealed(store) >= r:  # sealed meanwhile (then ``sealed`` is there), or
            if store.check([sealed]):  # sealed and forgotten: this replica fell behind
                break
            return None
        if clock is None and not _previous_open(store, r, expected, live):
            clock = time.monotonic()  # join_timeout counts from here
        joined = _joined(store, r)
        if clock is not None and _may_seal(store, expected, joined, live, min_replicas,
                                           time.monotonic() - clock, join_timeout):
            record = json.dumps({"members": sorted(joined), "info": joined,
                                 "stop": store.check(["stop"]), "pre": False})
            if store.compare_set(sealed, "", record) == record.encode():
                _raise_to(store, "round", r + 1)
            break
        if time.monotonic() > deadline:
            why = (f"round {r - 1} is still undecided" if clock is None else
                   f"waiting for live replicas {sorted(set(expected) & live())}")
            raise StoreTimeoutError(f"no quorum for round {r}: joined {sorted(joined)}, "
                                    f"{why}, min_replicas={min_replicas}")
        try:
            store.wait([sealed], _POLL_S)
        except StoreTimeoutError:
            pass
    return sealed_round(store, r)


def _previous_open(store: Store, r: int, expected: list[int],
                   live: Callable[[], set[int]]) -> bool:
    """Whether round ``r - 1`` is sealed, undecided, and has a live member."""
    p = r - 1
    if p < 0 or p < forgotten(store) or not store.check([f"r{p}/sealed"]):
        return False
    return not store.check([f"r{p}/decision"]) and bool(set(expected) & live())


def _may_seal(store: Store, expected: list[int], joined: dict[int, dict],
              live: Callable[[], set[int]], min_replicas: int, waited: float,
              join_timeout: float) -> bool:
    carried = any(int(i["last"]) >= last_committed(store) for i in joined.values())
    return carried and may_seal(expected, list(joined), live(), min_replicas, waited,
                                join_timeout)


def last_committed(store: Store) -> int:
    """The newest committed round (-1: none yet)."""
    return int(store.add("committed", 0)) - 1


def forgotten(store: Store) -> int:
    """Rounds below this one have had their keys deleted."""
    return int(store.add("forgot", 0))


def _raise_to(store: Store, key: str, value: int) -> None:
    """Raise counter ``key`` to at least ``value`` (never lowers it; atomic)."""
    have = int(store.add(key, 0))
    while have < value:
        got = store.compare_set(key, str(have), str(value))
        have = int(got)


def decide(store: Store, q: Quorum, replica: int, ok: bool,
           alive: Callable[[int], bool], deadline: float, world_size: int) -> bool:
    """Vote ``ok`` and return the round's decision (the same on every member).

    The round commits when every member voted ok (the last ok vote writes it); it
    aborts at the first error vote, when a member that may not have voted is no longer
    ``alive(id)``, or at ``deadline``.
    """
    r, key = q.round, f"r{q.round}/decision"
    if r < forgotten(store):  # this replica was away for longer than KEEP_ROUNDS:
        return False  # its round's outcome is gone; it is behind and heals
    if ok and int(store.add(f"r{r}/oks", 1)) == len(q.members):
        _settle(store, q, "commit")
        preseal(store, q, world_size)
    elif not ok:
        store.set(f"r{r}/err", str(replica))
        _settle(store, q, "abort")
    while not store.check([key]):
        if (store.check([f"r{r}/err"]) or not all(alive(m) for m in q.members)
                or time.monotonic() > deadline):
            _settle(store, q, "abort")
            break
        try:
            store.wait([key], _POLL_S)
        except StoreTimeoutError:
            pass
    return store.get(key) == b"commit"


def _settle(store: Store, q: Quorum, verdict: str) -> None:
    if store.compare_set(f"r{q.round}/decision", "", verdict) == b"commit":
        _raise_to(store, "committed", q.round + 1)


def preseal(store: Store, q: Quorum, world_size: int) -> None:
    """After round ``q.round`` committed, seal the next round with the same members
    unless a replica outside them wants to join (``want/<id>``, set before it joins a
    round and deleted once it is in one): the steady state then needs no join round
    trip, and a joiner is never outrun by presealed rounds."""
    nxt = q.round + 1
    outside = [r for r in range(world_size) if r not in q.members]
    if store.check([f"r{nxt}/joined"]) or any(store.check([f"want/{r}"]) for r in outside):
        return
    step = max(int(i["step"]) for i in q.info.values()) + 1
    info = {m: {**q.info[m], "step": step, "last": q.round, "synced": True}
            for m in q.members}
    record = json.dumps({"members": list(q.members), "info": info,
                         "stop": store.check(["stop"]), "pre": True})
    if store.compare_set(f"r{nxt}/sealed", "", record) == record.encode():
        _raise_to(store, "round", nxt + 1)


KEEP_ROUNDS = 8  # a replica stopped for fewer rounds still reads its round's outcome


def forget_through(store: Store, r: int) -> None:
    """Delete the keys of every round up to ``r - KEEP_ROUNDS`` not deleted yet (best
    effort; the ``forgot`` counter is raised first, so a reader never finds a round's
    keys half gone without knowing it is forgotten)."""
    old = r - KEEP_ROUNDS
    start = forgotten(store)
    if old < start:
        return
    _raise_to(store, "forgot", old + 1)
    for gone in range(start, old + 1):
        for key in (f"r{gone}/joined", f"r{gone}/sealed", f"r{gone}/oks", f"r{gone}/err",
                    f"r{gone}/decision"):
            try:
                store.delete_key(key)
            except (StoreError, OSError):
                pass
