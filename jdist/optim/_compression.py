"""Horovod-style gradient compression for :func:`AllReduceOptimizer` (``DistributedOptimizer``).

A compressor is ``compress(x) -> (y, ctx)`` and ``decompress(y, ctx) -> x``; only
floating-point arrays are cast (as Horovod's ``Compression.fp16``), others pass through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

__all__ = ["Compressor", "Compression"]


class Compressor(NamedTuple):
    """A named pair of pure functions (``compress``, ``decompress``)."""

    name: str
    compress: Callable[[Any], tuple[Any, Any]]
    decompress: Callable[[Any, Any], Any]


def _cast_to(dtype):
    def compress(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype), x.dtype
        return x, None

    def decompress(x, ctx):
        return x if ctx is None else x.astype(ctx)

    return compress, decompress


class Compression:
    """The compressors (Horovod's ``hvd.Compression``): ``none``, ``fp16``, ``bf16``."""

    none = Compressor("none", lambda x: (x, None), lambda x, ctx: x)
    fp16 = Compressor("fp16", *_cast_to(jnp.float16))
    bf16 = Compressor("bf16", *_cast_to(jnp.bfloat16))
