"""DistributedSampler: torch parity over epochs, defaults, resume, warning, errors."""

import json
import warnings

import numpy as np
import pytest
from torch.utils.data import DistributedSampler as TorchSampler

from jdist.collectives._group import ProcessGroup, group_state, make_mesh
from jdist.sampler import DistributedSampler, RepeatedEpochWarning

INVALID_RANK = r"Invalid rank 4, rank should be in the interval \[0, 3\]"


@pytest.mark.parametrize("n,num_replicas,shuffle,seed,drop_last", [
    (1001, 4, True, 0, False), (1001, 4, True, 2**40 + 3, True), (7, 3, False, 0, False),
    (5, 8, True, 9, False), (5, 8, True, 9, True), (0, 2, True, 0, False),
])
def test_epochs_match_torch(n, num_replicas, shuffle, seed, drop_last):
    data = list(range(n))
    for rank in range(num_replicas):
        ours = DistributedSampler(data, num_replicas, rank, shuffle, seed, drop_last)
        theirs = TorchSampler(data, num_replicas, rank, shuffle, seed, drop_last)
        assert len(ours) == len(theirs)
        for epoch in (0, 1, 17):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            np.testing.assert_array_equal(ours.indices(), list(theirs))


def test_dataset_may_be_an_int():
    assert list(DistributedSampler(10, 4, 1, shuffle=False)) == [1, 5, 9]
    assert list(DistributedSampler(np.int64(10), 4, 1, shuffle=False)) == [1, 5, 9]


def test_no_process_group_raises_torchs_error(monkeypatch):
    monkeypatch.setattr(group_state, "default_group", None)
    msg = ("Default process group has not been initialized, please make sure to call "
           "init_process_group.")
    with pytest.raises(ValueError, match=msg):
        DistributedSampler(10)
    with pytest.raises(ValueError, match=msg):
        DistributedSampler(10, num_replicas=2)


