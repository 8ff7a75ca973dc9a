"""This process's RPC agent: the one global that ``init_rpc`` sets and ``shutdown`` clears.

Kept apart from ``_api`` so that lower modules (``_rref``'s ``RRef(value)``) can find the
agent without importing the public functions (which import the agent: a circle).
"""

from __future__ import annotations

import threading
from typing import Any

from jdist.errors import NotInitializedError
from jdist.rpc._agent_api import AgentApi

__all__ = ["state", "current_agent"]


class _RpcState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.agent: AgentApi | None = None
        self.store: Any = None
        self.owns_store = False
        self.generation = 0


state = _RpcState()


def current_agent() -> AgentApi:
    """This process's agent.

    Raises:
      NotInitializedError: ``init_rpc`` has not run (or ``shutdown`` has).
    """
    agent = state.agent
    if agent is None:
        raise NotInitializedError("RPC has not been initialized: call "
                                  "jdist.rpc.init_rpc(name, rank=, world_size=) first")
    return agent
