"""ZeRO's two collectives inside ``shard_map``: gradients to shards, shards to updates.

Every rank >= 1 leaf of ``numel`` elements is split into ``N`` flat pieces of
``L = ceil(numel / N)`` elements (row-major, zero-padded); one collective of each kind
runs per dtype (see :mod:`jdist.optim._zero`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdist.collectives.functional import all_reduce_flat
from jdist.collectives.runtime import ReduceOp

__all__ = ["by_dtype", "gather_shards", "grad_shards", "length"]


def length(shape, n: int) -> int:
    """Elements of one replica's piece of a ``shape`` leaf split over ``n``."""
    return max(1, -(-math.prod(shape) // n))


def by_dtype(xs) -> dict:
    """``{dtype: [indices of rank >= 1 entries]}`` of a list of arrays/avals."""
    out: dict = {}
    for i, x in enumerate(xs):
        if len(x.shape):
            out.setdefault(jnp.dtype(x.dtype), []).append(i)
    return out


def grad_shards(leaves, average: bool, rep, axis) -> list:
    """This replica's pieces of the (averaged) gradients; rank 0 leaves whole.

    ``average``: reduce-scatter (mean) over ``axis``; else slice the local pieces
    (gradients already averaged, as with DDP). ``rep`` is the ``ShardReplayer``.
    """
    n, out = rep.n, list(leaves)
    scalars = [i for i, x in enumerate(leaves) if not x.shape]
    if average and scalars:  # one all-reduce per dtype where gloo would run one each
        means = all_reduce_flat([leaves[i] for i in scalars], ReduceOp.AVG, axis)
        for i, m in zip(scalars, means, strict=True):
            out[i] = m
    for idxs in by_dtype(leaves).values():
        lens = [length(leaves[i].shape, n) for i in idxs]
        if average:
            rows = [jnp.pad(leaves[i].reshape(-1), (0, ln * n - leaves[i].size))
                    .reshape(n, ln) for i, ln in zip(idxs, lens, strict=True)]
            buf = jnp.concatenate(rows, axis=1).reshape(-1)
            mine = jax.lax.psum_scatter(buf, axis, scatter_dimension=0, tiled=True)
            mine = mine / jnp.asarray(n, mine.dtype)
            pieces = jnp.split(mine, np.cumsum(lens)[:-1])
        else:
            pieces = [rep.shard(leaves[i]) for i in idxs]
        for i, piece in zip(idxs, pieces, strict=True):
            out[i] = piece
    return out


def gather_shards(outs, avals, axis, n: int) -> list:
    """Full values from every replica's shards (one all-gather per dtype); values
    that stayed replicated are full already."""
    out = [o.x for o in outs]
    shards = [i for i, o in enumerate(outs) if o.sharded]
    for idxs in by_dtype([avals[i] for i in shards]).values():
        idxs = [shards[j] for j in idxs]
        lens = [length(avals[i].shape, n) for i in idxs]
        buf = jnp.concatenate([out[i] for i in idxs])
        # invariant result: the same update on every replica (checked under check_vma)
        full = jax.lax.all_gather(buf, axis, axis=0, tiled=True, to="invarying")
        cols = jnp.split(full.reshape(n, -1), np.cumsum(lens)[:-1], axis=1)
        for i, col in zip(idxs, cols, strict=True):
            size = math.prod(avals[i].shape)
            out[i] = col.reshape(-1)[:size].reshape(avals[i].shape)
    return out
