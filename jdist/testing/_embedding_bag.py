"""An NNX counterpart of ``torch.nn.EmbeddingBag`` (Flax has none).

``EmbeddingBag(num_embeddings, features, mode="mean")`` holds one parameter,
``embedding`` of shape ``(num_embeddings, features)`` (torch's ``weight``, same layout,
initialised from N(0, 1) as torch does), so :func:`jdist.testing.torch_to_nnx` and
:func:`jdist.testing.nnx_to_torch` copy it like an ``Embedding``.

Inputs are torch's:

* ``bag(indices_2d)``: each row of a ``(B, N)`` integer array is one bag of ``N``
  indices;
* ``bag(indices_1d, offsets)``: bag ``b`` holds ``indices[offsets[b]:offsets[b + 1]]``
  (the last bag runs to the end). With ``include_last_offset=True`` ``offsets`` has one
  more entry, the end of the last bag; indices after it are ignored, which lets a
  caller pad ``indices`` to a fixed length (one compiled program for every batch).

``mode`` is ``"sum"``, ``"mean"`` or ``"max"``; an empty bag gives zeros in every mode
(as torch). ``per_sample_weights`` (same shape as the indices) scales each looked-up
row, ``"sum"`` mode only. ``padding_idx``: entries equal to it are left out of their
bag (not counted by ``"mean"``) and get no gradient.

Shapes are static, so the layer works under ``jax.jit`` and ``jax.grad``; unlike torch,
out-of-range offsets are not checked inside a compiled program (they are checked when
the offsets are concrete).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.rpc import next_bucket

__all__ = ["MIN_BUCKET", "EmbeddingBag", "embedding_bag"]

MODES = ("sum", "mean", "max")


def _check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"EmbeddingBag mode must be one of {MODES}, got {mode!r}")
    return mode


def _bags(indices, offsets, include_last_offset: bool):
    """Flat indices, each position's bag id (``B`` = not in a bag) and the bag count."""
    indices = jnp.asarray(indices)
    if indices.ndim == 2:
        if offsets is not None:
            raise ValueError(
                f"EmbeddingBag: offsets must be None when the input is 2-D (each row is "
                f"a bag), got offsets of shape {np.shape(offsets)}; pass 1-D indices to "
                f"use offsets")
        b, n = indices.shape
        seg = jnp.repeat(jnp.arange(b), n)
        return indices.reshape(-1), seg, b
    if indices.ndim != 1:
        raise ValueError(f"EmbeddingBag input must be 1-D (with offsets) or 2-D (one bag "
                         f"per row), got shape {tuple(indices.shape)}")
    if offsets is None:
        raise ValueError("EmbeddingBag: a 1-D input needs offsets (the start of each bag); "
                         "pass offsets or give a 2-D input with one bag per row")
    offsets = jnp.asarray(offsets)
    if offsets.ndim != 1:
        raise ValueError(f"EmbeddingBag offsets must be 1-D, got shape {tuple(offsets.shape)}")
    if not isinstance(offsets, jax.core.Tracer):
        off = np.asarray(offsets)
        if off.size and (off[0] != 0 or np.any(np.diff(off) < 0)
                         or off[-1] > indices.shape[0]):
            raise ValueError(
                f"EmbeddingBag offsets must start at 0, never decrease and not pass the "
                f"number of indices ({indices.shape[0]}), got {off.tolist()}")
    n = indices.shape[0]
    if include_last_offset:
        if offsets.shape[0] < 1:
            raise ValueError("EmbeddingBag(include_last_offset=True) needs at least one "
                             "offset (the end of the last bag), got none")
        b = offsets.shape[0] - 1
        starts, end = offsets[:-1], offsets[-1]
    else:
        b = offsets.shape[0]
        starts, end = offsets, n
    pos = jnp.arange(n)
    seg = jnp.searchsorted(starts, pos, side="right") - 1  # the last bag starting <= pos
    seg = jnp.where((pos < end) & (seg >= 0), seg, b)
    return indices, seg, b


def embedding_bag(weight, indices, offsets=None, *, mode: str = "mean",
                  per_sample_weights=None, padding_idx: int | None = None,
                  include_last_offset: bool = False):
    """``torch.nn.functional.embedding_bag`` on a ``(num_embeddings, features)`` table."""
    _check_mode(mode)
    flat, seg, b = _bags(indices, offsets, include_last_offset)
    if per_sample_weights is not None:
        if mode != "sum":
            raise ValueError(f"EmbeddingBag: per_sample_weights only works with "
                             f"mode='sum', got mode={mode!r}")
        psw = jnp.asarray(per_sample_weights)
        if psw.shape != jnp.shape(indices):
            raise ValueError(f"EmbeddingBag: per_sample_weights must have the shape of "
                             f"the input {tuple(jnp.shape(indices))}, got {tuple(psw.shape)}")
        psw = psw.reshape(-1)
    if padding_idx is not None:
        seg = jnp.where(flat == padding_idx, b, seg)
    rows = weight[flat]
    if per_sample_weights is not None:
        rows = rows * psw[:, None].astype(rows.dtype)
    if mode == "max":
        out = jax.ops.segment_max(rows, seg, num_segments=b)
        count = jax.ops.segment_sum(jnp.ones_like(seg), seg, num_segments=b)
        return jnp.where(count[:, None] > 0, out, jnp.zeros_like(out))
    out = jax.ops.segment_sum(rows, seg, num_segments=b)
    if mode == "mean":
        count = jax.ops.segment_sum(jnp.ones(seg.shape, rows.dtype), seg, num_segments=b)
        out = out / jnp.maximum(count, 1)[:, None]
    return out


