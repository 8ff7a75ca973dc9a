"""Whether a thread about to wait for a message should busy-poll for it first.

Busy polling (see docs/design-rpc.md) pays when the message comes within the poll
window: a steady stream of calls then wakes no thread. When it comes much later, the
poll only burns ``busy_poll_us`` of a core, holding the GIL between reads, while the peer
is still working; on a machine with few cores that core is what the peer's computation
(or this process's other threads) needed. A parameter server's forward pass, for
example, takes a millisecond or more, and its trainer's poll for the reply missed every
time.

:class:`PollGate` keeps, per kind of wait (a caller waiting for the reply of one
function from one peer; a pool thread waiting for the next call from a peer after
replying to one function), an exponentially weighted average of how long such waits
lasted: from the start of the wait to the message's arrival, measured whether the wait
polled or not (so a pattern that speeds up is seen again). A wait polls while that
average is at most ``limit`` (a few poll windows: a wait that does not poll also pays
a thread's wake-up, which the next measurement includes). The gate is pure
bookkeeping: no clock, no I/O, no locks (updates race benignly under the GIL: a lost
update only delays learning by one wait); :class:`ReplyWait` is a caller's wait
that asks it.

How long a wait polls (:meth:`PollGate.poll_for`): one window, unless the gate was
given a longer ``longest`` (``busy_poll_max_us``; the agent does so when this machine
has a core for each of its RPC processes, so a spinning thread takes no core that a
peer's computation needs). Then a kind whose waits average up to ``longest / SPAN``
polls for ``SPAN`` times its average (at least one window, at most ``longest``): the
parameter server's trainer catches the reply of a millisecond's forward pass without a
thread's wake-up, as torch's RPC threads, which spin, do.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any, NamedTuple

__all__ = ["MAX_KINDS", "NEXT_SLEEP_S", "PollGate", "ReplyWait", "SPAN", "WAIT_MAX", "WEIGHT",
           "WINDOWS", "WaitFacts", "WaitPlan", "plan_wait"]

WINDOWS = 3.0
"""A wait polls while its kind's average wait is at most this many poll windows."""

SPAN = 2.0
"""With a ``longest`` poll: a wait polls for up to this many times its kind's average."""

WEIGHT = 0.125
"""Weight of the newest wait in the average (about the last eight count)."""

MAX_KINDS = 4096
"""Kinds remembered; past that the table starts over (every kind polls again)."""


class PollGate:
    """Per kind of wait: whether to poll and for how long (:meth:`poll_for`), and how
    long one lasted (:meth:`record`). ``window`` is the poll window in seconds;
    ``longest`` (default: ``window``) the longest poll (see the module docstring)."""

    __slots__ = ("window", "longest", "limit", "_cap", "_waits")

    def __init__(self, window: float, longest: float | None = None) -> None:
        self.window = float(window)
        self._waits: dict[Hashable, float] = {}  # kind -> average wait (seconds)
        self.widen(self.window if longest is None else longest)

    def widen(self, longest: float) -> None:
        """Let waits poll for up to ``longest`` seconds (never less than one window)."""
        self.longest = max(self.window, float(longest))
        #: a kind polls while its average wait is at most this
        self.limit = max(WINDOWS * self.window, self.longest / SPAN)
        self._cap = 4 * self.limit  # one stall must not silence a kind for long

    def poll_for(self, kind: Hashable) -> float:
        """Seconds the next wait of ``kind`` polls (0: none; a kind never seen polls one
        window)."""
        avg = self._waits.get(kind)
        if avg is None:
            return self.window
        if avg > self.limit:
            return 0.0
        return min(self.longest, max(self.window, SPAN * avg))

    def should(self, kind: Hashable) -> bool:
        """Whether the next wait of ``kind`` polls (a kind never seen does)."""
        return self._waits.get(kind, 0.0) <= self.limit

    def record(self, kind: Hashable, waited: float) -> None:
        """A wait of ``kind`` saw its message ``waited`` seconds after it began."""
        sample = min(max(float(waited), 0.0), self._cap)
        avg = self._waits.get(kind)
        if avg is None:
            if len(self._waits) >= MAX_KINDS:
                self._waits.clear()
            self._waits[kind] = sample
        else:
            self._waits[kind] = avg + WEIGHT * (sample - avg)

    def average(self, kind: Hashable) -> float | None:
        """The average wait of ``kind`` in seconds (None: never measured)."""
        return self._waits.get(kind)