def test_defaults_come_from_the_default_group(monkeypatch):
    import jax

    group = ProcessGroup(ranks=(0, 1, 2), rank=2, mesh=make_mesh(jax.devices()[:3]),
                         axis_name="dp", backend="gloo",
                         devices_per_rank=tuple((d,) for d in jax.devices()[:3]))
    monkeypatch.setattr(group_state, "default_group", group)
    sampler = DistributedSampler(10, shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (3, 2)
    assert list(sampler) == [2, 5, 8, 1]
    assert DistributedSampler(10, rank=0).num_replicas == 3


@pytest.mark.parametrize("even_split", [True, False])
def test_resume_mid_epoch_yields_exactly_the_rest(even_split):
    sampler = DistributedSampler(103, 3, 1, seed=5, even_split=even_split)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(3)  # a fresh epoch, to consume part of it
    sampler.set_epoch(2)
    it = iter(sampler)
    taken = [next(it) for _ in range(10)]
    assert taken == full[:10]
    state = json.loads(json.dumps(sampler.state_dict()))
    assert (state["epoch"], state["seed"], state["consumed"]) == (2, 5, 10)

    fresh = DistributedSampler(103, 3, 1, seed=0, even_split=even_split)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["consumed"] == 10
    fresh.set_epoch(2)  # the usual loop calls set_epoch(start_epoch) first: keeps position
    rest = list(fresh)
    assert rest == full[10:]
    assert fresh.state_dict()["consumed"] == len(full)
    fresh.set_epoch(3)  # next epoch starts from its beginning
    assert fresh.state_dict()["consumed"] == 0
    reference = DistributedSampler(103, 3, 1, seed=5, even_split=even_split)
    reference.set_epoch(3)
    assert list(fresh) == list(reference)


def test_loading_a_state_then_switching_epoch_drops_the_position():
    sampler = DistributedSampler(50, 2, 0, seed=1)
    sampler.load_state_dict({"epoch": 4, "seed": 1, "consumed": 7})
    sampler.set_epoch(5)
    reference = DistributedSampler(50, 2, 0, seed=1)
    reference.set_epoch(5)
    assert list(sampler) == list(reference)


def test_state_dict_checks_configuration():
    state = DistributedSampler(50, 2, 0).state_dict()
    with pytest.raises(ValueError, match="dataset_length=50 but this sampler has "
                                         "dataset_length=51"):
        DistributedSampler(51, 2, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="num_replicas=2 but"):
        DistributedSampler(50, 4, 0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"consumed=26, outside \[0, 25\]"):
        DistributedSampler(50, 2, 0).load_state_dict({"epoch": 0, "consumed": 26})
    with pytest.raises(KeyError, match="missing 'consumed'"):
        DistributedSampler(50, 2, 0).load_state_dict({"epoch": 0})
    # another rank's state is fine: every rank consumes at the same pace
    DistributedSampler(50, 2, 1).load_state_dict(state)


def test_second_pass_without_set_epoch_warns():
    sampler = DistributedSampler(20, 2, 0)
    list(sampler)
    with pytest.warns(RepeatedEpochWarning, match="ran through epoch 0 a second time"):
        list(sampler)
    sampler.set_epoch(0)  # same epoch again: still a repeat
    with pytest.warns(RepeatedEpochWarning, match=r"Call sampler.set_epoch\(epoch\) with "
                                                   "each epoch's own number"):
        list(sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.set_epoch(1)
        sampler.set_epoch(0)  # the epoch changed in between: a deliberate replay
        list(sampler)
        for epoch in range(1, 4):
            sampler.set_epoch(epoch)
            list(sampler)
        unshuffled = DistributedSampler(20, 2, 0, shuffle=False)
        list(unshuffled)
        list(unshuffled)  # same order every epoch is expected without shuffling
        resumed = DistributedSampler(20, 2, 0)
        resumed.load_state_dict({"epoch": 0, "consumed": 3})
        list(resumed)  # finishing a loaded epoch is not a repeat


def test_a_peek_before_set_epoch_is_not_a_repeat():
    """pytorch/examples ddp-tutorial-series: ``len(next(iter(loader))[0])`` before
    ``set_epoch(epoch)``, every epoch (issue #15 item 9: this used to warn)."""
    import torch

    data = torch.utils.data.TensorDataset(torch.arange(64.0), torch.arange(64))
    sampler = DistributedSampler(data, 2, 1, seed=5)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    theirs = TorchSampler(data, 2, 1, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(3):
            assert len(next(iter(loader))[0]) == 4  # the tutorial's peek
            sampler.set_epoch(epoch)
            theirs.set_epoch(epoch)
            got = torch.cat([y for _, y in loader]).tolist()
            assert got == list(theirs)
    # a loop without set_epoch at all warns once its second full pass ends
    with pytest.warns(RepeatedEpochWarning, match="epoch 2 a second time"):
        next(iter(loader))
        list(loader)


def test_a_sampler_shared_by_two_loaders_raises():
    sampler = DistributedSampler(100, 2, 0)
    first, second = iter(sampler), iter(sampler)
    with pytest.raises(RuntimeError, match=r"read by two consumers: pass 1 \(0 of its 50 "
                                           r"indices handed out\).*pass 2.*give each "
                                           "DataLoader its own DistributedSampler"):
        next(first)
    assert next(second) == sampler.indices()[0]  # the newest pass works
    import torch

    sampler = DistributedSampler(100, 2, 0)
    a = torch.utils.data.DataLoader(range(100), batch_size=5, sampler=sampler)
    b = torch.utils.data.DataLoader(range(100), batch_size=5, sampler=sampler)
    with pytest.raises(RuntimeError, match="read by two consumers"):
        for _ in zip(a, b, strict=True):
            pass
    sampler = DistributedSampler(100, 2, 0)
    order = sampler.indices().tolist()
    it = iter(sampler)
    assert [next(it) for _ in range(30)] == order[:30]
    assert sampler.consumed() == 30
    assert list(it) == order[30:] and sampler.consumed() == 50
    sampler.set_epoch(1)
    order = sampler.indices().tolist()
    done = iter(sampler)
    assert list(done) == order
    again = iter(sampler)  # a pass read to its end is not cut short by a newer one
    assert list(done) == [] and next(again) == order[0]
    it = iter(sampler)
    next(it)
    iter(sampler)
    with pytest.raises(RuntimeError, match=r"pass 4 \(1 of its 50 indices handed out\).*"
                                           "began pass 5"):
        next(it)


def test_exact_eval_mode_lengths_and_cover():
    samplers = [DistributedSampler(10, 4, r, even_split=False) for r in range(4)]
    assert [len(s) for s in samplers] == [3, 3, 2, 2]
    assert sorted(i for s in samplers for i in s) == list(range(10))


def test_constructor_errors():
    with pytest.raises(ValueError, match=INVALID_RANK):
        DistributedSampler(10, 4, 4)
    with pytest.raises(ValueError, match="pass at most one of them"):
        DistributedSampler(10, 4, 0, drop_last=True, even_split=False)
    with pytest.raises(TypeError, match="dataset must be an int .* or have __len__"):
        DistributedSampler(iter(range(3)), 1, 0)
    with pytest.raises(TypeError, match="seed must be an int"):
        DistributedSampler(10, 1, 0, seed=1.5)
    sampler = DistributedSampler(10, 1, 0, seed=2**64 - 1)
    sampler.set_epoch(1)
    with pytest.raises(ValueError, match="seed 18446744073709551616 is outside"):
        list(sampler)


def test_dataset_length_change_is_reported():
    data = list(range(10))
    sampler = DistributedSampler(data, 2, 0)
    sampler.load_state_dict({"epoch": 0, "consumed": 2})
    data.append(10)
    with pytest.raises(ValueError, match="changed from 10 to 11"):
        list(sampler)
    assert sampler.state_dict()["consumed"] == 2  # a failed iter() keeps the position


def test_works_as_a_torch_dataloader_sampler():
    import torch

    data = torch.arange(50) * 10
    ours = DistributedSampler(data, 3, 2, seed=4)
    theirs = TorchSampler(data, 3, 2, seed=4)
    for epoch in (0, 1):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        got = [b.tolist() for b in torch.utils.data.DataLoader(data, 4, sampler=ours)]
        want = [b.tolist() for b in torch.utils.data.DataLoader(data, 4, sampler=theirs)]
        assert got == want


def _run_epochs(make, shuffle, drop_last, mode, passes, beside):
    """A program's epoch loop: each epoch, optionally set a training sampler's epoch
    beside (``beside``), set the sampler under test's epoch as ``mode`` says, then read
    one full pass. Returns every pass's indices and, per pass, the warnings raised."""
    sampler = make(range(11), 3, 1, shuffle=shuffle, seed=4, drop_last=drop_last)
    train = make(range(11), 3, 1, shuffle=True, seed=4, drop_last=drop_last)
    orders, warned = [], []
    for epoch in range(passes):
        if beside:
            train.set_epoch(epoch)
            list(train)
        if mode == "each":
            sampler.set_epoch(epoch)
        elif mode == "constant":
            sampler.set_epoch(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            orders.append(list(sampler))
        warned.append(sum(issubclass(w.category, RepeatedEpochWarning) for w in caught))
    return orders, warned


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-train"])
@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("mode", ["never", "each", "constant"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_repeated_epoch_warns_only_where_the_order_reaches_training(
        shuffle, drop_last, mode, passes, beside):
    """The rule of DistributedSampler's docstring, generated: shuffle x set_epoch (never,
    every epoch, a constant) x passes x drop_last x whether the program sets another
    (training) sampler's epoch, which makes this one an evaluation sampler when its own
    epoch is never set. Indices stay torch's in every case."""
    import gc

    from jdist.sampler import _sampler

    if list(_sampler._EPOCH_SET):  # samplers of earlier tests held in cycles: free them
        gc.collect()
    assert not list(_sampler._EPOCH_SET)  # only this program's samplers count
    ours, warned = _run_epochs(DistributedSampler, shuffle, drop_last, mode, passes, beside)
    theirs, _ = _run_epochs(TorchSampler, shuffle, drop_last, mode, passes, beside)
    assert ours == theirs
    repeats = shuffle and (mode == "constant" or (mode == "never" and not beside))
    assert warned == [int(repeats and p > 0) for p in range(passes)]
