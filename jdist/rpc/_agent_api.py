"""The narrow view of an agent that RRefs and this process's agent slot need.

``_rref`` (``RRef``, ``RRefContext``) and ``_state`` talk to the agent only through
:class:`AgentApi`, so neither imports ``_agent`` (which imports them): no import circle,
not even for type annotations. ``RpcAgent`` satisfies it.
"""

from __future__ import annotations

import queue
from typing import Any, Protocol

from jdist.rpc._futures import Future
from jdist.rpc._protocol import WorkerInfo

__all__ = ["AgentApi"]


class AgentApi(Protocol):
    """What an RRef asks of its agent."""

    info: WorkerInfo
    options: Any
    rrefs: Any
    """The agent's ``RRefContext`` (owner table and fork bookkeeping)."""
    released: queue.SimpleQueue
    """RRefs dropped by ``__del__``, released by the agent's control thread."""

    def worker_info(self, to: Any = None) -> WorkerInfo: ...

    def rpc_async(self, to: Any, func: Any, args: Any = None, kwargs: Any = None,
                  timeout: float | None = -1) -> Future: ...

    def remote(self, to: Any, func: Any, args: Any = None, kwargs: Any = None,
               timeout: float | None = -1) -> Any: ...

    def send_control(self, to: int, op: int, rref_id: tuple = (-1, -1),
                     fork: tuple = (-1, -1), parent: int = -1) -> Future: ...

    def control_note(self, to: int, op: int, rref_id: tuple, fork: tuple) -> None: ...
