"""Notes: messages that need no answer of their own, queued per worker.

Released distributed-autograd contexts and the RRef control messages that need no
acknowledgement (``P.NOTE_OPS``) travel in the header of this worker's next call to
their worker, or in a call of their own when none goes there soon (the agent's client
schedules that flush). One job and one lock: the queues.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["Notes"]


class Notes:
    """Per-worker queues of released contexts and control notes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: worker -> contexts released here, not yet told to it
        self.released_to: dict[int, list[int]] = {}
        #: worker -> control notes ``(op, *rref_id, *fork_id)`` for it, not yet sent
        self.controls_to: dict[int, list[tuple]] = {}
        #: worker -> when the oldest of its queued notes (either kind) was queued
        self._since: dict[int, float] = {}

    def add(self, released: bool, to: int, item: Any) -> bool:
        """Queue ``item`` for worker ``to``; True when it is the first one queued there
        (then a flush should be scheduled)."""
        table = self.released_to if released else self.controls_to
        with self._lock:
            first = to not in self._since
            if first:
                self._since[to] = time.monotonic()
            table.setdefault(to, []).append(item)
        return first

    def any(self) -> bool:
        """Whether any note waits (cheap, without the lock: a hint for the hot path)."""
        return bool(self.released_to) or bool(self.controls_to)

    def take(self, to: int) -> tuple[tuple, tuple]:
        """Worker ``to``'s queued ``(released contexts, control notes)``, removed."""
        with self._lock:
            self._since.pop(to, None)
            return (tuple(self.released_to.pop(to, ())), tuple(self.controls_to.pop(to, ())))

    def age(self, to: int) -> float | None:
        """Seconds since worker ``to``'s oldest queued note (None: none queued)."""
        since = self._since.get(to)
        return None if since is None else time.monotonic() - since

    def queued(self, to: int) -> bool:
        with self._lock:
            return bool(self.released_to.get(to) or self.controls_to.get(to))

    def workers(self) -> list[int]:
        with self._lock:
            return sorted(set(self.released_to) | set(self.controls_to))
