"""Shape buckets for DDP steps: pad variable-size batches to a few sizes, with an exact mask.

Every new batch shape compiles a new step program. With ``pad_batch_to`` a train step
pads the batch (zeros along the leading axis) to one of a few sizes and passes the
user's per-example losses through a mask, so the step compiles once per size and the
result is exact: each replica's loss is ``sum(mask * losses) * R / psum(sum(mask))``
(``R`` replicas), whose mean over replicas, the quantity DDP's averaged gradients
differentiate, is the mean of the losses over the real (unpadded) examples of the whole
group, however the padding falls on the replicas.

Padded rows still pass through the module: layers that mix examples (batch statistics)
see them, which is not exact; per-example models (MLPs, convolutions, attention within
an example) are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["PadSizes", "pad_batch", "masked_mean", "current_row_mask"]

_ROW_MASK: list = []  # the row mask of the padded step being traced (trace time only)


def current_row_mask() -> Any:
    """The float mask of real rows of the padded DDP step being traced, else ``None``
    (read by :class:`jdist.ddp.SyncBatchNorm` to leave padding rows out)."""
    return _ROW_MASK[-1] if _ROW_MASK else None


class PadSizes:
    """The sizes a batch of ``n`` rows is padded to (see ``train_step(pad_batch_to=)``).

    ``pad_batch_to`` is an int (every batch padded to exactly that many rows: the only
    choice when several processes must agree on the shape) or a sequence of sizes (the
    smallest that holds the batch; one process only). Each size must be a positive
    multiple of ``local_devices`` (the batch is split evenly over them).
    """

    def __init__(self, pad_batch_to: int | Sequence[int], local_devices: int, processes: int):
        if isinstance(pad_batch_to, (int, np.integer)) and not isinstance(pad_batch_to, bool):
            sizes = (int(pad_batch_to),)
            self.exact = True
        elif isinstance(pad_batch_to, Sequence) and pad_batch_to and all(
                isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                for s in pad_batch_to):
            sizes = tuple(sorted({int(s) for s in pad_batch_to}))
            self.exact = False
            if processes > 1 and len(sizes) > 1:
                raise ValueError(
                    f"pad_batch_to={list(pad_batch_to)!r}: with {processes} processes every "
                    "process must pad to the same size, but a list lets each pick its own; "
                    f"pass one int (e.g. pad_batch_to={sizes[-1]}) instead")
        else:
            raise TypeError(f"pad_batch_to must be an int or a non-empty list of ints (batch "
                            f"sizes), got {pad_batch_to!r}")
        bad = [s for s in sizes if s <= 0 or s % local_devices]
        if bad:
            raise ValueError(
                f"pad_batch_to sizes {bad} are not positive multiples of this process's "
                f"{local_devices} devices (each size is split evenly over them); use "
                f"multiples of {local_devices}, e.g. {local_devices * 8}")
        self.sizes = sizes

    def target(self, n: int) -> int:
        """The padded size for ``n`` rows."""
        if n < 0:
            raise ValueError(f"the batch has {n} rows")
        for s in self.sizes:  # an empty batch (a rank out of rows) is all padding
            if n <= s:
                return s
        raise ValueError(
            f"the batch has {n} rows, more than the largest pad_batch_to size "
            f"{self.sizes[-1]}; add a size >= {n} (or pad_batch_to=None)")


def pad_batch(batch: Any, sizes: PadSizes) -> tuple[Any, np.ndarray]:
    """``(batch padded with zero rows to its size in sizes, float32 mask of the real rows)``."""
    sizes_of = sizes
    leaves = jax.tree.leaves(batch)
    sizes = {int(np.shape(x)[0]) for x in leaves if np.ndim(x)}
    if len(sizes) != 1 or len(leaves) != sum(1 for x in leaves if np.ndim(x)):
        raise ValueError(
            f"pad_batch_to needs every batch leaf to have the same leading size, got "
            f"{sorted(sizes)} (scalars: pass them as extra step arguments)")
    n = sizes.pop() if sizes else 0
    target = sizes_of.target(n)

    def one(x):
        x = np.asarray(x)
        if n == target:
            return x
        pad = np.zeros((target - n,) + x.shape[1:], x.dtype)
        return np.concatenate([x, pad])

    mask = (np.arange(target) < n).astype(np.float32)
    return jax.tree.map(one, batch), mask


def masked_mean(loss_fn: Callable, axis: Any, has_aux: bool) -> Callable:
    """``loss(module, (batch, mask), *args)`` for DDP from per-example ``loss_fn``.

    ``loss_fn(module, batch, *args)`` returns one loss per row of this replica's shard
    (``(losses, aux)`` with ``has_aux``); the result is this replica's share of the
    group's mean over the real rows (module doc), run inside DDP's ``shard_map``.
    """

    def loss(module, padded, *args):
        batch, mask = padded
        _ROW_MASK.append(mask)
        try:
            out = loss_fn(module, batch, *args)
        finally:
            _ROW_MASK.pop()
        per, aux = out if has_aux else (out, None)
        per = jnp.asarray(per)
        if per.shape != mask.shape:
            raise ValueError(
                f"with pad_batch_to, loss_fn must return one loss per example (shape "
                f"{tuple(mask.shape)} for this replica's shard), got shape {tuple(per.shape)}; "
                "return e.g. jnp.mean((pred - y) ** 2, axis=-1) instead of a scalar mean")
        total = jnp.maximum(lax.psum(jnp.sum(mask), axis), 1.0)  # no row anywhere: 0
        value = jnp.sum(per * mask.astype(per.dtype)) * (lax.axis_size(axis) / total)
        return (value, aux) if has_aux else value

    return loss
