"""A DDP wrapper's comm hook: registration (torch's checks), its per-replica state for
the final bucket layout, checkpoint loading, and the traced function the programs call.

Split out of the engine (``_engine.py``), which holds one ``HookSlot``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jdist.collectives.runtime import ProcessGroup
from jdist.ddp import _placement, _reducer
from jdist.ddp._buckets import BucketLayout, LeafInfo
from jdist.ddp.hooks._base import GradBucket
from jdist.ddp.hooks._contract import check_hook, hook_output, replicated

__all__ = ["HOOK_ONCE_MSG", "HookSlot"]

HOOK_ONCE_MSG = "register_comm_hook or register_builtin_comm_hook can only be called once."


class HookSlot:
    """The registered hook (or none: the default mean all-reduce) and its state.

    Attributes:
      hook: the user's hook, or ``None``.
      state: the hook state's arrays, per replica (``None`` until :meth:`prepare`).
    """

    def __init__(self) -> None:
        self.hook: Callable | None = None
        self.state: Any = None
        self._user_state: Any = None
        self._static: Any = None
        self._ready = False
        self._loader: Callable | None = None

    @property
    def ready(self) -> bool:
        """Whether :meth:`prepare` has built the per-replica state."""
        return self._ready

    def register(self, state: Any, hook: Callable, steps: int) -> None:
        """Register ``hook(state, bucket) -> (buffer, new_state)``; once, before stepping."""
        if self.hook is not None:
            raise RuntimeError(HOOK_ONCE_MSG)
        check_hook(hook)  # torch's checks: callable, (state, bucket), annotations
        if steps:
            raise RuntimeError(
                "register_comm_hook must be called before the first step; this DDP wrapper "
                f"has already run {steps} step(s). Register the hook right after wrapping."
            )
        self.hook, self._user_state = hook, state
        self._static, self._ready = None, False

    def prepare(self, layout: BucketLayout, leaves: Sequence[LeafInfo],
                group: ProcessGroup) -> None:
        """Give the hook its per-bucket state for the final layout (``hooks._state``)."""
        if self.hook is None or self._ready:
            return
        from jdist.ddp.hooks import init_hook_state, split_static

        n = len(layout.buckets)
        buckets = [
            GradBucket(
                index=b.index,
                buffer=jax.ShapeDtypeStruct((sum(leaves[j].size for j in b.leaves),), b.dtype),
                gradients=tuple(jax.ShapeDtypeStruct(leaves[j].shape, leaves[j].dtype)
                                for j in b.leaves),
                parameters=b.paths, is_last=b.index == n - 1,
                axis_name=group.axis_name, num_replicas=group.num_replicas)
            for b in layout.buckets]
        arrays, self._static = split_static(init_hook_state(self.hook, self._user_state,
                                                             buckets))
        self.state = _placement.per_replica(arrays, group)
        self._ready = True
        loader, self._loader = self._loader, None
        if loader is not None:  # a checkpoint's state (jdist.checkpoint), checked by loader
            self.state = loader(self.state)

    def load(self, loader: Callable[[Any], Any]) -> None:
        """Replace the per-replica hook state with ``loader(state)``: now if it is ready,
        else right after it is prepared at the first step (the bucket layout is final
        only then). Used by :mod:`jdist.checkpoint` to restore a hook's memories."""
        if self.hook is None:
            raise RuntimeError("no comm hook is registered: register the hook the "
                               "checkpoint was saved with before restoring")
        if self._ready:
            self.state = loader(self.state)
        else:
            self._loader = loader

    def traced(self) -> Callable:
        """The registered hook with its static state leaves put back (or the default)."""
        if self.hook is None:
            return _reducer.mean_allreduce_hook
        from jdist.ddp.hooks import merge_static, split_static

        hook, static = self.hook, self._static

        def run(arrays, bucket):
            state = merge_static(arrays, static)
            out, new = hook_output(hook(state, bucket), state, hook)
            return replicated(out, bucket, hook), split_static(new)[0]

        run.__name__ = getattr(hook, "__name__", "comm_hook")
        return run

    def user_state(self) -> Any:
        """The hook state of this process's first replica, static leaves included."""
        if self.hook is None:
            return None
        if not self._ready:
            return self._user_state
        from jdist.ddp.hooks import merge_static

        return merge_static(_placement.local_first(self.state), self._static)
