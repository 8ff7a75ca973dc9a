"""Pure index maths of ``DistributedSampler``: which dataset indices each rank gets.

torch's rule (``torch.utils.data.DistributedSampler``), reproduced exactly:

1. ``num_samples = ceil((n - R) / R)`` if ``drop_last`` and ``n % R``, else
   ``ceil(n / R)``; ``total = num_samples * R``.
2. The epoch order is ``torch.randperm(n)`` seeded with ``seed + epoch`` (see
   :func:`jdist.sampler.randperm`), or ``range(n)`` without shuffling.
3. Without ``drop_last`` the order is padded to ``total`` by repeating it from the
   start (cyclically, when the pad is longer than ``n``); with ``drop_last`` it is cut
   to ``total``.
4. Rank ``r`` takes positions ``r, r + R, r + 2R, ...`` of that list.

``even_split=False`` (exact evaluation; not in torch) skips steps 1 and 3: rank ``r``
takes positions ``r, r + R, ...`` of the ``n``-long order, so every index is seen by
exactly one rank, never twice, and ranks' shares differ in length by at most one.
"""

from __future__ import annotations

import operator

import numpy as np

from jdist.sampler._randperm import check_seed, randperm

__all__ = [
    "dataset_length",
    "check_replicas_and_rank",
    "num_samples",
    "epoch_order",
    "shard_sequence",
    "shard_indices",
]


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an int, got {value!r} of type {type(value).__name__}"
        ) from None


def dataset_length(dataset) -> int:
    """``dataset`` itself if it is an int, else ``len(dataset)``.

    Raises:
      TypeError: ``dataset`` is neither an int nor sized (for example an iterable-style
        dataset, which has no length; torch's sampler cannot shard those either).
      ValueError: the length is negative.
    """
    if isinstance(dataset, (int, np.integer)) and not isinstance(dataset, bool):
        n = int(dataset)
    else:
        try:
            n = len(dataset)
        except TypeError:
            raise TypeError(
                f"dataset must be an int (its length) or have __len__, got an object of "
                f"type {type(dataset).__name__}; pass len(your_data) or a sized dataset"
            ) from None
    if n < 0:
        raise ValueError(f"dataset length must be non-negative, got {n}")
    return n


def check_replicas_and_rank(num_replicas, rank) -> tuple[int, int]:
    """Validate ``num_replicas`` and ``rank`` as torch does, with clearer types.

    Raises:
      TypeError: either is not an int.
      ValueError: ``num_replicas < 1``, or ``rank`` outside ``[0, num_replicas - 1]``
        (torch's text: ``Invalid rank 4, rank should be in the interval [0, 3]``).
    """
    num_replicas = _as_int(num_replicas, "num_replicas")
    rank = _as_int(rank, "rank")
    if num_replicas < 1:
        raise ValueError(
            f"num_replicas must be at least 1, got {num_replicas}; pass the number of "
            "processes sharing the data (the world size)"
        )
    if rank >= num_replicas or rank < 0:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank


def _check_split(drop_last: bool, even_split: bool) -> None:
    if drop_last and not even_split:
        raise ValueError(
            "drop_last=True drops samples so that all ranks get the same number, while "
            "even_split=False gives every sample to exactly one rank with no padding and "
            "no dropping; pass at most one of them"
        )


