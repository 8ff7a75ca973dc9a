"""What a replica heals from a live peer: named pytrees, each with its getter and
loader (the manager's step and lineage, the model, the optimizer, the sampler).

``frames()`` packs every registered value for a replica that joins; ``load(frames)``
rebuilds them against this replica's own values (same structure, dtypes and shapes,
else :class:`~jdist.errors.FtError`) and hands each to its loader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jdist.errors import FtError
from jdist.ft._state import pack, unpack

__all__ = ["Registry"]


class Registry:
    """The named state a replica sends when it is a healing source, and loads when it
    heals."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}

    def register(self, name: str, get: Callable[[], Any],
                 load: Callable[[Any], None]) -> None:
        if name in self._items:
            raise FtError(f"state {name!r} is registered twice on this Manager")
        self._items[name] = (get, load)

    def _values(self) -> dict[str, Any]:
        return {n: get() for n, (get, _) in self._items.items()}

    def frames(self) -> list:
        """Every registered value, packed for a peer."""
        return pack(self._values())

    def load(self, frames, who: str) -> None:
        """Load the values packed by ``who`` (checked against this replica's own)."""
        state = unpack(frames, self._values(), who)
        for n, (_, load) in self._items.items():
            load(state[n])
