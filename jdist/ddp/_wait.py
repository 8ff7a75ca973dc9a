"""Wait for a DDP step with a deadline, naming dead peers instead of hanging.

A step's collectives block while any process of the group is missing. Rather than
blocking blindly, :func:`wait_ready` polls the step's outputs; while it waits it asks the
process-group watchdog (present after ``init_process_group`` with several processes)
whether a member process has died, and raises :class:`~jdist.errors.PeerFailedError`
naming it. Past the group's ``timeout`` it raises
:class:`~jdist.errors.CollectiveTimeoutError` naming the step.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from jdist.errors import CollectiveTimeoutError, PeerFailedError

__all__ = ["wait_ready"]


def _ready(leaves) -> bool:
    return all(x.is_ready() for x in leaves)


def wait_ready(out: Any, group: Any, what: str, *, watchdog: Any = None,
               check_every: float = 2.0, timeout: float | None = None) -> None:
    """Return once every array in ``out`` is computed.

    Args:
      out: a pytree of arrays (a step's outputs).
      group: the ``ProcessGroup`` the step communicates over (``ranks``, ``timeout``).
      what: a description of the step for error messages.
      watchdog: the runtime's watchdog (``diagnose(ranks, wait)``), or None.
      check_every: seconds between dead-peer checks.
      timeout: seconds before giving up (default ``group.timeout``).

    Raises:
      PeerFailedError: the watchdog found member processes dead (named, with reasons).
      CollectiveTimeoutError: not done after ``timeout`` seconds.
    """
    leaves = [x for x in jax.tree.leaves(out) if hasattr(x, "is_ready")]
    if _ready(leaves):
        return
    limit = float(group.timeout if timeout is None else timeout)
    start = time.monotonic()
    next_check = start + check_every
    pause = 1e-4
    while not _ready(leaves):
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)
        now = time.monotonic()
        if watchdog is not None and now >= next_check and len(group.ranks) > 1:
            next_check = now + check_every
            dead = watchdog.diagnose(list(group.ranks), wait=0.0)
            if dead:
                who = "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items()))
                raise PeerFailedError(
                    f"{what} cannot finish: {who}. Look at that rank's own error first; "
                    "the surviving processes must be restarted (jdist-run --max-restarts)")
        if now - start > limit:
            raise CollectiveTimeoutError(
                f"{what} did not finish within {limit:g} s (group {group.name!r}, ranks "
                f"{list(group.ranks)}); some process is not running the same step. Give "
                "every process the same number of steps (or use ddp.join() for uneven "
                "inputs), or raise init_process_group(timeout=...)")
