"""``ddp.join()``: training with uneven numbers of batches per process (torch's Join).

Inside ``with ddp.join():`` each step also counts the replicas that still have inputs
(one scalar all-reduce, torch's ``notify_join_context``). A process that runs out of
batches leaves its loop and enters ``__exit__``, where it keeps *replaying* its last step
with its replicas marked inactive: the same compiled SPMD program, so every collective of
the processes still training has a partner. Inactive replicas contribute zero gradients
(``divide_by_initial_world_size=True`` keeps dividing by the full replica count, torch's
default; ``False`` divides by the number of active replicas), keep their buffers, and
apply the same reduced update, so parameters stay identical everywhere (torch instead
broadcasts them from the last joiner at the end). When a replay step reports no active
replica, every process leaves the context together: nothing hangs.

``throw_on_early_termination=True``: the first process out of inputs raises
``JoinError("Rank r exhausted all inputs.")`` after one paired step, and the others raise
``JoinError("Detected at least one rank that exhausted inputs. Throwing across all
ranks.")`` from that same step, whose update is skipped.
"""

from __future__ import annotations

from typing import Any

from jdist.ddp._program import JoinMode
from jdist.errors import JoinError

__all__ = ["Join", "JoinState", "EXHAUSTED_MSG", "DETECTED_MSG"]

EXHAUSTED_MSG = "Rank {rank} exhausted all inputs."
DETECTED_MSG = "Detected at least one rank that exhausted inputs. Throwing across all ranks."


class JoinState:
    """Per-context state: the mode, whether this process still has inputs, its last step."""

    def __init__(self, mode: JoinMode, rank: int):
        self.mode = mode
        self.rank = rank
        self.active = True
        self.last: Any = None
        self.n_active: int | None = None

    def after_step(self, n_active: int, num_replicas: int) -> None:
        self.n_active = n_active
        if (self.mode.throw_on_early_termination and self.active
                and n_active < num_replicas):
            raise JoinError(DETECTED_MSG)


class Join:
    """Context manager returned by ``ddp.join(...)`` (see the module docstring)."""

    def __init__(self, ddp: Any, *, divide_by_initial_world_size: bool = True,
                 enable: bool = True, throw_on_early_termination: bool = False,
                 max_replays: int = 1_000_000):
        self._engine = ddp._engine
        self._enable = bool(enable)
        self._mode = JoinMode(bool(divide_by_initial_world_size),
                              bool(throw_on_early_termination))
        self._max_replays = int(max_replays)

    def __enter__(self) -> Join:
        if self._enable:
            if self._engine.join_state is not None:
                raise JoinError("ddp.join() contexts cannot be nested")
            self._engine.join_state = JoinState(self._mode, self._engine.group.rank)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        state = self._engine.join_state
        if not self._enable or state is None:
            return False
        try:
            if exc_type is not None:
                return False
            state.active = False
            if state.last is None:
                raise JoinError(
                    f"rank {state.rank} ran no step inside ddp.join(), so it has no step to "
                    "replay while the other processes finish; run at least one step per "
                    "process inside the context (every process needs one batch)")
            step, batch, args = state.last
            for _ in range(self._max_replays):
                step(batch, *args)
                if self._mode.throw_on_early_termination:
                    raise JoinError(EXHAUSTED_MSG.format(rank=state.rank))
                if state.n_active == 0:
                    return False
            raise JoinError(f"join(): other processes still had inputs after "
                            f"{self._max_replays} replayed steps")
        finally:
            self._engine.join_state = None
