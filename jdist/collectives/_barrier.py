"""``barrier``: every member arrives (bounded by the group timeout), then one collective.

Arrival goes through the job's store first: each member adds itself to a counter and
polls it until all are there or the group's timeout (``new_group(timeout=)``, else
``init_process_group(timeout=)``) has passed, then raises
:class:`~jdist.errors.CollectiveTimeoutError` naming the ranks that did not arrive and
where they are. XLA's collectives have one process-wide timeout, so a group with a
shorter one could not otherwise be honoured. Once all have arrived, the members
all-gather their fingerprints (one tiny collective), so a rank that reached the barrier
from a different sequence of collectives is reported as a mismatch; so is a member
found (through its heartbeat) inside another collective with the barrier's number: the
wait stops and the fingerprint check meets that collective, so both sides raise
:class:`~jdist.errors.CollectiveMismatchError` within about a heartbeat interval.

Keys: ``jdist/bar/<generation>/<group>/<seq>/{n,<rank>}``. After passing a barrier each
member deletes its own keys of the group's previous barrier (every member has left it
by then), and group rank 0 its counter, so the store holds at most two barriers' keys.
"""

from __future__ import annotations

import time

from jdist.collectives import _engine as eng
from jdist.collectives._eager import _fp, dispatch
from jdist.collectives._group import ProcessGroup, group_state, timeout_seconds
from jdist.errors import CollectiveTimeoutError, PeerFailedError, StoreError

__all__ = ["barrier"]


def _whereabouts(wd, g: ProcessGroup, seq: int, missing: list[int]) -> dict[int, str]:
    """Why each missing rank is not at barrier ``seq``, from heartbeats and pids."""
    dead = wd.diagnose(missing, wait=0.0)
    at = wd.positions(missing, g.name)
    out = {}
    for r in missing:
        pos = at.get(r)
        if r in dead:
            out[r] = f"is gone ({dead[r]})"
        elif pos is None:
            out[r] = "has not called any collective on this group"
        elif pos[0] < seq:
            out[r] = f"is still at collective #{pos[0]} ({pos[1]})"
        elif pos[0] == seq and pos[1] != "barrier":
            out[r] = (f"called {pos[1]} as collective #{seq} instead of barrier: the ranks "
                      f"called different collectives")
        else:
            out[r] = "had not published its position yet"
    return out


def _missing(wd, g: ProcessGroup, prefix: str) -> list[int]:
    with wd.lock:
        return [r for r in g.ranks if not wd.store.check([prefix + str(r)])]


def _look(wd, g: ProcessGroup, seq: int, prefix: str) -> bool:
    """While waiting: raise if a missing member's process is gone; True if a missing
    member published collective ``seq`` as another collective (so the fingerprint check,
    not the timeout, should report it)."""
    missing = _missing(wd, g, prefix)
    dead = wd.diagnose(missing, wait=0.0)
    if dead:
        who = "; ".join(f"rank {r} is gone ({why})" for r, why in sorted(dead.items()))
        raise PeerFailedError(f"barrier on group {g.name!r} cannot complete: {who}. Look at "
                              f"that rank's own error first")
    return any(pos is not None and pos[0] == seq and pos[1] != "barrier"
               for pos in wd.positions(missing, g.name).values())


def _arrive(g: ProcessGroup, seq: int, seconds: float) -> bool:
    """Count this member in at barrier ``seq``; wait for the others up to ``seconds``.

    Returns False early when a missing member is inside another collective numbered
    ``seq``: the caller then runs the fingerprint check, which meets that member's
    collective and raises ``CollectiveMismatchError`` on both sides.
    """
    wd = group_state.runtime.get("watchdog")
    if wd is None or g.size() == 1:
        return True
    store, lock = wd.store, wd.lock
    base = f"jdist/bar/{group_state.generation}/{g.name}/"
    prefix, me, n = f"{base}{seq}/", g.ranks[g.rank], g.size()
    with lock:
        store.set(prefix + str(me), "1")
        count = store.add(prefix + "n", 1)
    deadline = time.monotonic() + seconds
    pause, look = 0.0005, time.monotonic() + wd.interval
    while count < n:
        if time.monotonic() > look:  # heartbeats publish positions once per interval
            look = time.monotonic() + wd.interval
            if _look(wd, g, seq, prefix):
                return False
        if time.monotonic() > deadline:
            missing = _missing(wd, g, prefix)
            about = "; ".join(f"rank {r} {why}"
                              for r, why in _whereabouts(wd, g, seq, missing).items())
            raise CollectiveTimeoutError(
                f"[Rank {me}]: barrier (collective #{seq}) on group {g.name!r}: Timed out "
                f"waiting {int(seconds * 1000)}ms for ranks {missing}, which did not reach "
                f"it ({about}). Make every member call barrier, or raise the timeout "
                f"(barrier(timeout=), new_group(timeout=), init_process_group(timeout=))")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
        with lock:
            count = store.add(prefix + "n", 0)
    last = g.extra.get("last_barrier")
    g.extra["last_barrier"] = seq
    if last is not None:
        with lock:
            store.delete_key(f"{base}{last}/{me}")
            if g.rank == 0:
                store.delete_key(f"{base}{last}/n")
    return True


def _store_lost(g: ProcessGroup, exc: BaseException) -> PeerFailedError:
    wd = group_state.runtime["watchdog"]
    dead = wd.diagnose(g.ranks, wait=0.0)
    host = wd.store_host_rank
    if host is not None and host != wd.rank:
        dead.setdefault(host, "the store it hosts is unreachable")
    who = "; ".join(f"rank {r} is gone ({why})" for r, why in sorted(dead.items()))
    return PeerFailedError(f"barrier on group {g.name!r} lost the job's store: "
                           f"{who or 'no dead rank found'}. Look at that rank's own error "
                           f"first. (store error: {exc})")


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids=None,
            timeout=None):
    """Block until every member reaches the barrier, at most the group's timeout.

    Args:
      group: the group (default WORLD); on ``NON_GROUP_MEMBER`` it warns and returns
        None, as in torch.
      async_op: return a ``Work`` instead of waiting.
      device_ids: accepted for torch's signature (no effect).
      timeout: seconds or ``timedelta`` for this call (default: the group's timeout).

    Raises:
      CollectiveTimeoutError (a ``RuntimeError``): some members did not arrive in time;
        names them and the collective each was last in.
      CollectiveMismatchError: members reached it from different collective sequences.
      PeerFailedError: a member that did not arrive has died (found on its host).
    """
    del device_ids
    g = eng.member_group(group, "barrier")
    if g is None:
        return None
    seconds = timeout_seconds(timeout, g.timeout, "barrier")

    def fn():
        fp = _fp(g, "barrier")
        seq = int(fp[1])
        eng.note(g, seq, "barrier")
        try:
            _arrive(g, seq, seconds)
        except StoreError as exc:  # the store's host is gone (or unreachable)
            raise _store_lost(g, exc) from exc
        eng.fingerprint_check(g, "barrier", fp)

    return dispatch(g, "barrier", fn, async_op)
