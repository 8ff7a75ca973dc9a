"""jdist's sampler inside torch's DataLoader: torch's order, numpy batches, exact resume.

torch's own ``DistributedSampler`` is the oracle. DataLoaders with worker processes are
few (worker start-up is slow); each checks several epochs in one launch.
"""

from __future__ import annotations

import itertools
import multiprocessing
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import DistributedSampler as TorchSampler

from jdist.sampler import DistributedSampler, ResumableLoader, numpy_collate, to_numpy


class Indexed(Dataset):
    """Sample ``i`` is ``{"i": i, "x": [i, 2i, 3i] as float32}``; counts reads in-process."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.reads.append(int(i))
        return {"i": np.int64(i), "x": np.arange(1, 4, dtype=np.float32) * i}


# JAX runs in this process (other tests), so fork would warn that it may deadlock:
# workers start from a forkserver process instead, as docs/data.md recommends, which
# has torch and this module loaded already (workers then start in a fraction of a second)
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "numpy", __name__])


def _indices(loader) -> list[int]:
    return [int(i) for b in loader for i in np.asarray(b["i"])]


GRID = [
    (n, world, shuffle, drop_last, seed)
    for n, world in [(1, 1), (7, 3), (10, 4), (33, 8), (64, 2), (101, 5)]
    for shuffle, drop_last in [(True, False), (True, True), (False, False), (False, True)]
    for seed in (0, 123)
]


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last", "seed"), GRID)
def test_dataloader_order_matches_torch_over_a_grid(n, world, shuffle, drop_last, seed):
    data = Indexed(n)
    for rank in {0, world - 1}:
        ours = DistributedSampler(data, world, rank, shuffle, seed, drop_last)
        theirs = TorchSampler(data, world, rank, shuffle, seed, drop_last)
        loader = DataLoader(data, batch_size=3, sampler=ours, collate_fn=numpy_collate)
        for epoch in (0, 1, 2):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert _indices(loader) == list(theirs), (rank, epoch)


@pytest.mark.parametrize("persistent", [True, False])
def test_dataloader_with_workers_matches_torch(persistent):
    data = Indexed(50)
    ours = DistributedSampler(data, 3, 1, seed=7)
    theirs = TorchSampler(data, 3, 1, seed=7)
    mine = DataLoader(data, batch_size=4, sampler=ours, num_workers=2,
                      persistent_workers=persistent, collate_fn=numpy_collate,
                      multiprocessing_context=CONTEXT)
    ref = DataLoader(data, batch_size=4, sampler=theirs)
    for epoch in (0, 1, 2):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        got = list(mine)
        want = list(ref)
        assert [b["i"].tolist() for b in got] == [b["i"].tolist() for b in want]
        for g, w in zip(got, want, strict=True):
            assert isinstance(g["x"], np.ndarray) and g["x"].dtype == np.float32
            np.testing.assert_array_equal(g["x"], w["x"].numpy())


def test_numpy_collate_and_to_numpy():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    samples = [Pair(np.full(2, i, np.float32), {"y": i, "t": torch.tensor([i, i])})
               for i in range(3)]
    batch = numpy_collate(samples)
    assert isinstance(batch, Pair) and batch.a.shape == (3, 2)
    assert batch.b["y"].tolist() == [0, 1, 2]
    assert isinstance(batch.b["t"], np.ndarray) and batch.b["t"].tolist() == [[0, 0], [1, 1],
                                                                           [2, 2]]
    assert numpy_collate([("a", 1), ("b", 2)])[0] == ["a", "b"]
    default = torch.utils.data.default_collate([{"x": torch.ones(2)}, {"x": torch.zeros(2)}])
    view = to_numpy(default)
    assert isinstance(view["x"], np.ndarray)
    default["x"][0, 0] = 5.0  # a view: no copy was made
    assert view["x"][0, 0] == 5.0
    with pytest.raises(ValueError, match=r"batch\['x'\]: samples have different shapes "
                                         r"\[\(2,\), \(3,\)\]"):
        numpy_collate([{"x": np.zeros(2)}, {"x": np.zeros(3)}])
    with pytest.raises(ValueError, match="different keys"):
        numpy_collate([{"x": 1}, {"y": 1}])
    with pytest.raises(ValueError, match="no samples"):
        numpy_collate([])


def _run(loader, steps=None):
    """Batches' index lists, stopping after ``steps`` batches (None: the whole pass)."""
    out = []
    for b in itertools.islice(loader, steps):
        out.append(np.asarray(b["i"]).tolist())
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_yields_the_uninterrupted_tail(workers):
    """Stop after 3 batches (workers have read ahead), resume in a new loader: the rest of
    the epoch equals the uninterrupted run's, and only those samples are read."""
    n, world, rank, batch = 90, 2, 1, 4
    data = Indexed(n)

    def make(sampler, workers=workers):
        return ResumableLoader(DataLoader(data, batch_size=batch, sampler=sampler,
                                          num_workers=workers, collate_fn=numpy_collate,
                                          multiprocessing_context=CONTEXT if workers
                                          else None))

    full = DistributedSampler(data, world, rank, seed=3)
    full.set_epoch(1)
    uninterrupted = _run(make(full, 0))

    sampler = DistributedSampler(data, world, rank, seed=3)
    loader = make(sampler)
    sampler.set_epoch(1)
    head = _run(loader, 3)
    state = loader.state_dict()
    assert state["consumed"] == 12 and state["epoch"] == 1
    assert all(isinstance(v, (int, bool)) for v in state.values())  # JSON-able
    if workers:
        assert sampler.consumed() > 12  # the workers had read ahead
    assert sampler.state_dict() == state  # the sampler reports the loop's position

    resumed_sampler = DistributedSampler(data, world, rank, seed=3)
    resumed = make(resumed_sampler)
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(1)  # the loop's usual call keeps the loaded position
    data.reads.clear()
    tail = _run(resumed)
    assert head + tail == uninterrupted
    if not workers:  # no fast-forward: only the remaining samples are read
        assert data.reads == [i for b in tail for i in b]
    theirs = TorchSampler(data, world, rank, seed=3)
    theirs.set_epoch(2)
    resumed_sampler.set_epoch(2)  # the next epoch is whole again
    assert [i for b in _run(resumed) for i in b] == list(theirs)


