"""Hook-state plumbing for reducers: static-shape initialization and per-replica stacking.

The contract between a reducer (DDP) and a comm hook's state:

1. **Initialize with the bucket layout.** ``state = init_hook_state(hook, state, buckets)``
   once, before the first step, gives every stateful hook (PowerSGD) its per-bucket
   memories with static shapes, so the jitted step's state keeps one structure and is
   traced once. ``buckets`` are :class:`GradBucket` values whose ``buffer`` and
   ``gradients`` may be ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read).
   Hooks without state (``allreduce_hook``, fp16/bf16) return it unchanged.
   Skipping this step still works: PowerSGD then creates a bucket's memories the first
   time it sees the bucket (same values), and the step is traced a second time.
2. **State is per replica.** Inside ``shard_map`` a hook sees and returns *its
   replica's* state (PowerSGD's error memory differs between replicas). Outside, the
   reducer keeps every array leaf stacked on a new leading axis of length
   ``num_replicas``, sharded over the replica axis (``PartitionSpec(axis)``):
   ``stack_hook_state(state, n)`` before the first step, ``unstack_local(x)`` /
   ``stack_local(x)`` at the ``shard_map`` boundary (leaf ``[1, ...]`` <-> ``[...]``).
   Non-array leaves (``None``, a ProcessGroup given as the state) are static: keep them
   out of the traced arguments with ``split_static`` / ``merge_static``.
3. **Order.** The reducer calls the hook bucket by bucket in index order, threading the
   state from one call to the next; ``bucket.is_last`` is True for the last bucket of the
   step (stateful hooks count steps on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.ddp.hooks._base import CommHook, GradBucket

__all__ = [
    "init_hook_state",
    "stack_hook_state",
    "unstack_local",
    "stack_local",
    "split_static",
    "merge_static",
]


def _concrete(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.zeros(x.shape, x.dtype)
    return x


def init_hook_state(hook: CommHook, state: Any, buckets: Sequence[GradBucket]) -> Any:
    """``state`` with the memories ``hook`` needs for ``buckets`` (static shapes).

    Args:
      hook: the comm hook (a wrapped hook initializes in its compressed dtype).
      state: the state the user registered.
      buckets: one :class:`GradBucket` per bucket, arrays or ``jax.ShapeDtypeStruct``.

    Returns:
      The initialized state (``state`` itself for stateless hooks).
    """
    init = getattr(hook, "init_state", None)
    if init is None:
        return state
    for b in buckets:
        if not isinstance(b, GradBucket):
            raise TypeError(f"init_hook_state expects GradBucket values, got {type(b).__name__}")
        b = b._replace(buffer=_concrete(b.buffer),
                       gradients=tuple(_concrete(g) for g in b.gradients))
        state = init(state, b)
    return state


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float)) and not isinstance(
        x, bool)


def split_static(state: Any) -> tuple[Any, Any]:
    """``(arrays, static)``: the array leaves (others None) and the rest (None if none).

    A state whose leaves are all arrays (PowerSGD's) comes back as ``(state, None)``, so
    its structure may grow inside the step (lazy memories).
    """
    leaves, tree = jax.tree.flatten(state)
    if all(_is_array(x) for x in leaves):  # the common case: nothing static to keep
        return state, None
    arrays = [x if _is_array(x) else None for x in leaves]
    static = [None if _is_array(x) else x for x in leaves]
    return jax.tree.unflatten(tree, arrays), (tree, tuple(static))


def merge_static(arrays: Any, static: Any) -> Any:
    """Inverse of :func:`split_static`."""
    if static is None:
        return arrays
    tree, st = static
    leaves = jax.tree.leaves(arrays, is_leaf=lambda x: x is None)
    merged = [a if s is None else s for a, s in zip(leaves, st, strict=True)]
    return jax.tree.unflatten(tree, merged)


def stack_hook_state(state: Any, num_replicas: int) -> Any:
    """Every array leaf repeated on a new leading axis of length ``num_replicas``."""
    return jax.tree.map(
        lambda x: jnp.broadcast_to(jnp.asarray(x), (num_replicas,) + jnp.shape(x)), state)


def unstack_local(state: Any) -> Any:
    """Inside ``shard_map``: this replica's state (drop the leading axis of length 1)."""
    return jax.tree.map(lambda x: x[0], state)


def stack_local(state: Any) -> Any:
    """Inside ``shard_map``: add the leading axis back before returning the state."""
    return jax.tree.map(lambda x: jnp.asarray(x)[None], state)
