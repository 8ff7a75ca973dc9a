"""How many connections may be authenticating at once, and how loudly refusals are logged.

A connection costs memory from its first byte (the socket, the reader's staging buffer,
the handshake's state) until it authenticates or is dropped after the handshake
timeout. ``HandshakeGate`` keeps at most ``limit`` connections in that state: a new one
beyond it closes the *oldest* one still authenticating, so a flood of connections that
never speak cannot lock out a peer, whose handshake takes milliseconds. Refusals (wrong
secret, garbage, timeouts, evictions) are logged at most once per ``interval`` seconds,
the next line saying how many were left out: a flood cannot flood the log either.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["HandshakeGate", "MAX_HANDSHAKES"]

MAX_HANDSHAKES = 64


class HandshakeGate:
    """Counts connections being authenticated; rate-limits the refusal warnings."""

    def __init__(self, who: str, log: logging.Logger, limit: int = MAX_HANDSHAKES,
                 interval: float = 10.0):
        self.who, self.log, self.limit, self.interval = who, log, int(limit), interval
        self._pending: dict[int, object] = {}  # id -> connection, oldest first
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._quiet = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def admit(self, comm) -> None:
        """Count ``comm`` as authenticating; over the limit, close the oldest one."""
        with self._lock:
            self._pending[id(comm)] = comm
            oldest = None
            if len(self._pending) > self.limit:
                oldest = self._pending.pop(next(iter(self._pending)))
        if oldest is not None:
            self.refused(f"{self.limit} connections were authenticating: the oldest was "
                         "closed")
            oldest.close()

    def release(self, comm) -> None:
        """``comm`` authenticated or was dropped."""
        with self._lock:
            self._pending.pop(id(comm), None)

    def refused(self, why: str) -> None:
        """Log a refused connection, or count it when one was logged recently."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval:
                self._quiet += 1
                return
            quiet, self._quiet, self._last = self._quiet, 0, now
        more = f" ({quiet} more refused since the last report)" if quiet else ""
        self.log.warning("jdist.rpc: %s refused a connection: %s%s", self.who, why, more)
