"""The worker table: rank -> ``WorkerInfo`` and address, set once by the rendezvous.

One job: resolve what a caller names as a destination (a name, a rank or a
``WorkerInfo``) with torch's error types and texts. Written once (``install``) before
the agent dispatches any message, read without a lock afterwards.
"""

from __future__ import annotations

from typing import Any

from jdist.errors import UnknownWorkerError
from jdist.rpc._protocol import WorkerInfo

__all__ = ["WorkerTable"]


class WorkerTable:
    """The job's workers as this agent knows them."""

    def __init__(self, me: WorkerInfo, world_size: int):
        self.me, self.world_size = me, world_size
        self.by_rank: dict[int, WorkerInfo] = {}
        self.by_name: dict[str, WorkerInfo] = {}
        self.addresses: dict[int, str] = {}

    def install(self, table: dict[int, tuple[str, str]]) -> None:
        """The rendezvous result: rank -> (name, address)."""
        for rank, (name, address) in table.items():
            info = WorkerInfo(rank, name)
            self.by_rank[rank] = info
            self.by_name[name] = info
            self.addresses[rank] = address

    def __contains__(self, rank: int) -> bool:
        return rank in self.by_rank

    def __bool__(self) -> bool:
        return bool(self.by_rank)

    def __getitem__(self, rank: int) -> WorkerInfo:
        return self.by_rank[rank]

    def get(self, rank: int) -> WorkerInfo | None:
        return self.by_rank.get(rank)

    def all(self) -> list[WorkerInfo]:
        return [self.by_rank[r] for r in sorted(self.by_rank)]

    def resolve(self, to: Any = None) -> WorkerInfo:
        """Resolve a worker name, rank or WorkerInfo (None: this worker).

        Raises:
          UnknownWorkerError: unknown name, rank or WorkerInfo (a RuntimeError and a
            ValueError, with torch's "could not find destination"; the message lists the
            known ones).
          ValueError: ``to`` is none of those types (torch's type).
        """
        if to is None:
            return self.me
        if isinstance(to, WorkerInfo):
            if self.by_rank.get(to.id) != to:
                raise UnknownWorkerError(f"could not find destination {to!r}: unknown worker; "
                                         f"known: {sorted(self.by_rank.values())}")
            return to
        if isinstance(to, str):
            info = self.by_name.get(to)
            if info is None:
                raise UnknownWorkerError(f"could not find destination: unknown worker name "
                                         f"{to!r}; known: {sorted(self.by_name)}")
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self.by_rank.get(to)
            if info is None:
                raise UnknownWorkerError(f"could not find destination: unknown worker rank "
                                         f"{to}; ranks are 0..{self.world_size - 1}")
            return info
        raise ValueError(f"Cannot get WorkerInfo from name {to!r}: `to` must be a worker "
                         "name, rank or WorkerInfo")
