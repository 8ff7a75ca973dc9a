"""Wait for a DDP step with a deadline, naming dead peers instead of hanging.

A step's collectives block while any process of the group is missing. Rather than
blocking blindly, :func:`wait_ready` hands the blocking wait to a daemon thread and waits
for it with a deadline (it returns as soon as the outputs are ready: no polling latency
added to every step); while it waits it asks the process-group watchdog (present after
``init_process_group`` with several processes) whether a member process has died, and
raises :class:`~jdist.errors.PeerFailedError` naming it. Past the group's ``timeout`` it
raises :class:`~jdist.errors.CollectiveTimeoutError` naming the step (the thread stuck on
that step is abandoned; the next wait starts a fresh one).

Short steps (a small model: well under a millisecond of compute and one all-reduce) are
first polled for a little while (``SPIN_S``), yielding the core between polls, where the
host has a core to spare (more usable cores than the job's processes on it,
``jdist/_cores.py``): handing the wait to the thread and being woken by it costs two
thread hand-offs a step. Without a spare core the poll takes the core the peer process
or this step's own threads need: measured on 2 cores and 2 processes (5 x Linear(200,
200), ``benchmarks/ddp.py`` (d)), polling made the median step 3.9 ms instead of 3.5 ms,
and 7.3 ms instead of 5.0 ms with a third busy process (torch: 3.6 / 4.6 ms). A kind
of step (its description without the step number, and its group) is polled while the
average time its steps took to be ready is within the poll's budget, so long steps never
burn a core polling.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import jax

from jdist._cores import local_processes, spare_core
from jdist.errors import CollectiveTimeoutError, PeerFailedError

__all__ = ["wait_ready"]


SPIN_S = 0.002
"""How long a wait polls the step's outputs before handing the wait to the thread."""

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_WEIGHT = 0.125  # weight of the newest wait in a kind's average (about the last eight)
_waits: dict[tuple[str, str], float] = {}  # kind -> average seconds until ready


def _ready(leaves) -> bool:
    return all(x.is_ready() for x in leaves)


def _kind(group: Any, what: str) -> tuple[str, str]:
    return str(getattr(group, "name", "")), what.split(" #")[0]


def _record(kind: tuple[str, str], waited: float) -> None:
    """A wait of ``kind`` saw its outputs ready ``waited`` seconds after it began
    (capped: one stall must not stop a kind's polling for long)."""
    sample = min(waited, 4 * SPIN_S)
    avg = _waits.get(kind)
    if avg is None and len(_waits) >= 256:
        _waits.clear()
    _waits[kind] = sample if avg is None else avg + _WEIGHT * (sample - avg)


def _spin(leaves, kind: tuple[str, str], spare: bool) -> bool:
    """Poll ``leaves`` for up to SPIN_S while ``kind``'s steps are that short and the
    host has a core to spare (``spare``); whether they became ready."""
    if not spare or _waits.get(kind, 0.0) > SPIN_S:
        return False
    end = time.perf_counter() + SPIN_S
    while True:
        _yield()  # the step's own threads (XLA, gloo) may need this core
        if _ready(leaves):
            return True
        if time.perf_counter() >= end:
            return False


class _Waiter:
    """A daemon thread that blocks on arrays and sets an event when they are computed."""

    def __init__(self):
        self.pid = os.getpid()
        self.abandoned = False
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="jdist-ddp-wait", daemon=True).start()

    def _run(self) -> None:
        while not self.abandoned:
            leaves, done = self.requests.get()
            for x in leaves:
                if isinstance(x, jax.Array):
                    try:
                        x.block_until_ready()
                    except Exception as exc:  # noqa: BLE001 - re-raised by wait_ready
                        done.error = exc
                        break
                else:  # anything else with is_ready(): poll it
                    while not self.abandoned and not x.is_ready():
                        time.sleep(1e-3)
            done.set()

    def submit(self, leaves) -> threading.Event:
        done = threading.Event()
        done.error = None  # the runtime error the wait ended with, if any
        self.requests.put((leaves, done))
        return done


_waiter: _Waiter | None = None


def _start_wait(leaves) -> threading.Event:
    global _waiter
    if _waiter is None or _waiter.pid != os.getpid():  # none yet, or inherited by a fork
        _waiter = _Waiter()
    return _waiter.submit(leaves)


