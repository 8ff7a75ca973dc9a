"""torch's quantization hooks: 8-bit affine quantization over an all-gather.

Each replica computes its bucket's quantization parameters as torch's ``MinMaxObserver``
(per tensor) or ``PerChannelMinMaxObserver`` (per chunk of ``bucket_size`` elements)
does for ``quint8``: the range ``[min(x, 0), max(x, 0)]`` over 255 steps (at least
float32's epsilon), zero point ``-round(min / scale)`` clamped to ``[0, 255]``. The
replicas all-gather their parameters and their uint8 codes, and every replica
dequantizes all codes and averages them: a quarter of fp32's bytes per replica, but
``world_size`` times as much received as an all-reduce, as in torch.

The gathers are :func:`jdist.collectives.functional.all_gather`, typed invariant over
the replica axis, so DDP takes the result as is (the same on every replica).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jdist.collectives import functional as F
from jdist.ddp.hooks._base import GradBucket
from jdist.ddp.hooks._default import reduce_axis

__all__ = ["quantization_pertensor_hook", "quantization_perchannel_hook"]

_QMAX = 255.0


def _qparams(x, axis=None):
    """``(scale, zero_point)`` of torch's min/max observers for quint8 (affine)."""
    lo = jnp.minimum(jnp.min(x, axis=axis), 0.0)
    hi = jnp.maximum(jnp.max(x, axis=axis), 0.0)
    scale = jnp.maximum((hi - lo) / _QMAX, jnp.finfo(jnp.float32).eps)
    zero = jnp.clip(-jnp.round(lo / scale), 0.0, _QMAX)
    return scale, zero


def _quantize(x, scale, zero):
    return jnp.clip(jnp.round(x / scale) + zero, 0.0, _QMAX).astype(jnp.uint8)


def _dequantize(codes, scale, zero):
    return scale * (codes.astype(jnp.float32) - zero)


def _gather_mean(codes, scale, zero, axis, world: int):
    """All-gather codes and parameters; the mean of every replica's dequantized codes."""
    all_codes = F.all_gather(codes, axis)        # [world, ...] uint8
    all_params = F.all_gather(jnp.stack([scale, zero]), axis)  # [world, 2, ...]
    total = jnp.zeros(codes.shape, jnp.float32)
    for r in range(world):
        s, z = all_params[r, 0], all_params[r, 1]
        if codes.ndim == 2:  # per channel: one (scale, zero) per row
            s, z = s[:, None], z[:, None]
        total = total + _dequantize(all_codes[r], s, z)
    return total / world


def quantization_pertensor_hook(state: Any, bucket: GradBucket):
    """Quantize the bucket to uint8 with one scale and zero point, all-gather, average.

    Args:
      state: ``None`` or the DDP's ProcessGroup (torch passes the process group).
      bucket: the bucket to reduce.

    Returns:
      ``(mean of the dequantized buffers, state)``, in the bucket's dtype.
    """
    axis = reduce_axis(state, bucket, "quantization_pertensor_hook")
    x = bucket.buffer.astype(jnp.float32)
    scale, zero = _qparams(x)
    out = _gather_mean(_quantize(x, scale, zero), scale, zero, axis, bucket.num_replicas)
    return out.astype(bucket.buffer.dtype), state


def quantization_perchannel_hook(state: Any, bucket: GradBucket, bucket_size: int = 512):
    """Like :func:`quantization_pertensor_hook`, with one scale and zero point per chunk
    of ``bucket_size`` elements (torch's channels; the buffer is zero-padded to whole
    chunks, the padding dropped after)."""
    axis = reduce_axis(state, bucket, "quantization_perchannel_hook")
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"quantization_perchannel_hook: bucket_size must be an int >= 1, "
                         f"got {bucket_size!r}")
    x = bucket.buffer.astype(jnp.float32)
    n = x.shape[0]
    rows = -(-n // bucket_size)
    chunks = jnp.pad(x, (0, rows * bucket_size - n)).reshape(rows, bucket_size)
    scale, zero = _qparams(chunks, axis=1)
    codes = _quantize(chunks, scale[:, None], zero[:, None])
    out = _gather_mean(codes, scale, zero, axis, bucket.num_replicas)
    return out.reshape(-1)[:n].astype(bucket.buffer.dtype), state