def test_state_after_the_epoch_changed_is_the_new_epoch_start():
    data = Indexed(20)
    sampler = DistributedSampler(data, 1, 0)
    loader = ResumableLoader(DataLoader(data, batch_size=5, sampler=sampler,
                                        collate_fn=numpy_collate), prefetch=0)
    assert loader.state_dict()["consumed"] == 0
    _run(loader)
    assert loader.state_dict()["consumed"] == 20
    sampler.set_epoch(1)  # checkpoint taken after set_epoch: epoch 1 from its start
    assert (loader.state_dict()["epoch"], loader.state_dict()["consumed"]) == (1, 0)


def test_unbatched_dataloader_counts_one_sample_per_item():
    data = Indexed(12)
    sampler = DistributedSampler(data, 2, 0, seed=1)
    loader = ResumableLoader(DataLoader(data, batch_size=None, sampler=sampler), prefetch=0)
    got = [int(b["i"]) for b in itertools.islice(loader, 4)]
    assert got == sampler.indices()[:4].tolist()
    assert loader.state_dict()["consumed"] == 4


def test_bad_inputs_are_clear_errors():
    data = Indexed(20)
    sampler = DistributedSampler(data, 2, 0)
    first = ResumableLoader(DataLoader(data, batch_size=2, sampler=sampler), prefetch=0)
    second = ResumableLoader(DataLoader(data, batch_size=2, sampler=sampler), prefetch=1)
    a, b = iter(first), iter(second)
    next(a)
    next(b)  # a newer pass began: the older one may not be read any more
    with pytest.raises(RuntimeError, match="read by two consumers.*give each DataLoader "
                                           "its own DistributedSampler"):
        next(a)
    assert len(list(b)) == 4  # the newer pass is whole (10 indices in 5 batches)
    with pytest.raises(TypeError, match="needs the jdist sampler"):
        ResumableLoader(DataLoader(data, batch_size=2, sampler=TorchSampler(data, 2, 0)))
    # the dataset grows between epochs: named, with the fix
    grows = Indexed(20)
    sampler = DistributedSampler(grows, 2, 0)
    loader = DataLoader(grows, batch_size=2, sampler=sampler)
    list(loader)
    grows.n = 21
    sampler.set_epoch(1)
    with pytest.raises(ValueError, match="length changed from 20 to 21.*make a new "
                                         "DistributedSampler"):
        next(iter(loader))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ResumableLoader(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 0)))


def test_dataloader_shuffle_with_a_generator_versus_randperm():
    """The relation docs/data.md states (issue #15 item 11), with torch as the oracle."""
    from torch.utils.data import RandomSampler

    from jdist.sampler import randperm

    n, seed = 37, 5
    # RandomSampler(generator=g), first pass: torch.randperm from g's fresh seed
    g = torch.Generator().manual_seed(seed)
    assert list(RandomSampler(range(n), generator=g)) == randperm(n, seed).tolist()
    # DataLoader(shuffle=True, generator=g): each epoch first draws the workers' base seed
    # (one int64) from g, then the order, then one more (unused) permutation
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(range(n), shuffle=True, generator=g, batch_size=None)
    epochs = [[int(i) for i in loader] for _ in range(2)]
    ref = torch.Generator().manual_seed(seed)
    want = []
    for _ in range(2):
        torch.empty((), dtype=torch.int64).random_(generator=ref)
        want.append(torch.randperm(n, generator=ref).tolist())
        torch.randperm(n, generator=ref)
    assert epochs == want
    assert epochs[0] != randperm(n, seed).tolist()  # so not jdist's randperm(n, seed)
    # the reproducible way, in both frameworks: epoch e is randperm(n, seed + e)
    ours = DistributedSampler(n, 1, 0, seed=seed)
    theirs = TorchSampler(range(n), 1, 0, seed=seed)
    for epoch in range(3):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs) == randperm(n, seed + epoch).tolist()