WAIT_MAX = 30.0  # seconds a caller reads its reply's connection itself before it waits
NEXT_SLEEP_S = 0.005  # how long a pool thread that replied sleeps for the next call


class WaitFacts(NamedTuple):
    """What a thread about to wait for a message knows (see :func:`plan_wait`).

    Attributes:
      for_reply: a caller waiting for its reply (else a pool thread that replied,
        waiting for the same peer's next call).
      polling_on: ``busy_poll_us > 0`` and the peer runs in another process (one in
        this process needs this process's GIL to answer).
      others_running: other RPC functions run in this process now (polling holds the
        GIL they need).
      lone: the caller's only request in flight; for a pool thread, this process has
        no request of its own in flight.
      poll_for: the seconds the gate allows this kind of wait to poll (0: its
        messages have come late).
      sleep_ok: for a pool thread, such calls have come within ``NEXT_SLEEP_S`` on
        average and no other call of the peer runs here.
    """

    for_reply: bool
    polling_on: bool
    others_running: bool
    lone: bool
    poll_for: float
    sleep_ok: bool = False


class WaitPlan(NamedTuple):
    """Poll the connection for ``poll_s``, then sleep on it for at most ``sleep_s``
    (reading it in this thread, so no other thread is woken); 0 skips a phase."""

    poll_s: float
    sleep_s: float


def plan_wait(f: WaitFacts) -> WaitPlan:
    """The whole poll / sleep / hand-off decision of a waiting thread, in one place.

    A wait that neither polls nor sleeps leaves the message to the I/O thread (a
    hand-off). A caller's reply: poll only as the lone request while nothing else runs
    here, then sleep on the connection until the reply (bounded by ``WAIT_MAX``; the
    caller's timeout bounds it further). A pool thread's next call: poll unless other
    functions run here, then sleep up to ``NEXT_SLEEP_S`` while the gate says such
    calls come soon and nothing else waits on this process."""
    if not f.polling_on:
        return WaitPlan(0.0, 0.0)
    if f.for_reply:
        return WaitPlan(f.poll_for if f.lone and not f.others_running else 0.0, WAIT_MAX)
    return WaitPlan(0.0 if f.others_running else f.poll_for,
                    NEXT_SLEEP_S if f.sleep_ok and f.lone else 0.0)


class ReplyWait:
    """A caller's wait for one reply (a :class:`jdist.rpc._futures.Waiter`): before the
    future blocks it reads the reply's connection in this thread as :func:`plan_wait`
    says, so that no other thread has to be woken to hand the reply over (whatever
    else arrives on that connection meanwhile is delivered from here); the reply's
    arrival is timed for the gate either way."""

    def __init__(self, comm: Any, gate: PollGate, kind: tuple, lone: Any,
                 others_running: Any):
        self.comm, self.gate, self.kind = comm, gate, kind
        self.lone, self.others_running = lone, others_running
        self.began: float | None = None

    def arrived(self, now: float) -> None:
        began, self.began = self.began, None
        if began is not None:  # only a wait that began counts, once
            self.gate.record(self.kind, now - began)

    def before_wait(self, fut: Any, timeout: float | None) -> None:
        self.began = began = time.perf_counter()
        plan = plan_wait(WaitFacts(True, True, self.others_running(), self.lone(),
                                   self.gate.poll_for(self.kind)))
        if plan.poll_s > 0:
            limit = plan.poll_s if timeout is None else min(plan.poll_s, timeout)
            self.comm.poll_until(lambda: fut.done() or self.others_running(), limit)
            if fut.done():
                return
        left = plan.sleep_s if timeout is None else timeout - (time.perf_counter() - began)
        self.comm.wait_until(fut.done, min(left, plan.sleep_s))
