"""The comm-hook contract shared by DDP's reducer and every hook.

A comm hook is a pure function ``hook(state, bucket) -> (reduced_buffer, new_state)``:

- ``state`` is a pytree (``None``, a NamedTuple of arrays, ...) that DDP threads through
  the jitted train step and keeps between steps; hooks never mutate it in place;
- ``bucket`` is a :class:`GradBucket`; ``bucket.buffer`` is the flat 1-D buffer of this
  replica's gradients for the bucket's parameters (``bucket.gradients`` are the same
  values shaped like the parameters);
- the returned buffer has the shape and dtype of ``bucket.buffer`` and holds the value
  every replica should use (usually the mean over ``bucket.axis_name``).

The hook runs inside ``shard_map`` (traced), so it reduces with ``jax.lax`` collectives
or ``jdist.collectives.functional`` over ``bucket.axis_name``. Unlike torch there is no
pre-division by the world size outside the hook: the hook decides (torch divides only
when no hook is registered, so a hook must divide itself, which is the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

__all__ = ["GradBucket", "CommHook"]


class GradBucket(NamedTuple):
    """One bucket of gradients as a comm hook sees it.

    Attributes:
      index: bucket index (0 = first reduced = last layers, as in torch).
      buffer: flat 1-D array of the bucket's local gradients, in ``parameters`` order.
      gradients: the same gradients, one array per parameter, in their own shapes.
      parameters: the parameter paths (``"layers/0/kernel"``) in buffer order.
      is_last: whether this is the last bucket reduced in a step (torch's ``is_last()``).
      axis_name: the replica mesh axis to reduce over.
      num_replicas: number of replicas on that axis (static int).
    """

    index: int
    buffer: jax.Array
    gradients: tuple[jax.Array, ...]
    parameters: tuple[str, ...]
    is_last: bool
    axis_name: Any
    num_replicas: int

    def offsets(self) -> tuple[int, ...]:
        """Start offset of each parameter's gradient inside ``buffer``."""
        out, pos = [], 0
        for g in self.gradients:
            out.append(pos)
            pos += int(g.size)
        return tuple(out)


CommHook = Callable[[Any, GradBucket], "tuple[jax.Array, Any]"]
