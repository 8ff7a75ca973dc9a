"""Which ranks take part in a save: waiting, with a deadline, for the others' arrival.

Every saving rank first announces its part of the step (:func:`_layout.announce`). A
save whose state this rank cannot write whole (a value of each rank's own, or an array
sharded over other processes' devices) needs every rank's part, so it waits for all of
them to announce; a save it can write whole only asks whether rank 0 (which then
writes the replicated values) is saving the same step. No JAX here.
"""

from __future__ import annotations

import time
import warnings

from jdist.checkpoint import _layout

__all__ = ["await_ranks"]

_POLL_S = 0.01


def await_ranks(root: str, step: int, world: int, want: set, timeout: float, *,
                warn_after: float | None = None, why: str = "") -> set:
    """Wait until every rank in ``want`` announced ``step``; the ranks still missing
    after ``timeout`` seconds (empty: all came). With ``warn_after``, one warning names
    the missing ranks and ``why`` once that many seconds passed."""
    start = time.monotonic()
    warned = warn_after is None
    while True:
        missing = set(want) - _layout.arrived(root, step, world)
        waited = time.monotonic() - start
        if not missing or waited >= timeout:
            return missing
        if not warned and waited >= warn_after:
            warned = True
            warnings.warn(f"checkpoint save of step {step} in {root} has waited {waited:.0f} s "
                          f"for ranks {sorted(missing)} to call save for the same step "
                          f"({why}); it raises after {timeout:g} s", stacklevel=3)
        time.sleep(min(_POLL_S, max(timeout - waited, 0.0)))
