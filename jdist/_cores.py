"""How many CPU cores this process may use, and how many of the job's processes share
them: whether a thread that busy-waits takes a core another process needs.

Busy-waiting (polling a step's outputs, an RPC connection) saves a thread's wake-up when
a core is spare; on a machine with no more cores than the job's processes here, the
spinning thread takes the core a peer computes on, and every wait gets slower (measured:
``benchmarks/ddp.py`` (d), ``docs/benchmarks.md``). Used by DDP's step wait
(``jdist/ddp/_wait.py``) and the RPC agent's poll gate.
"""

from __future__ import annotations

import os

__all__ = ["local_processes", "spare_core", "usable_cores"]


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_processes(default: int = 1) -> int:
    """The job's processes on this host: ``LOCAL_WORLD_SIZE`` (set by ``jdist-run``,
    ``torchrun`` and ``jdist.launch.spawn``), else ``default``."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", default)))
    except ValueError:
        return max(1, default)


def spare_core(processes: int) -> bool:
    """Whether this host has more usable cores than ``processes`` (one left for a
    thread that spins)."""
    return usable_cores() > processes
