"""ZeRO's two collectives inside ``shard_map``: gradients to shards, shards to updates.

Every rank >= 1 leaf of ``numel`` elements is split into ``N`` flat pieces of
``L = ceil(numel / N)`` elements (row-major, zero-padded). The collectives run per
dtype, in buckets of consecutive leaves whose full (gathered) size is at most
``cap_bytes`` (a bigger leaf alone): a bucket's concatenated pieces and its gathered
result are the step's only temporaries of the collectives, so the peak stays at
1.5 buckets instead of 1.5 times every parameter (see :mod:`jdist.optim._zero`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdist._runs import consecutive
from jdist.collectives.functional import all_reduce_flat
from jdist.collectives.runtime import ReduceOp

__all__ = ["buckets", "by_dtype", "gather_shards", "grad_shards", "length"]


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


def buckets(idxs, shapes, n: int, itemsize: int, cap_bytes: int) -> list[list[int]]:
    """``idxs`` in order, cut into runs whose full size (``n`` pieces of each leaf,
    padding included) is at most ``cap_bytes``; a leaf bigger than that is alone."""
    sizes = [length(shapes[i], n) * n * itemsize for i in idxs]
    return [[idxs[j] for j in run] for run in consecutive(sizes, cap_bytes)]


def _runs(xs, n: int, cap_bytes: int) -> list[list[int]]:
    """The buckets of every dtype of ``xs`` (arrays or avals; rank >= 1 entries)."""
    return [b for dt, idxs in by_dtype(xs).items()
            for b in buckets(idxs, [x.shape for x in xs], n, dt.itemsize, cap_bytes)]


def grad_shards(leaves, average: bool, rep, axis, cap_bytes: int) -> list:
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
    for idxs in _runs(leaves, n, cap_bytes):
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


def gather_shards(outs, avals, axis, n: int, cap_bytes: int) -> list:
    """Full values from every replica's shards (one all-gather per bucket); values
    that stayed replicated are full already."""
    out = [o.x for o in outs]
    shards = [i for i, o in enumerate(outs) if o.sharded]
    for idxs in _runs([avals[i] for i in shards], n, cap_bytes):
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
