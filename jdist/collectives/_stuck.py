"""The stuck-rank deadline: a collective or compiled step that waits longer than
``stuck_timeout`` for a rank that never entered it ends every rank of the job.

Off unless asked for (``init_process_group(stuck_timeout=)`` or ``JDIST_STUCK_TIMEOUT``
seconds): the deadline must exceed the longest legitimate gap between ranks (one rank
saving a checkpoint while the others wait in a barrier). Without it the group timeout
applies, and a waiting collective raises there, naming the same ranks.

The check runs on the heartbeat thread (``jdist/collectives/_watchdog.py``) after each
beat, so it fires even when the main thread is blocked inside XLA (where a compiled
step's collective can neither be interrupted nor time out on every backend):

1. A channel (a group's collectives, or its compiled steps) whose last entered number
   has not changed for ``stuck_timeout`` seconds has its members' published positions
   read; the members behind this rank's number are the stuck ones. (Every member of a
   group runs the same sequence, so a member behind this rank means this rank is still
   waiting in that call: a call completes only once every member entered it.) A
   published position may be a beat old, so a member counts as stuck only once a
   position it published after the deadline still shows it behind (its heartbeat
   counter moved twice since), or once it has not beaten for three intervals. An
   asynchronous call (``isend``, ``async_op=True``) starts the clock too: the deadline
   must exceed the longest legitimate gap between ranks, async ones included.
2. The first rank that sees it writes one message to the store (who is stuck, where,
   and the stack its heartbeat last published; whether its process is stopped) and
   prints it. Every other rank's heartbeat finds the message at its next beat and
   prints it: the stuck rank too, when its heartbeat thread can still run (a rank
   stopped with ``SIGSTOP`` cannot, and is ended by its launcher when the others
   exit). Each rank exits with :data:`STUCK_EXIT_CODE` once every rank counted itself
   as having the message, or three beats later (so that rank 0, which hosts the store
   and JAX's coordinator, does not leave before the others have read it; it leaves
   last). Meanwhile a collective that fails because a peer already left parks its
   thread (:func:`park_if_ending`) rather than raise an error over the message. Guarded by
   ``tests/collectives/test_stuck_deadline.py``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

__all__ = ["ENDING", "STUCK_EXIT_CODE", "StuckDeadline", "park_if_ending",
           "stuck_timeout_from"]

STUCK_EXIT_CODE = 124  # (timeout(1)'s)
ENV = "JDIST_STUCK_TIMEOUT"
ENDING = threading.Event()  # set once this process is ending the job
_PARK_S = 60.0


def park_if_ending() -> None:
    """Called where a runtime failure becomes an error: while the deadline ends the
    job, a peer that exits first breaks this rank's collective; the main thread then
    waits for the heartbeat's exit (code 124, the one message) instead of raising its
    own error over it (it raises after a minute if the exit never comes)."""
    if ENDING.is_set():
        time.sleep(_PARK_S)


def stuck_timeout_from(value, environ: Mapping[str, str]) -> float | None:
    """The deadline in seconds: ``value`` if given, else ``$JDIST_STUCK_TIMEOUT``, else
    None (off). Raises ValueError naming the bad value."""
    source = "stuck_timeout"
    if value is None:
        value, source = environ.get(ENV) or None, ENV
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{source}={value!r}: give the stuck-rank deadline as a positive "
                         f"number of seconds, or leave it unset (no deadline)")
    return seconds


class StuckDeadline:
    """The deadline check of one process's heartbeat (see the module text).

    Args:
      watchdog: the process's :class:`~jdist.collectives._watchdog.Watchdog`.
      seconds: the deadline.
      exit: called with the exit code after the message is out (``os._exit``).
      linger: at most how long to wait for the others to have the message (default
        three beats and half a second).
    """

    def __init__(self, watchdog, seconds: float,
                 exit: Callable[[int], None] = os._exit, linger: float | None = None) -> None:
        self.wd, self.seconds, self._exit = watchdog, float(seconds), exit
        self.linger = 3 * watchdog.interval + 0.5 if linger is None else float(linger)
        self._pending: dict[str, tuple[int, float, dict[int, int]]] = {}  # first sightings
        self.key = watchdog.prefix + "stuck"

    def check(self) -> None:
        """Exit if another rank found a stuck one, or if this rank finds one now."""
        try:
            with self.wd.lock:
                found = self.wd.store.get(self.key) if self.wd.store.check([self.key]) else None
        except Exception:  # the store may be gone: the collective's own error says why
            return
        if found is not None:
            self._end(found.decode(errors="replace"))
            return
        now, calls = time.monotonic(), self.wd.waits()
        for channel in [c for c, p in self._pending.items() if calls.get(c, (None,))[0] != p[0]]:
            del self._pending[channel]  # (this rank moved on)
        for channel, (seq, what, since, ranks) in calls.items():
            if now - since < self.seconds:
                continue
            noun = "step" if channel.endswith("#steps") else "collective"
            late = self.wd.behind(ranks, channel, seq, noun)  # {rank: where it is}
            if late and self._confirmed(channel, seq, sorted(late), now):
                self._end(self._message(channel, seq, what, now - since, noun, late))
                return
            if not late:
                self._pending.pop(channel, None)

    def _confirmed(self, channel: str, seq: int, late: list[int], now: float) -> bool:
        """Whether every rank in ``late`` is still behind by a position it published
        after the deadline passed (its heartbeat counter moved twice since: a beat
        publishes after counting), or has not beaten for three intervals (stopped,
        hung). A position read once may be up to a beat old: a rank that arrived just
        before the deadline must not end the job."""
        counters = self.wd.counters(late)
        if counters is None:
            return False
        first = self._pending.get(channel)
        if first is None or first[0] != seq:
            self._pending[channel] = (seq, now, counters)
            return False
        _, seen_at, before = first
        silent = now - seen_at >= 3 * self.wd.interval
        return all(counters[r] >= before.get(r, counters[r]) + 2
                   or (silent and counters[r] == before.get(r)) for r in late)

    def _message(self, channel: str, seq: int, what: str, waited: float, noun: str,
                 late: dict[int, str]) -> str:
        group = channel.removesuffix("#steps")
        named = "\n; ".join(f"rank {r}, which {where}".rstrip()
                            for r, where in sorted(late.items()))
        text = (f"stuck rank: rank {self.wd.rank} waited {waited:.1f} s (the stuck-rank "
                f"deadline, {ENV}={self.seconds:g}) in {noun} #{seq} ({what}) on group "
                f"{group!r} for {named}\nEvery rank of the job exits (code "
                f"{STUCK_EXIT_CODE}); look at where that rank was")
        try:
            with self.wd.lock:
                self.wd.store.compare_set(self.key, "", text)
                text = self.wd.store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001 (exit with this rank's own message)
            pass
        return text

    def _end(self, message: str) -> None:
        """Print ``message`` and exit, once every rank said it has the message too or
        after three beats (a stopped rank never says so): a rank that left at once
        could take the store (and JAX's coordinator, on rank 0) with it before the
        others read the message."""
        ENDING.set()
        print(f"jdist: {message}", file=sys.stderr, flush=True)
        world, end = len(self.wd.infos), time.monotonic() + self.linger
        try:
            with self.wd.lock:
                seen = int(self.wd.store.add(self.key + "/seen", 1))
            while seen < world and time.monotonic() < end:
                time.sleep(min(0.05, self.wd.interval))
                with self.wd.lock:
                    seen = int(self.wd.store.add(self.key + "/seen", 0))
        except Exception:  # noqa: BLE001 (the store is gone: nobody is left to wait for)
            pass
        if self.wd.rank == self.wd.store_host_rank:  # the store's (and JAX's coordinator's)
            time.sleep(min(self.linger, 0.3))  # host leaves last
        self._exit(STUCK_EXIT_CODE)
