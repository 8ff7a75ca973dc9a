"""The store side of a round: joining, sealing the quorum, voting, deciding.

Keys (under the manager's prefix): ``round`` (the last sealed round), ``r<n>/joined``
(one JSON line per joiner, appended), ``r<n>/sealed`` (the quorum, written once by
``compare_set``: whoever seals first wins and everyone reads that), ``r<n>/oks`` and
``r<n>/err`` (the votes), ``r<n>/decision`` (``commit`` or ``abort``, written once
the same way), ``progress`` (some step committed), ``want/<id>`` (a replica outside the quorum
wants in), ``stop`` and ``done``. A round's
keys are deleted ``KEEP_ROUNDS`` rounds later.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import NamedTuple

from jdist.errors import StoreError, StoreTimeoutError
from jdist.ft._rules import may_seal
from jdist.store import Store

__all__ = ["Quorum", "join", "seal_wait", "sealed", "preseal", "decide", "last_sealed",
           "forget_round"]

_POLL_S = 0.02


class Quorum(NamedTuple):
    """One sealed round: who takes part and what each brought."""

    round: int
    members: tuple[int, ...]  # replica ids, ascending: the order of every reduction
    info: dict[int, dict]  # id -> {"step", "synced", "addr", "inc", "pid"}
    stop: bool  # a replica asked the job to stop (``Manager.request_stop``)

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
    if r > 0 and store.check([f"r{r - 1}/sealed"]):
        return json.loads(store.get(f"r{r - 1}/sealed"))["members"]
    return list(range(world_size))


def _read(store: Store, r: int) -> Quorum:
    q = json.loads(store.get(f"r{r}/sealed"))
    return Quorum(r, tuple(q["members"]), {int(k): v for k, v in q["info"].items()},
                  bool(q["stop"]))


def seal_wait(store: Store, r: int, world_size: int, min_replicas: int,
              live: Callable[[], set[int]], join_timeout: float,
              deadline: float) -> Quorum | None:
    """Wait for round ``r``'s quorum, sealing it when :func:`may_seal` allows; None
    when the round was sealed and forgotten meanwhile (this replica fell behind).

    Once a step has committed (``progress``), a quorum needs a member that carries the
    job's state (``synced``): replacements alone never start the job over.

    Raises:
      StoreTimeoutError: no quorum by ``deadline`` (``time.monotonic``).
    """
    start = time.monotonic()
    sealed = f"r{r}/sealed"
    expected = _expected(store, r, world_size)
    while not store.check([sealed]):
        if store.check(["done"]):  # the job ended: nothing to seal
            return None
        if last_sealed(store) >= r:  # sealed meanwhile (then ``sealed`` is there), or
            if store.check([sealed]):  # sealed and forgotten: this replica fell behind
                break
            return None
        joined = _joined(store, r)
        carried = any(i["synced"] for i in joined.values()) or not store.check(["progress"])
        if carried and may_seal(expected, list(joined), live(), min_replicas,
                                time.monotonic() - start, join_timeout):
            members = sorted(joined)
            record = json.dumps({"members": members, "info": joined,
                                 "stop": store.check(["stop"])})
            if store.compare_set(sealed, "", record) == record.encode():
                _advance(store, r)
            break
        if time.monotonic() > deadline:
            raise StoreTimeoutError(
                f"no quorum for round {r}: joined {sorted(joined)}, waiting for live "
                f"replicas {sorted(set(expected) & live())}, min_replicas={min_replicas}")
        try:
            store.wait([sealed], _POLL_S)
        except StoreTimeoutError:
            pass
    try:
        return _read(store, r)
    except StoreError:
        return None


def _advance(store: Store, r: int) -> None:
    """Move ``round`` up to ``r`` (a counter: ``add`` never moves it back)."""
    have = int(store.add("round", 0)) - 1
    if r > have:
        store.add("round", r - have)


def decide(store: Store, q: Quorum, replica: int, ok: bool,
           alive: Callable[[int], bool], deadline: float, world_size: int) -> bool:
    """Vote ``ok`` and return the round's decision (the same on every member).

    The round commits when every member voted ok (the last ok vote writes it); it
    aborts at the first error vote, when a member that may not have voted is no longer
    ``alive(id)``, or at ``deadline``.
    """
    r, key = q.round, f"r{q.round}/decision"
    if ok and int(store.add(f"r{r}/oks", 1)) == len(q.members):
        _settle(store, key, "commit")
        preseal(store, q, world_size)
    elif not ok:
        store.set(f"r{r}/err", str(replica))
        _settle(store, key, "abort")
    while not store.check([key]):
        if (store.check([f"r{r}/err"]) or not all(alive(m) for m in q.members)
                or time.monotonic() > deadline):
            _settle(store, key, "abort")
            break
        try:
            store.wait([key], _POLL_S)
        except StoreTimeoutError:
            pass
    return store.get(key) == b"commit"


def _settle(store: Store, key: str, verdict: str) -> None:
    if store.compare_set(key, "", verdict) == b"commit" and not store.check(["progress"]):
        store.set("progress", "1")


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
    info = {m: {**q.info[m], "step": step, "synced": True} for m in q.members}
    record = json.dumps({"members": list(q.members), "info": info,
                         "stop": store.check(["stop"])})
    if store.compare_set(f"r{nxt}/sealed", "", record) == record.encode():
        _advance(store, nxt)


def sealed(store: Store, r: int) -> Quorum | None:
    """Round ``r``'s quorum if it is sealed already."""
    if not store.check([f"r{r}/sealed"]):
        return None
    try:
        return _read(store, r)
    except StoreError:
        return None


KEEP_ROUNDS = 8  # a replica stopped for fewer rounds still reads its round's outcome


def forget_round(store: Store, r: int) -> None:
    """Delete the keys of round ``r - KEEP_ROUNDS`` (best effort)."""
    old = r - KEEP_ROUNDS
    if old < 0:
        return
    for key in (f"r{old}/joined", f"r{old}/sealed", f"r{old}/oks", f"r{old}/err",
                f"r{old}/decision"):
        try:
            store.delete_key(key)
        except (StoreError, OSError):
            pass
