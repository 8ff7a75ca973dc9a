"""``monitored_barrier``: a barrier through the store that names the ranks missing.

As torch's (gloo-only) version: the group's rank 0 waits for every other member's
arrival key up to ``timeout``; on success it releases them, otherwise it raises naming
the missing ranks (all of them with ``wait_all_ranks=True``, else the first) and tells
the others, who raise too. A missing rank whose process has died is marked as such.
"""

from __future__ import annotations

import time

from jdist.collectives import _engine as eng
from jdist.collectives._group import ProcessGroup, group_state
from jdist.errors import CollectiveTimeoutError

__all__ = ["monitored_barrier"]


def _poll(store, lock, keys, deadline):
    """Wait until ``keys`` exist or ``deadline``; return the missing ones."""
    sleep = 0.001
    while True:
        with lock:
            missing = [k for k in keys if not store.check([k])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.05)


def monitored_barrier(group: ProcessGroup | None = None, timeout=None,
                      wait_all_ranks: bool = False) -> None:
    """Barrier that raises on rank 0 naming the ranks that did not arrive in time.

    Args:
      group: the group (default WORLD).
      timeout: seconds or ``timedelta`` (default: the group's timeout).
      wait_all_ranks: report every missing rank, not only the first.

    Raises:
      CollectiveTimeoutError: on group rank 0, ``"[Rank 0]: Ranks 1, 2 failed to pass
        monitoredBarrier in 2000 ms"``; on the others, that rank 0 reported a failure
        or never released them.
    """
    g = eng.member_group(group, "monitored_barrier")
    seconds = g.timeout if timeout is None else (
        timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout))
    wd = group_state.runtime.get("watchdog")
    store = wd.store if wd is not None else None
    if g.size() == 1 or store is None:
        return
    seq = eng.next_seq(g)
    prefix = f"jdist/mb/{group_state.generation}/{g.name}/{seq}/"
    me = g.ranks[g.rank]
    deadline = time.monotonic() + seconds
    if g.rank == 0:
        keys = [prefix + str(r) for r in g.ranks[1:]]
        missing = _poll(store, wd.lock, keys, deadline)
        if not missing:
            with wd.lock:
                store.set(prefix + "result", "ok")
            return
        ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
        shown = ranks if wait_all_ranks else ranks[:1]
        dead = wd.diagnose(shown, wait=0.0) if wd is not None else {}
        notes = "".join(f" (rank {r} is gone: {dead[r]})" for r in shown if r in dead)
        msg = (f"[Rank {me}]: Ranks {', '.join(map(str, shown))} failed to pass "
               f"monitoredBarrier in {int(seconds * 1000)} ms{notes}")
        with wd.lock:
            store.set(prefix + "result", msg)
        raise CollectiveTimeoutError(msg)
    with wd.lock:
        store.set(prefix + str(me), "1")
    leader = g.ranks[0]
    missing = _poll(store, wd.lock, [prefix + "result"], deadline + 5.0)
    if missing:
        raise CollectiveTimeoutError(
            f"[Rank {me}]: Rank {me} successfully reached monitoredBarrier, but rank "
            f"{leader} did not release it within {seconds:g} s"
        )
    with wd.lock:
        result = store.get(prefix + "result").decode()
    if result != "ok":
        raise CollectiveTimeoutError(
            f"[Rank {me}]: Rank {me} successfully reached monitoredBarrier, but received "
            f"errors while waiting for rank {leader}: {result}"
        )
