"""jdist's DistributedSampler + loaders vs torch's DistributedSampler + DataLoader.

Generated: dataset length, replicas, rank, shuffle, seed, the sampler's and the
loader's drop_last, batch size, epoch, and a resume point (batches handed to the loop
before ``state_dict()``). The oracle is torch: the epoch's batches from a DataLoader over
torch's sampler. jdist must give the same batches, and a fresh loader resumed from the
state must give exactly the rest of them, then torch's next epoch.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchSampler

from jdist.sampler import ArrayLoader, DistributedSampler, ResumableLoader
from tests.differential import replayed, scaled

cases = st.fixed_dictionaries({
    "n": st.integers(0, 3).flatmap(lambda d: st.integers(0, 10 ** d)),
    "replicas": st.integers(1, 6),
    "rank_frac": st.floats(0, 1, exclude_max=True),
    "shuffle": st.booleans(),
    "seed": st.integers(0, 2**32 - 1),
    "sampler_drop_last": st.booleans(),
    "batch_size": st.integers(1, 9),
    "loader_drop_last": st.booleans(),
    "epoch": st.integers(0, 50),
    "resume_frac": st.floats(0, 1),
    "loader": st.sampled_from(["array", "torch"]),
})


def torch_epoch(c, rank, epoch):
    s = TorchSampler(range(c["n"]), c["replicas"], rank, c["shuffle"], c["seed"],
                     c["sampler_drop_last"])
    s.set_epoch(epoch)
    data = torch.arange(c["n"])
    loader = DataLoader(data, batch_size=c["batch_size"], sampler=s,
                        drop_last=c["loader_drop_last"])
    return [b.tolist() for b in loader]


def jdist_loader(c, rank):
    s = DistributedSampler(c["n"], c["replicas"], rank, shuffle=c["shuffle"], seed=c["seed"],
                           drop_last=c["sampler_drop_last"])
    if c["loader"] == "array":
        return s, ArrayLoader(s, np.arange(c["n"]), c["batch_size"],
                              drop_last=c["loader_drop_last"], prefetch=0)
    torch_loader = DataLoader(torch.arange(c["n"]), batch_size=c["batch_size"], sampler=s,
                              drop_last=c["loader_drop_last"])
    return s, ResumableLoader(torch_loader, prefetch=0)


def as_lists(batches):
    return [np.asarray(b).tolist() for b in batches]


@given(case=cases)
@settings(max_examples=scaled(60))
@replayed("sampler_loader")
def test_sampler_and_loader_match_torch_with_resume(case):
    c = case
    rank = int(c["rank_frac"] * c["replicas"])
    epoch = c["epoch"]
    expected = torch_epoch(c, rank, epoch)
    following = torch_epoch(c, rank, epoch + 1)

    sampler, loader = jdist_loader(c, rank)
    sampler.set_epoch(epoch)
    assert len(loader) == len(expected)
    assert as_lists(loader) == expected

    # resume: a run takes k batches and saves its state; a fresh loader picks it up
    k = int(c["resume_frac"] * len(expected))
    sampler, loader = jdist_loader(c, rank)
    sampler.set_epoch(epoch)
    head, it = [], iter(loader)
    for _ in range(k):
        head.append(np.asarray(next(it)).tolist())
    state = loader.state_dict()
    del it
    sampler2, loader2 = jdist_loader(c, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume is not a repeated epoch
        loader2.load_state_dict(state)
        rest = as_lists(loader2)
    assert head + rest == expected
    sampler2.set_epoch(epoch + 1)
    assert as_lists(loader2) == following
