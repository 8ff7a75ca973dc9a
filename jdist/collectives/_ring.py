"""The textbook ring all-reduce, built from ``ppermute`` (torch tutorials build it from
send/recv). Teaching code and a baseline for ``lax.psum``; not used by jdist itself.

With N replicas each array is flattened, padded to a multiple of N and cut into N
chunks. Reduce-scatter: in step ``s`` (``0 <= s < N-1``) replica ``i`` sends its partial
chunk ``(i - s) % N`` to replica ``i + 1`` and adds the chunk it receives from ``i - 1``
into its chunk ``(i - s - 1) % N``; afterwards replica ``i`` holds the full reduction of
chunk ``(i + 1) % N``. All-gather: N-1 more steps pass the finished chunks around the
ring. Each replica sends ``2 (N-1) / N`` times the array's bytes, the bandwidth optimum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jdist.collectives._traced import (
    AxisName,
    _check_dtype,
    _size,
    _to_varying,
    _vma_checked,
    axis_of,
)
from jdist.collectives._types import ReduceOp

__all__ = ["ring_all_reduce"]


def _combine(op: ReduceOp):
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return lambda a, b: a + b if a.dtype != jnp.bool_ else a | b
    return {
        ReduceOp.PRODUCT: lambda a, b: a * b if a.dtype != jnp.bool_ else a & b,
        ReduceOp.MIN: jnp.minimum,
        ReduceOp.MAX: jnp.maximum,
        ReduceOp.BAND: jnp.bitwise_and,
        ReduceOp.BOR: jnp.bitwise_or,
        ReduceOp.BXOR: jnp.bitwise_xor,
    }[op]


def _ring_leaf(x, op: ReduceOp, axes, n: int, checked: bool):
    x = jnp.asarray(x)
    _check_dtype(op, x.dtype, "ring_all_reduce")
    if n == 1:
        return x
    if checked:
        x = _to_varying(x, axes)
    combine = _combine(op)
    size = x.size
    c = -(-size // n)  # chunk length, rounded up
    flat = jnp.pad(x.reshape(-1), (0, n * c - size))
    chunks = flat.reshape(n, c)
    i = lax.axis_index(axes)
    right = [(j, (j + 1) % n) for j in range(n)]

    def reduce_scatter_step(s, ch):
        send = lax.dynamic_index_in_dim(ch, (i - s) % n, keepdims=False)
        recv = lax.ppermute(send, axes, right)
        k = (i - s - 1) % n
        mine = lax.dynamic_index_in_dim(ch, k, keepdims=False)
        return lax.dynamic_update_index_in_dim(ch, combine(mine, recv), k, 0)

    def all_gather_step(s, ch):
        send = lax.dynamic_index_in_dim(ch, (i + 1 - s) % n, keepdims=False)
        recv = lax.ppermute(send, axes, right)
        return lax.dynamic_update_index_in_dim(ch, recv, (i - s) % n, 0)

    chunks = lax.fori_loop(0, n - 1, reduce_scatter_step, chunks)
    chunks = lax.fori_loop(0, n - 1, all_gather_step, chunks)
    out = chunks.reshape(-1)[:size].reshape(x.shape)
    return out / n if op is ReduceOp.AVG else out


def ring_all_reduce(x, axis_name: AxisName = None, op: ReduceOp = ReduceOp.SUM):
    """All-reduce by the ring algorithm: ``2 (N-1)`` ``ppermute`` steps over N chunks.

    Equals ``all_reduce(x, op, axis_name)`` (exactly for integers, MIN/MAX and bitwise
    ops; for float SUM up to rounding, since the ring adds in a different order than
    XLA). Every replica ends with the same bits. Sizes not divisible by N are padded.
    Differentiable (``ppermute`` and slicing are). Under ``check_vma=True`` the result is
    typed varying over the axis (it comes out of ``ppermute``).

    Args:
      x: a pytree of arrays.
      axis_name: an axis name, tuple of axis names, ``ProcessGroup`` or ``None``.
      op: a :class:`~jdist.ReduceOp` (AVG: the sum divided by N).

    Returns:
      The reduced pytree, on every replica.
    """
    axes = axis_of(axis_name)
    n = _size(axes, "ring_all_reduce")
    checked = _vma_checked(axes)
    return jax.tree_util.tree_map(lambda v: _ring_leaf(v, op, axes, n, checked), x)