def _abandon_waiter() -> None:
    global _waiter
    if _waiter is not None:
        _waiter.abandoned = True  # it is stuck on a step that will not finish
    _waiter = None


def wait_ready(out: Any, group: Any, what: str, *, watchdog: Any = None,
               check_every: float = 2.0, timeout: float | None = None,
               seq: int | None = None) -> None:
    """Return once every array in ``out`` is computed.

    Args:
      out: a pytree of arrays (a step's outputs).
      group: the ``ProcessGroup`` the step communicates over (``ranks``, ``timeout``).
      what: a description of the step for error messages.
      watchdog: the runtime's watchdog (``diagnose(ranks, wait)``), or None.
      check_every: seconds between dead-peer checks.
      timeout: seconds before giving up (default ``group.timeout``).
      seq: the step's number on the group (``_engine.enter_step``): a timeout names the
        members that have not entered it.

    Raises:
      PeerFailedError: the watchdog found member processes dead (named, with reasons),
        also when the runtime failed the step's collectives first (see
        :func:`runtime_failure`).
      CollectiveTimeoutError: not done after ``timeout`` seconds.
    """
    leaves = [x for x in jax.tree.leaves(out) if hasattr(x, "is_ready")]
    kind, began = _kind(group, what), time.perf_counter()
    try:
        if _ready(leaves) or _spin(leaves, kind, spare_core(local_processes(
                len(getattr(group, "ranks", ())) or 1))):
            _record(kind, time.perf_counter() - began)
            jax.block_until_ready(leaves)  # raises the runtime error of a failed step
            return
    except Exception as exc:
        err = runtime_failure(group, what, exc, seq)
        if err is exc:
            raise
        raise err from exc
    limit = float(group.timeout if timeout is None else timeout)
    start = time.monotonic()
    next_check = start + check_every
    done = _start_wait(leaves)
    while not done.wait(max(0.0, min(next_check, start + limit) - time.monotonic())):
        now = time.monotonic()
        if watchdog is not None and now >= next_check and len(group.ranks) > 1:
            dead = watchdog.diagnose(list(group.ranks), wait=0.0)
            if dead:
                _abandon_waiter()
                who = "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items()))
                raise PeerFailedError(
                    f"{what} cannot finish: {who}. Look at that rank's own error first; "
                    "the surviving processes must be restarted (jdist-run --max-restarts)")
        if now >= next_check:
            next_check = now + check_every
        if now - start > limit:
            _abandon_waiter()
            raise CollectiveTimeoutError(
                f"{what} did not finish within {limit:g} s (group {group.name!r}, ranks "
                f"{list(group.ranks)}): {_behind(group, seq)}. Give "
                "every process the same number of steps (or use ddp.join() for uneven "
                "inputs), or raise init_process_group(timeout=...)")
    _record(kind, time.perf_counter() - began)
    if done.error is not None:
        err = runtime_failure(group, what, done.error, seq)
        if err is done.error:
            raise err
        raise err from done.error


def _behind(group: Any, seq: int | None) -> str:
    from jdist.collectives.runtime import behind_text

    return behind_text(group, seq, step=True) or "some process is not running the same step"


def runtime_failure(group: Any, what: str, exc: BaseException,
                    seq: int | None = None) -> BaseException:
    """The error to raise for ``exc``, raised by the runtime while running a step.

    A failed collective (gloo's "Connection closed by peer", a reset connection) becomes
    :class:`~jdist.errors.PeerFailedError` naming the dead rank, found by the
    process-group watchdog as for the eager collectives (or
    :class:`~jdist.errors.CollectiveTimeoutError` for a gloo timeout); any other error
    is returned unchanged.
    """
    from jdist.collectives.runtime import group_state, is_runtime_failure, peer_failure

    if not is_runtime_failure(exc):
        return exc
    if (group_state.runtime or {}).get("watchdog") is None:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return PeerFailedError(
            f"{what} on group {group.name!r} failed in the runtime: {first}. A peer process "
            "probably died; without init_process_group's watchdog it cannot be named. "
            "Look at the other ranks' own errors first")
    return peer_failure(group, what, exc, seq, step=True)
