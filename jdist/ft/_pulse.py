"""Heartbeats of the replicas, who is alive, and where a silent replica stands.

One daemon thread per replica, on its own store connection, every ``interval``:
bumps ``hb/<id>``, publishes ``where/<id>`` (pid, host, committed step, the operation
the replica is in, its main thread's Python stack) and reads every replica's counter;
then runs the latest chore handed to :meth:`Pulse.later` (store housekeeping that must
not cost a training step its round trips).
A replica whose counter did not move for ``timeout`` seconds, as this thread's own
reads show, is not live: it died, or it is stopped (``SIGSTOP``, a debugger) or hung
holding the GIL. (Measured by this thread's reads, not the clock: an observer starved
of CPU does not mistake its own silence for the others'.)
:meth:`Pulse.report` turns a replica's last ``where`` into one line for a human.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from jdist.collectives.runtime import main_stack, process_state
from jdist.errors import StoreError
from jdist.store import Store

__all__ = ["Pulse"]


class Pulse:
    """The heartbeat thread of replica ``replica`` among ids ``0 .. world_size-1``."""

    def __init__(self, store: Store, replica: int, incarnation: int, world_size: int,
                 interval: float, timeout: float, stacks: bool = True):
        self._store, self.replica, self.world_size = store, replica, world_size
        self.incarnation = incarnation
        self.interval, self.timeout, self._stacks = interval, timeout, stacks
        # (id, incarnation) -> (counter, when it moved)
        self._seen: dict[tuple[int, int], tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._where = {"pid": os.getpid(), "host": socket.gethostname(), "step": 0,
                       "op": "starting"}
        self._stop = threading.Event()
        self._chore: Callable[[Store], None] | None = None
        self._started = self._last_read = time.monotonic()
        store.set(f"inc/{replica}", str(incarnation))
        self._beat()
        self._thread = threading.Thread(target=self._run, name="jdist-ft-pulse", daemon=True)
        self._thread.start()

    def enter(self, step: int, op: str) -> None:
        """Record that this replica is now in ``op`` at committed step ``step``."""
        with self._lock:
            self._where.update(step=step, op=op)

    def _beat(self) -> None:
        with self._lock:
            where = dict(self._where)
        if self._stacks:
            where["stack"] = main_stack()
        self._store.set(f"where/{self.replica}", json.dumps(where))
        self._store.add(f"hb/{self.replica}/{self.incarnation}", 1)
        now = time.monotonic()
        for r in range(self.world_size):
            if not self._store.check([f"inc/{r}"]):
                continue
            who = (r, int(self._store.get(f"inc/{r}")))
            value = self._store.add(f"hb/{who[0]}/{who[1]}", 0)
            with self._lock:
                old = self._seen.get(who)
                if value and (old is None or old[0] != value):
                    self._seen[who] = (value, now)
        with self._lock:
            self._last_read = time.monotonic()

    def later(self, chore: Callable[[Store], None]) -> None:
        """Run ``chore(store)`` on this thread's connection after the next beat (it
        replaces a chore not run yet: give one that does all that is due)."""
        with self._lock:
            self._chore = chore

    def _run(self) -> None:
        said = False
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                with self._lock:
                    chore, self._chore = self._chore, None
                if chore is not None:
                    chore(self._store)
            except Exception as e:  # noqa: BLE001 (a heartbeat must outlive any error)
                if self._stop.is_set():
                    return
                if not isinstance(e, StoreError | OSError) and not said:
                    said = True
                    print(f"jdist.ft: replica {self.replica}'s heartbeat: {e!r}",
                          file=sys.stderr)

    def vouch(self, replica: int, incarnation: int) -> None:
        """Count that incarnation as alive now (it just joined a round: fresher news
        than a heartbeat read up to ``interval`` ago)."""
        with self._lock:
            old = self._seen.get((replica, incarnation), (0, 0.0))
            self._seen[(replica, incarnation)] = (old[0], time.monotonic())

    def _fresh(self, moved: float) -> bool:
        """Whether a counter that last moved at ``moved`` counts as beating: stale only
        once this pulse has *read* it ``timeout`` seconds after that, so an observer
        whose own thread was starved (a loaded machine) does not declare others dead."""
        return self._last_read - moved <= self.timeout

    def alive(self, replica: int, incarnation: int) -> bool:
        """Whether that incarnation of ``replica`` beats (or was vouched for lately)."""
        if (replica, incarnation) == (self.replica, self.incarnation):
            return True
        with self._lock:
            seen = self._seen.get((replica, incarnation))
            return seen is not None and self._fresh(seen[1])

    def live(self) -> set[int]:
        """Replicas with some live incarnation (see :meth:`alive`), and, during this
        pulse's first ``timeout`` seconds, those not seen yet (still starting)."""
        with self._lock:
            seen = {r for (r, _), (_, t) in self._seen.items() if self._fresh(t)}
            if time.monotonic() - self._started <= self.timeout:
                seen |= set(range(self.world_size)) - {r for r, _ in self._seen}
        return seen | {self.replica}

    def report(self, replica: int, waiting_for: str) -> str:
        """One line (plus its stack) on ``replica``: pid, process state, step, op."""
        try:
            where = json.loads(self._store.get(f"where/{replica}"))
        except (StoreError, OSError, ValueError):
            return f"replica {replica} ({waiting_for}): it never published where it is"
        state = ""
        if where.get("host") == socket.gethostname():
            letter = process_state(int(where["pid"]))
            state = {"T": ", process is stopped (SIGSTOP?)", "t": ", process is traced",
                     "": ", process is gone", "Z": ", process is gone"}.get(letter, "")
        text = (f"replica {replica} (pid {where.get('pid')}{state}) is at step "
                f"{where.get('step')} in {where.get('op')!r}; it has not entered "
                f"{waiting_for}")
        stack = where.get("stack")
        if stack:
            text += "; its last published stack:\n" + stack.rstrip()
        return text

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.interval + 1.0)