MIN_BUCKET = 64
"""The smallest padded size of a bucketed call's indices or bags."""


def _paddable(idx, off=None, psw=None) -> bool:
    """1-D integer indices and offsets (numpy) with valid offsets: the calls
    ``bucket_call`` pads (the layer's own checks name bad offsets)."""
    if off is None or not all(isinstance(a, np.ndarray) and a.ndim == 1 for a in (idx, off)):
        return False
    if not (np.issubdtype(idx.dtype, np.integer) and np.issubdtype(off.dtype, np.integer)):
        return False
    if psw is not None and not (isinstance(psw, np.ndarray) and psw.shape == idx.shape):
        return False
    return off.size > 0 and off[0] == 0 and not np.any(np.diff(off) < 0) \
        and off[-1] <= idx.shape[0]


class EmbeddingBag(nnx.Module):
    """Sums, averages or maxes bags of embeddings (``torch.nn.EmbeddingBag``).

    Args:
      num_embeddings: rows of the table.
      features: size of each embedding (torch's ``embedding_dim``).
      mode: ``"sum"``, ``"mean"`` (torch's default) or ``"max"``.
      include_last_offset: ``offsets`` ends with the end of the last bag (torch's flag).
      padding_idx: an index left out of every bag (torch's ``padding_idx``); its row
        starts at zero, as in torch.
      dtype / param_dtype: computation and parameter dtypes.
      rngs: for the N(0, 1) initial table.
    """

    def __init__(self, num_embeddings: int, features: int, mode: str = "mean", *,
                 include_last_offset: bool = False, padding_idx: int | None = None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if num_embeddings < 1 or features < 1:
            raise ValueError(f"EmbeddingBag needs num_embeddings >= 1 and features >= 1, "
                             f"got {num_embeddings} and {features}")
        self.mode = _check_mode(mode)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"EmbeddingBag padding_idx must be within "
                                 f"[-{num_embeddings}, {num_embeddings}), got {padding_idx}")
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings, self.features = num_embeddings, features
        self.include_last_offset, self.padding_idx = include_last_offset, padding_idx
        table = jax.random.normal(rngs.params(), (num_embeddings, features), param_dtype)
        if padding_idx is not None:
            table = table.at[padding_idx].set(0)
        self.embedding = nnx.Param(table)

    def bucket_call(self, indices, offsets=None, per_sample_weights=None):
        """Shape buckets (``jdist.rpc``'s ``bucket_call`` protocol): a 1-D call padded
        to a few sizes so a ``RemoteModule`` compiles once per bucket, or None.

        Indices grow to a power of two (at least :data:`MIN_BUCKET`) and bags to a
        power of two: bag ``b < B`` keeps its indices, bags ``B .. K-2`` are empty and
        bag ``K-1`` holds the padding indices (``padding_idx`` where set, else 0), so
        the first ``B`` output rows and their gradients are the unpadded ones.
        """
        args = (indices, offsets) + (() if per_sample_weights is None
                                     else (per_sample_weights,))
        if not _paddable(*args):
            return None
        idx, off = indices, offsets
        n = idx.shape[0]
        starts, end = (off[:-1], int(off[-1])) if self.include_last_offset else (off, n)
        b = starts.shape[0]
        big_n, big_k = next_bucket(n, MIN_BUCKET), next_bucket(b + 1, MIN_BUCKET)
        fill = self.padding_idx if self.padding_idx is not None else 0
        pidx = np.full(big_n, fill, idx.dtype)
        pidx[:end] = idx[:end]  # indices past the last offset stay out of every bag
        pstarts = np.full(big_k, end, off.dtype)
        pstarts[:b] = starts
        poff = (np.concatenate([pstarts, np.array([big_n], off.dtype)])
                if self.include_last_offset else pstarts)
        out = [pidx, poff]
        if per_sample_weights is not None:
            ppsw = np.zeros(big_n, per_sample_weights.dtype)
            ppsw[:n] = per_sample_weights
            out.append(ppsw)
        return tuple(out), b

    def __call__(self, indices, offsets=None, per_sample_weights=None):
        return embedding_bag(self.embedding[...], indices, offsets, mode=self.mode,
                             per_sample_weights=per_sample_weights,
                             padding_idx=self.padding_idx,
                             include_last_offset=self.include_last_offset)