def num_samples(
    n: int, num_replicas: int, rank: int = 0, *, drop_last: bool = False,
    even_split: bool = True,
) -> int:
    """Number of indices ``rank`` gets per epoch (torch's ``len(sampler)``).

    With ``even_split=False`` this is ``ceil((n - rank) / num_replicas)``: ranks below
    ``n % num_replicas`` get one more than the others.
    """
    _check_split(drop_last, even_split)
    if not even_split:
        return max(0, -(-(n - rank) // num_replicas))
    if drop_last and n % num_replicas:
        return -(-(n - num_replicas) // num_replicas)
    return -(-n // num_replicas)


def epoch_order(n: int, *, shuffle: bool, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """The full order of one epoch: torch's ``randperm(n)`` after ``manual_seed(seed +
    epoch)`` if ``shuffle``, else ``arange(n)`` (int32; values are below 2**31)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64 if n >= 2**31 else np.int32)
    seed = _as_int(seed, "seed")
    epoch = _as_int(epoch, "epoch")
    return randperm(n, check_seed(seed + epoch), dtype=np.int32)


def shard_sequence(
    indices, num_replicas: int, rank: int, *, drop_last: bool = False,
    even_split: bool = True,
) -> np.ndarray:
    """``rank``'s share of an index sequence, split exactly as torch's sampler splits.

    Use it to shard the output of any sampler (weighted, custom) across processes:
    ``shard_sequence(list(weighted_sampler), world, rank)``.

    Args:
      indices: 1-D sequence of dataset indices (the epoch order).
      num_replicas: number of ranks sharing it.
      rank: this rank, in ``[0, num_replicas - 1]``.
      drop_last: cut the order to a multiple of ``num_replicas`` instead of padding.
      even_split: if False, no padding and no dropping: each position goes to exactly
        one rank and shares differ in length by at most one.

    Returns:
      An int64 numpy array.

    Examples:
      >>> shard_sequence(range(10), 4, 2).tolist()
      [2, 6, 0]
      >>> shard_sequence(range(10), 4, 2, even_split=False).tolist()
      [2, 6]
    """
    num_replicas, rank = check_replicas_and_rank(num_replicas, rank)
    _check_split(drop_last, even_split)
    order = np.asarray(indices)
    if order.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {order.shape}")
    if order.size == 0:
        order = order.astype(np.int64)
    if not np.issubdtype(order.dtype, np.integer):
        raise TypeError(f"indices must be integers, got dtype {order.dtype}")
    n = order.size
    if not even_split:
        return order[rank::num_replicas].astype(np.int64)
    total = num_samples(n, num_replicas, drop_last=drop_last) * num_replicas
    if total <= n:
        return order[rank:total:num_replicas].astype(np.int64)
    # pad by repeating the order from its start: padded[i] = order[i % n]
    positions = np.arange(rank, total, num_replicas, dtype=np.int64)
    return order[positions % n].astype(np.int64)


def shard_indices(
    n: int, num_replicas: int, rank: int, *, shuffle: bool = True, seed: int = 0,
    epoch: int = 0, drop_last: bool = False, even_split: bool = True,
) -> np.ndarray:
    """The indices ``DistributedSampler`` gives ``rank`` in ``epoch``, as an int64 array.

    Identical to ``list(torch.utils.data.DistributedSampler(range(n), num_replicas, rank,
    shuffle, seed, drop_last))`` after ``set_epoch(epoch)`` (when ``even_split``).

    Args:
      n: dataset length.
      num_replicas: number of ranks.
      rank: this rank.
      shuffle: permute with torch's ``randperm`` seeded by ``seed + epoch``.
      seed: base seed (``seed + epoch`` must lie in ``[-2**63, 2**64 - 1]``).
      epoch: the epoch (``set_epoch``).
      drop_last: cut instead of pad (torch's ``drop_last``).
      even_split: False for exact evaluation (see :func:`shard_sequence`).

    Examples:
      >>> [shard_indices(10, 4, r, shuffle=False).tolist() for r in range(4)]
      [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
      >>> [shard_indices(10, 4, r).tolist() for r in range(4)]
      [[4, 3, 6], [1, 9, 2], [7, 0, 4], [5, 8, 1]]
    """
    n = dataset_length(n)
    num_replicas, rank = check_replicas_and_rank(num_replicas, rank)
    _check_split(drop_last, even_split)
    order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)
    return shard_sequence(
        order, num_replicas, rank, drop_last=drop_last, even_split=even_split
    )
