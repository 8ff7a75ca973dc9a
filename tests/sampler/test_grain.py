"""The grain adapter: torch's per-rank order through grain's DataLoader and MapDataset.

torch's ``DistributedSampler`` is the oracle: the stream of records equals torch's
epochs, one after the other. grain is optional; these tests need it installed.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from torch.utils.data import DistributedSampler as TorchSampler

grain = pytest.importorskip("grain", reason="grain is not installed (pip install grain)")

from jdist.sampler import (  # noqa: E402
    DistributedSampler,
    GrainSampler,
    ResumableLoader,
    grain_dataset,
    grain_loader,
)


def torch_stream(n, world, rank, shuffle, seed, drop_last, epochs, start_epoch=0):
    theirs = TorchSampler(range(n), world, rank, shuffle, seed, drop_last)
    out = []
    for epoch in range(start_epoch, start_epoch + epochs):
        theirs.set_epoch(epoch)
        out += list(theirs)
    return out


GRID = [
    (n, world, shuffle, drop_last, seed)
    for n, world in [(1, 1), (7, 3), (33, 8), (101, 5)]
    for shuffle, drop_last in [(True, False), (True, True), (False, True)]
    for seed in (0, 9)
]


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last", "seed"), GRID)
def test_grain_loader_and_dataset_follow_torch_over_a_grid(n, world, shuffle, drop_last,
                                                           seed):
    source = np.arange(n) * 10
    for rank in {0, world - 1}:
        want = torch_stream(n, world, rank, shuffle, seed, drop_last, epochs=3)
        sampler = DistributedSampler(n, world, rank, shuffle, seed, drop_last)
        loader = grain_loader(source, sampler, epochs=3)
        assert [int(r) for r in loader] == [10 * i for i in want]
        ds = grain_dataset(source, sampler, epochs=3)
        assert len(ds) == len(want)
        assert [int(ds[p]) for p in range(len(ds))] == [10 * i for i in want]
        ordered = GrainSampler(sampler, epochs=3)
        assert [ordered[p].record_key for p in range(len(ordered))] == want


def test_workers_batches_are_torchs_batches_and_resume_is_exact():
    """grain's workers batch their own records; the adapter makes those torch's. 17
    records over 3 workers in batches of 4: the workers get 6, 6 and 5 records, so the
    last round holds batches of 2, 2 and 1 (grain skips no worker that has some)."""
    n, world, rank, size = 34, 2, 1, 4
    source = np.arange(n)
    want = torch_stream(n, world, rank, True, 8, False, epochs=1)  # 17 records
    sampler = DistributedSampler(n, world, rank, seed=8)
    ops = [grain.transforms.Batch(size)]
    loader = ResumableLoader(grain_loader(source, sampler, operations=ops, worker_count=3))
    it = iter(loader)
    got = [b.tolist() for b in itertools.islice(it, 2)]
    state = loader.state_dict()  # jdist's state after 2 batches (workers read ahead)
    got += [b.tolist() for b in it]
    assert got == [want[0:4], want[4:8], want[8:12], want[12:14], want[14:16], want[16:17]]
    assert (state["epoch"], state["consumed"]) == (0, 8)
    # resume in a new loader (no workers here: the order does not depend on them)
    resumed = DistributedSampler(n, world, rank, seed=8)
    resumed.load_state_dict(state)
    tail = [b.tolist() for b in grain_loader(source, resumed, operations=ops)]
    assert tail == [want[8:12], want[12:16], want[16:17]]


def test_the_position_map_is_a_permutation():
    from hypothesis import given
    from hypothesis import strategies as st

    @given(st.integers(1, 200), st.integers(2, 5), st.integers(1, 9))
    def bijective(length, workers, size):
        s = DistributedSampler(length, 1, 0)
        ordered = GrainSampler(s, worker_count=workers, batch_size=size)
        assert sorted(ordered.position(i) for i in range(length)) == list(range(length))

    bijective()


def test_map_dataset_batches_with_mp_prefetch_keep_torchs_batches():
    n, size = 40, 5
    sampler = DistributedSampler(n, 2, 0, seed=1)
    want = torch_stream(n, 2, 0, True, 1, False, epochs=2)
    ds = grain_dataset(np.arange(n), sampler, epochs=2).batch(size)
    it = ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    assert [b.tolist() for b in it] == [want[i:i + size] for i in range(0, 40, size)]


def test_resume_single_process_and_state_keys():
    n, world, rank = 30, 3, 2
    source = np.arange(n)
    want = torch_stream(n, world, rank, True, 0, False, epochs=3)
    sampler = DistributedSampler(n, world, rank)
    ops = [grain.transforms.Batch(3)]
    loader = ResumableLoader(grain_loader(source, sampler, operations=ops, epochs=3),
                             prefetch=2)
    head = [b.tolist() for b in itertools.islice(loader, 4)]  # 12 of 30 records
    state = loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 2)
    assert set(state) == set(sampler.state_dict())  # the sampler's keys, unchanged
    resumed = DistributedSampler(n, world, rank)
    resumed.load_state_dict(state)
    tail = [b.tolist() for b in grain_loader(source, resumed, operations=ops, epochs=2)]
    assert [i for b in head + tail for i in b] == want


class Jitter(grain.transforms.RandomMap):
    def random_map(self, element, rng):
        return element + rng.random()


def test_random_maps_draw_the_same_after_a_resume():
    source = np.arange(20, dtype=np.float64)
    sampler = DistributedSampler(20, 2, 0, seed=4)
    full = [float(r) for r in grain_loader(source, sampler, operations=[Jitter()], epochs=2)]
    assert [int(r) for r in full] == torch_stream(20, 2, 0, True, 4, False, epochs=2)
    assert len(set(np.round(np.asarray(full) % 1, 9))) == 20  # a draw per record
    resumed = DistributedSampler(20, 2, 0, seed=4)
    resumed.load_state_dict({"epoch": 1, "consumed": 3})
    tail = [float(r) for r in grain_loader(source, resumed, operations=[Jitter()], epochs=1)]
    assert tail == full[13:]
    other_rank = DistributedSampler(20, 2, 1, seed=4)
    theirs = [float(r) for r in grain_loader(source, other_rank, operations=[Jitter()])]
    assert not set(np.asarray(theirs) % 1) & set(np.asarray(full[:10]) % 1)


def test_errors():
    sampler = DistributedSampler(10, 2, 0)
    with pytest.raises(ValueError, match="grain must not shard again"):
        grain_loader(np.arange(10), sampler, shard_options=grain.sharding.ShardByJaxProcess())
    with pytest.raises(ValueError, match="over 10 records but the source has 11"):
        grain_loader(np.arange(11), sampler)
    with pytest.raises(ValueError, match="epochs must be a positive int or None"):
        GrainSampler(sampler, epochs=0)
    with pytest.raises(TypeError, match="load the state into the DistributedSampler"):
        GrainSampler(sampler).load_state_dict(sampler.state_dict())
    with pytest.raises(IndexError, match="record 5 is outside"):
        GrainSampler(sampler)[5]
    endless = GrainSampler(sampler, epochs=None)
    epoch2 = DistributedSampler(10, 2, 0)
    epoch2.set_epoch(2)
    assert endless[12].record_key == epoch2.indices()[2]  # 5 per epoch: epoch 2, 3rd
