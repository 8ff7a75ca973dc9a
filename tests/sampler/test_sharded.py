"""ShardedSampler: shards a weighted (or any) sampler's order like DistributedSampler."""

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler as TorchSampler
from torch.utils.data import WeightedRandomSampler

from jdist.sampler import ShardedSampler


def weighted(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return WeightedRandomSampler([0.1, 5.0, 1.0, 0.5] * 5, num_samples=23, generator=g)


class EpochSampler:
    """A custom sampler whose order depends on the epoch it was told."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(np.random.default_rng(self.epoch).permutation(9).tolist())

    def __len__(self):
        return 9


@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_follow_torchs_split_of_the_wrapped_order(drop_last):
    order = list(weighted(7))
    for num_replicas in (2, 3, 5):
        for rank in range(num_replicas):
            sharded = ShardedSampler(weighted(7), num_replicas, rank, drop_last)
            positions = list(TorchSampler(range(23), num_replicas, rank, False, 0, drop_last))
            assert list(sharded) == [order[p] for p in positions]
            assert len(sharded) == len(positions)


def test_exact_split_and_set_epoch_forwarding():
    inner = [EpochSampler() for _ in range(4)]
    shards = [ShardedSampler(s, 4, r, even_split=False) for r, s in enumerate(inner)]
    for epoch in (0, 3):
        for s in shards:
            s.set_epoch(epoch)
        got = [list(s) for s in shards]
        assert [len(g) for g in got] == [len(s) for s in shards] == [3, 2, 2, 2]
        assert sorted(i for g in got for i in g) == list(range(9))
        assert got[0][0] == np.random.default_rng(epoch).permutation(9)[0]


def test_errors():
    with pytest.raises(ValueError, match=r"Invalid rank 2, rank should be in the interval"):
        ShardedSampler([1, 2], 2, 2)
    with pytest.raises(TypeError, match="has no len"):
        len(ShardedSampler(iter([1, 2]), 2, 0))
