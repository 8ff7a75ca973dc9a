"""What the ranks of a multi-process pipeline learn through the process group's store:
whether a peer's process is gone, a peer's published value, and the end-of-step
agreement of the XLA transport.

**The step agrees.** A rank whose actions all ran may still be the only one to think
the step succeeded: its last message went out before a peer's stage raised, and it has
nothing left to receive. So no rank returns from a step before every rank of the
pipeline said how its step ended; a failure anywhere raises everywhere, and no rank
applies an update the others do not. The mailbox transport says it with one message per
peer (``jdist/pipelining/_sockets.py``); the XLA transport, whose point-to-point
programs must not run beside another collective, with one store key per rank and step
(:func:`say`, :func:`hear_all`; a rank deletes its key of two steps before, which every
peer has read by then). Guarded by ``tests/pipelining/test_multiprocess.py``.
"""

from __future__ import annotations

import time
from datetime import timedelta

from jdist.errors import CollectiveTimeoutError, PeerFailedError, StoreTimeoutError

__all__ = ["Liveness", "group_store", "hear_all", "peer_gone", "published", "say"]

OK = b"ok"


def group_store():
    """The process group's store (where the ranks publish and agree)."""
    from jdist.collectives.runtime import group_state

    runtime = group_state.runtime
    store = runtime.get("store") if runtime else None
    if store is None:
        raise ValueError("pipelining across processes needs jdist.init_process_group() "
                         "in every process (its store carries the peers' addresses)")
    return store


def peer_gone(src: int) -> str | None:
    """Why rank ``src`` is gone (its process left this host's table, or the runtime's
    heartbeat found it dead before), or None while it runs or when that cannot be
    known here."""
    from jdist.collectives.runtime import group_state

    wd = (group_state.runtime or {}).get("watchdog")
    return None if wd is None else wd.diagnose([src], wait=0.0).get(src)


class Liveness:
    """:func:`peer_gone`, looked up at most once a second (a wait's polling loop may
    turn many times a second)."""

    def __init__(self) -> None:
        self._looked = time.monotonic()  # (the first look after a second)

    def gone(self, src: int) -> str | None:
        now = time.monotonic()
        if now - self._looked < 1.0:
            return None
        self._looked = now
        return peer_gone(src)


def published(store, key: str, rank: int, timeout: float, what: str) -> bytes:
    """``store.get(key)`` once rank ``rank`` set it, looking every second whether that
    rank's process is gone (then PeerFailedError, not a wait until ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            left = min(1.0, max(0.01, deadline - time.monotonic()))
            store.wait([key], timedelta(seconds=left))
            return store.get(key)
        except StoreTimeoutError:
            why = peer_gone(rank)
            if why is not None:
                raise PeerFailedError(f"pipeline: rank {rank} is gone ({why}) before "
                                      f"{what}") from None
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"pipeline: rank {rank} did not come to {what} within {timeout:g} s; "
                    f"build the schedule and call step() on every rank of the pipeline "
                    f"group") from None


def _key(tag: str, rank: int) -> str:
    return f"jdist/pipe/{tag}/end/{rank}"


def say(store, tag: str, rank: int, status: bytes) -> None:
    """Publish how rank ``rank``'s step ``tag`` (``"<group>/<schedule>/<step>"``)
    ended: :data:`OK` or the error's text; forget its key of two steps before."""
    store.set(_key(tag, rank), status)
    head, _, step = tag.rpartition("/")
    if int(step) > 2:
        try:
            store.delete_key(_key(f"{head}/{int(step) - 2}", rank))
        except Exception:  # noqa: BLE001 (best effort: a key left behind is harmless)
            pass


def hear_all(store, tag: str, ranks, me: int, timeout: float) -> None:
    """Wait for every other rank's end of step ``tag``; PeerFailedError naming the
    first that failed."""
    for r in ranks:
        if r == me:
            continue
        status = published(store, _key(tag, r), r, timeout, "the end of the step")
        if status != OK:
            raise PeerFailedError(f"pipeline: the step failed on rank {r}: "
                                  f"{status.decode(errors='replace')}")
