"""ZeRO's join hook: a process out of inputs shadows the optimizer steps it misses.

torch's ``ZeroRedundancyOptimizer`` is a ``Joinable``: after a process joins, its hook
runs one optimizer step per iteration of the processes still training, so that they
find a partner for the step's collectives and get the joined process's shard of the
update. jdist's ZeRO is the same (``Join([..., zero])``): the hook steps from the
``(params, state)`` of this process's last eager step (:attr:`latest`) with the
gradients in ``zero.join_grads``, which must be set before the hook runs, as torch
requires the gradients to be set (by the user or an earlier joinable's hook: the
hooks run in the order of the joinables).
"""

from __future__ import annotations

from jdist.algorithms.join import JoinHook

__all__ = ["ZeroJoinHook"]


class ZeroJoinHook(JoinHook):
    """Runs one ZeRO step per iteration the processes still training run."""

    def __init__(self, zero, step):
        self.zero = zero
        self._step = step  # zero's step without the join notification (torch notifies
        # again from its hook, which pairs wrongly when ZeRO is the first joinable)

    def main_hook(self) -> None:
        zero = self.zero
        if zero.latest is None:
            raise RuntimeError(
                "the ZeroRedundancyOptimizer join hook needs this process's parameters "
                "and state: run at least one zero.step(...) before the process joins")
        grads = zero.join_grads() if callable(zero.join_grads) else zero.join_grads
        if grads is None:
            raise RuntimeError(
                "the ZeroRedundancyOptimizer join hook steps with zero.join_grads, which "
                "is None: set it (a gradient pytree, or a function returning one) before "
                "the hook runs, e.g. in the hook of a joinable listed before the optimizer")
        params, state = zero.latest
        self._step(params, grads, state, {})
