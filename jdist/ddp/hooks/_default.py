"""Default comm hooks: mean all-reduce and fp16/bf16 compression (torch's names).

Each hook is a pure ``hook(state, bucket) -> (reduced_buffer, state)`` function (see
:mod:`jdist.ddp.hooks._base`). ``state`` is ``None`` or the DDP's
:class:`~jdist.collectives.ProcessGroup` (torch passes a process group as the state of
these hooks); it is returned unchanged.

Like torch, the hooks divide by the world size *before* the sum all-reduce, so the
reduced value is the replicas' mean; with compression the division happens in the
compressed dtype (this keeps fp16 sums from overflowing).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jdist.collectives.runtime import ProcessGroup, bound_size
from jdist.ddp.hooks._base import CommHook, GradBucket

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "bucket_with_buffer",
    "reduce_axis",
]


def reduce_axis(state: Any, bucket: GradBucket, hook_name: str):
    """The mesh axis a default hook reduces over: ``bucket.axis_name``, checked.

    Args:
      state: ``None`` or a :class:`ProcessGroup` whose ``axis_name`` is the bucket's.
      bucket: the bucket being reduced.
      hook_name: the hook's name, for error messages.

    Raises:
      TypeError: ``state`` is neither ``None`` nor a ProcessGroup.
      ValueError: the group reduces over another mesh axis than the DDP buckets, or the
        hook was called outside DDP's ``shard_map`` (an ``UnboundAxisError``).
    """
    if state is not None and not isinstance(state, ProcessGroup):
        raise TypeError(
            f"{hook_name} expects state=None or a jdist ProcessGroup, got "
            f"{type(state).__name__}: {state!r}"
        )
    if state is not None and state.axis_name != bucket.axis_name:
        raise ValueError(
            f"{hook_name}: the state's process group reduces over mesh axis "
            f"{state.axis_name!r}, but DDP reduces this bucket over {bucket.axis_name!r}; "
            f"register the hook with state=None or with the DDP's own process group"
        )
    bound_size(bucket.axis_name, hook_name,
               "The hook runs inside DDP's shard_map, where that axis is bound; it was called "
               "outside (register it with ddp.register_comm_hook(state, hook) instead of "
               "calling it directly)")
    return bucket.axis_name


def bucket_with_buffer(bucket: GradBucket, buffer: jax.Array) -> GradBucket:
    """``bucket`` with a new flat ``buffer`` and ``gradients`` re-cut from it.

    The jdist counterpart of torch's ``GradBucket.set_buffer``: the gradients become
    views (slices) of the new buffer, in the new buffer's dtype.
    """
    if buffer.shape != bucket.buffer.shape:
        raise ValueError(
            f"bucket {bucket.index}: the new buffer has shape {buffer.shape}, expected "
            f"{bucket.buffer.shape} (the flat buffer keeps its length)"
        )
    grads, pos = [], 0
    for g in bucket.gradients:
        grads.append(buffer[pos:pos + g.size].reshape(g.shape))
        pos += g.size
    return bucket._replace(buffer=buffer, gradients=tuple(grads))


def allreduce_hook(state: Any, bucket: GradBucket):
    """Mean all-reduce of the bucket: divide by the world size, then sum (torch's default).

    Args:
      state: ``None`` or the DDP's ProcessGroup (returned unchanged).
      bucket: the bucket to reduce.

    Returns:
      ``(mean_buffer, state)``; registering it equals registering no hook.
    """
    axis = reduce_axis(state, bucket, "allreduce_hook")
    buf = bucket.buffer / jnp.asarray(bucket.num_replicas, bucket.buffer.dtype)
    return jax.lax.psum(buf, axis), state


def _compress_hook(state: Any, bucket: GradBucket, dtype, name: str):
    axis = reduce_axis(state, bucket, name)
    compressed = bucket.buffer.astype(dtype) / jnp.asarray(bucket.num_replicas, dtype)
    reduced = jax.lax.psum(compressed, axis)
    return reduced.astype(bucket.buffer.dtype), state


def fp16_compress_hook(state: Any, bucket: GradBucket):
    """Cast the bucket to float16, mean all-reduce, cast back to the gradients' dtype.

    Halves the bytes of an fp32 all-reduce. The division by the world size happens in
    float16 before the sum, as in torch.
    """
    return _compress_hook(state, bucket, jnp.float16, "fp16_compress_hook")


def bf16_compress_hook(state: Any, bucket: GradBucket):
    """Cast the bucket to bfloat16, mean all-reduce, cast back to the gradients' dtype.

    Note: XLA:CPU runs bf16 all-reduces in f32, so the bytes are saved only on GPU/TPU;
    the program still asks for a bf16 all-reduce (see :func:`comm_report`).
    """
    return _compress_hook(state, bucket, jnp.bfloat16, "bf16_compress_hook")


def _compress_wrapper(hook: CommHook, dtype, name: str) -> CommHook:
    if not callable(hook):
        raise TypeError(f"{name} expects a comm hook function, got {hook!r}")

    @functools.wraps(hook)
    def wrapped(state, bucket: GradBucket):
        own = bucket.buffer.dtype
        small = bucket_with_buffer(bucket, bucket.buffer.astype(dtype))
        out, new_state = hook(state, small)
        return out.astype(own), new_state

    wrapped.__name__ = f"{name}({getattr(hook, '__name__', 'hook')})"
    wrapped.__qualname__ = wrapped.__name__
    inner_init = getattr(hook, "init_state", None)
    if inner_init is not None:  # memories of the wrapped hook live in the compressed dtype
        wrapped.init_state = lambda state, bucket: inner_init(
            state, bucket_with_buffer(bucket, bucket.buffer.astype(dtype)))
    return wrapped


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run ``hook`` on a float16 copy of the bucket and cast its result back.

    ``fp16_compress_wrapper(allreduce_hook)`` equals :func:`fp16_compress_hook`; wrapping
    :func:`powerSGD_hook` runs PowerSGD's all-reduces in float16 (its memories are then
    float16 too). Gradients keep their own dtype after decompression.
    """
    return _compress_wrapper(hook, jnp.float16, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run ``hook`` on a bfloat16 copy of the bucket and cast its result back."""
    return _compress_wrapper(hook, jnp.bfloat16, "bf16_compress_wrapper")
