"""Micro-batches: split a step's arguments along the batch axis, merge outputs back.

``split_args_kwargs_into_chunks`` follows torch's default chunk spec (``TensorChunkSpec
(0)``): every array leaf of the arguments (pytrees allowed) is split along axis 0 into
``chunks`` pieces as ``torch.tensor_split`` splits (the first ``size % chunks`` pieces
one row longer); other leaves go whole to every micro-batch. ``merge_chunks``
concatenates the pieces' leaves along axis 0.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["split_args_kwargs_into_chunks", "merge_chunks", "bounds"]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and np.ndim(x) > 0


def bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of ``chunks`` pieces of ``size`` rows (tensor_split's sizes)."""
    base, extra = divmod(size, chunks)
    out, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _split_leaf(x: Any, chunks: int, where: str) -> list:
    if not _is_array(x):
        return [x] * chunks
    if x.shape[0] < chunks:
        raise ValueError(f"{where}: an array of {x.shape[0]} rows (shape {tuple(x.shape)}) "
                         f"cannot be split into {chunks} micro-batches; pass a batch of at "
                         f"least {chunks} rows or use fewer micro-batches")
    return [x[a:b] for a, b in bounds(x.shape[0], chunks)]


def _split_tree(tree: Any, chunks: int, where: str) -> list:
    leaves, treedef = jax.tree.flatten(tree)
    pieces = [_split_leaf(leaf, chunks, where) for leaf in leaves]
    return [jax.tree.unflatten(treedef, [p[i] for p in pieces]) for i in range(chunks)]


def split_args_kwargs_into_chunks(args: tuple, kwargs: dict | None, chunks: int
                                  ) -> tuple[list[tuple], list[dict]]:
    """``(args_per_chunk, kwargs_per_chunk)``: ``chunks`` micro-batches of a step.

    Raises:
      ValueError: ``chunks`` is not a positive int, or an array has fewer rows.
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"the number of micro-batches must be a positive int, got "
                         f"{chunks!r}")
    args_split = _split_tree(tuple(args), chunks, "split_args_kwargs_into_chunks(args)")
    kwargs_split = _split_tree(dict(kwargs or {}), chunks,
                               "split_args_kwargs_into_chunks(kwargs)")
    return [tuple(a) for a in args_split], kwargs_split


def merge_chunks(chunks: list) -> Any:
    """The micro-batches' outputs joined back along axis 0 (leaf by leaf)."""
    if not chunks:
        raise ValueError("merge_chunks needs at least one micro-batch output")
    leaves = [jax.tree.flatten(c) for c in chunks]
    treedef = leaves[0][1]
    for i, (_, td) in enumerate(leaves):
        if td != treedef:
            raise ValueError(f"merge_chunks: micro-batch {i}'s output has structure {td}, "
                             f"micro-batch 0's has {treedef}")
    merged = [jax.numpy.concatenate([leaf[j] for leaf, _ in leaves])
              if _is_array(leaves[0][0][j]) else leaves[0][0][j]
              for j in range(len(leaves[0][0]))]
    return jax.tree.unflatten(treedef, merged)
