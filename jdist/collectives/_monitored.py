"""``monitored_barrier``: a barrier through the store that names the ranks missing.

As torch's (gloo-only) version, where rank 0 receives one message from every other
member and then answers each: here each member ``r`` counts its calls in the store
(``a/<r>``, its k-th call), and the group's rank 0, which remembers how many arrivals of
each rank it has consumed, waits up to ``timeout`` for one new arrival from every other
member. It then writes a verdict for each arrival (``v/<r>/<k>``): ``ok``, or its
error, which it raises, naming the missing ranks (all of them with
``wait_all_ranks=True``, else the first). The error is also left for each missing
rank's pending arrival, so a rank that comes late learns at once that the barrier
failed. A missing rank whose process has died is marked as such.

It uses no collective sequence number, so members that skip a monitored barrier (as
torch's tests do) leave the other collectives of the group in step.
"""

from __future__ import annotations

import time

from jdist.collectives import _engine as eng
from jdist.collectives._group import ProcessGroup, group_state, timeout_seconds
from jdist.errors import CollectiveTimeoutError

__all__ = ["monitored_barrier"]


def _poll(ready, deadline: float) -> bool:
    """Call ``ready()`` until it is true or ``deadline`` passes; return the last answer."""
    sleep = 0.0005
    while True:
        if ready():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.02)


def _lead(g: ProcessGroup, wd, prefix: str, seconds: float, wait_all_ranks: bool) -> None:
    """Rank 0's side: consume one arrival of every other member, or raise."""
    store, lock = wd.store, wd.lock
    consumed = g.extra.setdefault("mb_consumed", {r: 0 for r in g.ranks[1:]})
    arrived: dict[int, int] = {}

    def ready() -> bool:
        with lock:
            for r in g.ranks[1:]:
                if r not in arrived and store.add(f"{prefix}a/{r}", 0) > consumed[r]:
                    arrived[r] = consumed[r] + 1
        return len(arrived) == g.size() - 1

    ok = _poll(ready, time.monotonic() + seconds)
    for r, k in arrived.items():
        consumed[r] = k
    me = g.ranks[0]
    if ok:
        with lock:
            for r, k in arrived.items():
                store.set(f"{prefix}v/{r}/{k}", "ok")
        return
    missing = [r for r in g.ranks[1:] if r not in arrived]
    shown = missing if wait_all_ranks else missing[:1]
    dead = wd.diagnose(shown, wait=0.0)
    notes = "".join(f" (rank {r} is gone: {dead[r]})" for r in shown if r in dead)
    ms = int(seconds * 1000)
    who = f"Ranks {', '.join(map(str, shown))}" if wait_all_ranks else f"Rank {shown[0]}"
    msg = f"[Rank {me}]: {who} failed to pass monitoredBarrier in {ms} ms{notes}"
    if seconds <= 0:
        msg = (f"[Rank {me}]: Rank {me} timed out in monitoredBarrier after {ms} ms "
               f"(the timeout was spent before it waited for any rank); {msg}")
    for r in missing:  # a late arrival is answered with the verdict it came late for
        arrived[r] = consumed[r] = consumed[r] + 1
    with lock:
        for r, k in arrived.items():
            store.set(f"{prefix}v/{r}/{k}", msg)
    raise CollectiveTimeoutError(f"{msg}. Check that rank, or raise timeout=")


def _follow(g: ProcessGroup, wd, prefix: str, seconds: float) -> None:
    """Another member's side: arrive, then wait for rank 0's verdict on this arrival."""
    store, lock = wd.store, wd.lock
    me, leader = g.ranks[g.rank], g.ranks[0]
    with lock:
        k = store.add(f"{prefix}a/{me}", 1)
    key = f"{prefix}v/{me}/{k}"

    def ready() -> bool:
        with lock:
            return store.check([key])

    if not _poll(ready, time.monotonic() + seconds + 5.0):
        raise CollectiveTimeoutError(
            f"[Rank {me}]: Rank {me} successfully reached monitoredBarrier, but received "
            f"errors while waiting for send/recv from rank {leader}: rank {leader} did not "
            f"release it within {seconds:g} s (+5 s); check rank {leader}")
    with lock:
        verdict = store.get(key).decode()
        store.delete_key(key)
    if verdict != "ok":
        raise CollectiveTimeoutError(
            f"[Rank {me}]: Rank {me} successfully reached monitoredBarrier, but received "
            f"errors while waiting for send/recv from rank {leader}: {verdict}")


def monitored_barrier(group: ProcessGroup | None = None, timeout=None,
                      wait_all_ranks: bool = False) -> None:
    """Barrier that raises on rank 0 naming the ranks that did not arrive in time.

    Args:
      group: the group (default WORLD). On a process outside it (``NON_GROUP_MEMBER``)
        the call warns and returns None, as in torch.
      timeout: seconds or ``timedelta`` (default: the group's timeout); 0 means rank 0
        gives up at once, as in torch.
      wait_all_ranks: report every missing rank, not only the first.

    Raises:
      CollectiveTimeoutError (a ``RuntimeError``): on group rank 0, torch's
        ``"[Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms"`` (``"Ranks 1,
        2 failed ..."`` with ``wait_all_ranks=True``; ``"Rank 0 timed out in
        monitoredBarrier"`` when the timeout was spent before any rank was waited for);
        on the others, ``"Rank 1 successfully reached monitoredBarrier, but received
        errors while waiting for send/recv from rank 0"`` with rank 0's report.
    """
    g = eng.member_group(group, "monitored_barrier")
    if g is None:
        return None
    seconds = timeout_seconds(timeout, g.timeout, "monitored_barrier", allow_zero=True)
    wd = group_state.runtime.get("watchdog")
    if g.size() == 1 or wd is None:
        return None
    prefix = f"jdist/mb/{group_state.generation}/{g.name}/"
    if g.rank == 0:
        _lead(g, wd, prefix, seconds, wait_all_ranks)
    else:
        _follow(g, wd, prefix, seconds)
    return None
