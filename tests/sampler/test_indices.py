"""shard_indices / shard_sequence against torch's DistributedSampler, and without torch."""

import collections

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler as TorchSampler

from jdist.sampler import epoch_order, num_samples, shard_indices, shard_sequence

INVALID_RANK = r"Invalid rank 4, rank should be in the interval \[0, 3\]"


def torch_share(n, num_replicas, rank, shuffle, seed, epoch, drop_last):
    sampler = TorchSampler(range(n), num_replicas, rank, shuffle, seed, drop_last)
    sampler.set_epoch(epoch)
    return list(sampler), len(sampler)


configs = st.fixed_dictionaries({
    "n": st.integers(0, 5).flatmap(lambda digits: st.integers(0, 10**digits)),
    "num_replicas": st.integers(1, 17),
    "rank_frac": st.floats(0, 1, exclude_max=True),
    "seed": st.one_of(st.integers(0, 1000), st.integers(0, 2**64 - 10**4),
                      st.integers(2**32 - 5, 2**32 + 5)),
    "epoch": st.integers(0, 5000),
    "shuffle": st.booleans(),
    "drop_last": st.booleans(),
})


@given(cfg=configs)
@settings(max_examples=100, deadline=None)
def test_matches_torch_sampler(cfg):
    rank = int(cfg["rank_frac"] * cfg["num_replicas"])
    seed, epoch = cfg["seed"], cfg["epoch"]
    assume(seed + epoch <= 2**64 - 1)
    expected, length = torch_share(cfg["n"], cfg["num_replicas"], rank, cfg["shuffle"],
                                   seed, epoch, cfg["drop_last"])
    got = shard_indices(cfg["n"], cfg["num_replicas"], rank, shuffle=cfg["shuffle"],
                        seed=seed, epoch=epoch, drop_last=cfg["drop_last"])
    assert got.dtype == np.int64
    assert got.tolist() == expected
    assert num_samples(cfg["n"], cfg["num_replicas"], drop_last=cfg["drop_last"]) == length


def test_reference_examples_from_torch():
    plain = [shard_indices(10, 4, r, shuffle=False).tolist() for r in range(4)]
    assert plain == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    dropped = [shard_indices(10, 4, r, shuffle=False, drop_last=True).tolist()
               for r in range(4)]
    assert dropped == [[0, 4], [1, 5], [2, 6], [3, 7]]
    shuffled = [shard_indices(10, 4, r).tolist() for r in range(4)]
    assert shuffled == [[4, 3, 6], [1, 9, 2], [7, 0, 4], [5, 8, 1]]
    assert [shard_indices(2, 5, r, drop_last=True).tolist() for r in range(5)] == [[]] * 5


def test_padding_longer_than_dataset_repeats_whole_order():
    # n=2, R=7: total 7, pad 5 > n, torch repeats the list ceil(5/2) times
    for shuffle in (False, True):
        for rank in range(7):
            expected, _ = torch_share(2, 7, rank, shuffle, 3, 1, False)
            assert shard_indices(2, 7, rank, shuffle=shuffle, seed=3, epoch=1).tolist() \
                == expected


@pytest.mark.parametrize("n,num_replicas,rank", [(10**6, 8, 3), (2 * 10**6 + 1, 3, 2)])
def test_large_datasets_match_torch(n, num_replicas, rank):
    import torch

    g = torch.Generator()
    g.manual_seed(11 + 4)
    order = torch.randperm(n, generator=g).numpy()
    total = -(-n // num_replicas) * num_replicas
    padded = np.concatenate([order, order[: total - n]])
    got = shard_indices(n, num_replicas, rank, seed=11, epoch=4)
    np.testing.assert_array_equal(got, padded[rank:total:num_replicas])


@given(n=st.integers(0, 3000), num_replicas=st.integers(1, 12), seed=st.integers(0, 99),
       shuffle=st.booleans(), drop_last=st.booleans())
@settings(max_examples=60, deadline=None)
def test_coverage_and_disjointness(n, num_replicas, seed, shuffle, drop_last):
    shares = [shard_indices(n, num_replicas, r, shuffle=shuffle, seed=seed,
                            drop_last=drop_last) for r in range(num_replicas)]
    length = num_samples(n, num_replicas, drop_last=drop_last)
    assert all(len(s) == length for s in shares)
    counts = collections.Counter(np.concatenate(shares).tolist())
    assert all(0 <= i < n for i in counts)
    total = length * num_replicas
    if drop_last:
        # no index twice; exactly total distinct indices, the rest dropped
        assert all(c == 1 for c in counts.values()) and len(counts) == total
    else:
        # every index at least once; the extras are exactly torch's padding
        assert len(counts) == n
        order = epoch_order(n, shuffle=shuffle, seed=seed)
        pad = collections.Counter(np.resize(order, total)[n:].tolist())
        assert counts == collections.Counter(range(n)) + pad


@given(n=st.integers(0, 3000), num_replicas=st.integers(1, 12), seed=st.integers(0, 99),
       shuffle=st.booleans())
@settings(max_examples=60, deadline=None)
def test_exact_eval_covers_each_index_once(n, num_replicas, seed, shuffle):
    shares = [shard_indices(n, num_replicas, r, shuffle=shuffle, seed=seed, even_split=False)
              for r in range(num_replicas)]
    lengths = [len(s) for s in shares]
    assert lengths == [num_samples(n, num_replicas, r, even_split=False)
                       for r in range(num_replicas)]
    assert max(lengths) - min(lengths) <= 1
    assert sorted(np.concatenate(shares).tolist()) == list(range(n))


def test_shard_sequence_shards_any_order_like_torch():
    rng = np.random.default_rng(0)
    order = rng.integers(0, 50, size=23)  # e.g. a weighted sampler's draws
    for num_replicas in (1, 4, 5, 30):
        for rank in range(num_replicas):
            for drop_last in (False, True):
                positions, _ = torch_share(23, num_replicas, rank, False, 0, 0, drop_last)
                got = shard_sequence(order, num_replicas, rank, drop_last=drop_last)
                assert got.tolist() == order[positions].tolist()


def test_argument_errors():
    with pytest.raises(ValueError, match=INVALID_RANK):
        shard_indices(10, 4, 4)
    with pytest.raises(ValueError, match=r"Invalid rank -1, rank should be in the interval"):
        shard_indices(10, 4, -1)
    with pytest.raises(ValueError, match="num_replicas must be at least 1, got 0"):
        shard_indices(10, 0, 0)
    with pytest.raises(TypeError, match="num_replicas must be an int, got 2.0"):
        shard_indices(10, 2.0, 0)
    with pytest.raises(ValueError, match="pass at most one of them"):
        shard_indices(10, 2, 0, drop_last=True, even_split=False)
    with pytest.raises(ValueError, match="dataset length must be non-negative, got -3"):
        shard_indices(-3, 2, 0)
    with pytest.raises(ValueError, match="indices must be 1-D"):
        shard_sequence(np.zeros((2, 2), int), 2, 0)
    with pytest.raises(TypeError, match="indices must be integers"):
        shard_sequence([0.5, 1.5], 2, 0)
    with pytest.raises(ValueError, match="seed 18446744073709551616 is outside"):
        shard_indices(10, 2, 0, seed=2**64 - 1, epoch=1)
