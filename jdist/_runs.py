"""Consecutive runs of items under a size limit (plain Python, floor 0).

The grouping that bounds a phase's temporary memory: DDP's init sync broadcasts the
model in runs of leaves (``jdist/ddp/_sync.py``), ZeRO reduce-scatters and all-gathers
in runs of leaves (``jdist/optim/_zero_comm.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["consecutive"]


def consecutive(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Positions ``0..len(sizes)-1`` in order, cut into runs whose sizes sum to at most
    ``limit``; an item bigger than ``limit`` makes a run of its own."""
    runs: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if runs and used + size <= limit:
            runs[-1].append(i)
            used += size
        else:
            runs.append([i])
            used = size
    return runs
