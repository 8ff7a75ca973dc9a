"""``ShardedSampler``: shard any sampler's output across processes (torch has none).

torch's ``DistributedSampler`` only permutes ``range(n)``; users with a weighted or
custom sampler have had to write their own wrapper (pytorch issue #77154). This one
draws the wrapped sampler's full order (which must be the same on every rank: seed it
identically) and gives each rank its share with the same split rules as
``DistributedSampler``.
"""

from __future__ import annotations

import numpy as np

from jdist.sampler._indices import (
    _check_split,
    check_replicas_and_rank,
    num_samples,
    shard_sequence,
)
from jdist.sampler._sampler import _default_replicas_and_rank

__all__ = ["ShardedSampler"]


class ShardedSampler:
    """This rank's share of another sampler's order.

    Every epoch, ``iter()`` draws the whole order from ``sampler`` (for example a
    ``torch.utils.data.WeightedRandomSampler`` with a seeded generator) and yields
    positions ``rank, rank + R, ...`` of it, padded or cut like ``DistributedSampler``
    (or split exactly with ``even_split=False``). ``set_epoch`` is passed on to the
    wrapped sampler when it has one.

    The wrapped sampler must give the same order on every rank, or the shares overlap:
    seed it identically everywhere (and per epoch, if it should change).

    Args:
      sampler: any iterable of indices with a deterministic order.
      num_replicas: number of processes; default: the default process group's size.
      rank: this process's rank; default: its rank in the default process group.
      drop_last: cut to a multiple of ``num_replicas`` instead of padding.
      even_split: keyword only; False gives each position to exactly one rank.

    Examples:
      >>> [list(ShardedSampler([5, 5, 1, 3, 2], 2, r)) for r in range(2)]
      [[5, 1, 2], [5, 3, 5]]
    """

    def __init__(self, sampler, num_replicas=None, rank=None, drop_last=False, *,
                 even_split=True) -> None:
        num_replicas, rank = _default_replicas_and_rank(num_replicas, rank)
        self.num_replicas, self.rank = check_replicas_and_rank(num_replicas, rank)
        _check_split(drop_last, even_split)
        self.sampler = sampler
        self.drop_last = bool(drop_last)
        self.even_split = bool(even_split)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch and pass it to the wrapped sampler if it has ``set_epoch``."""
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def indices(self) -> np.ndarray:
        """This rank's share of one fresh pass over the wrapped sampler (int64 array)."""
        order = np.fromiter((int(i) for i in self.sampler), dtype=np.int64)
        return shard_sequence(order, self.num_replicas, self.rank,
                              drop_last=self.drop_last, even_split=self.even_split)

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        """This rank's share of ``len(sampler)`` (needs a sized wrapped sampler)."""
        try:
            n = len(self.sampler)
        except TypeError:
            raise TypeError(
                f"the wrapped sampler ({type(self.sampler).__name__}) has no len(); "
                "give it __len__ or iterate without asking for the length"
            ) from None
        return num_samples(n, self.num_replicas, self.rank, drop_last=self.drop_last,
                           even_split=self.even_split)
