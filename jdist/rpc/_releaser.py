"""The RRef releaser: one thread that handles the RRefs dropped by ``RRef.__del__``.

``__del__`` may run anywhere (inside a lock, in the garbage collector), so it only puts
an item on :attr:`Releaser.queue` (``SimpleQueue.put`` is reentrant-safe); this thread
then releases an owner's value (``("owner", rref_id)``) or queues the ``USER_DELETE``
note to the owner of a user RRef (``("user", owner, rref_id, fork)``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Releaser"]

log = logging.getLogger("jdist.rpc")


class Releaser:
    """The release queue and its thread."""

    def __init__(self, name: str, release_owned: Callable[[Any], None],
                 tell_owner: Callable[[int, tuple, tuple], None],
                 running: Callable[[], bool]):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._release_owned, self._tell_owner, self._running = (release_owned, tell_owner,
                                                                running)
        self._working = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"jdist-rpc-release-{name}")

    def start(self) -> None:
        self._thread.start()

    def busy(self) -> bool:
        """Whether a release is queued or being handled."""
        return self._working or not self.queue.empty()

    def stop(self, timeout: float = 5.0) -> None:
        self.queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            self._working = True
            try:
                if item[0] == "owner":
                    self._release_owned(item[1])
                elif self._running():
                    _, owner, rref_id, fork = item
                    self._tell_owner(owner, rref_id, fork)
            except Exception:
                log.debug("jdist.rpc: RRef release failed", exc_info=True)
            finally:
                del item
                self._working = not self.queue.empty()
