"""jdist.sampler.batches: rows in sampler order, fixed sizes, prefetch to devices."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.collectives._group import make_mesh
from jdist.sampler import DistributedSampler, batches


def make_data(n=37):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32),
            "y": (np.arange(n) * 2, np.arange(n).astype(np.int32) % 5)}


def expected_batches(order, data, size, drop_last):
    out = []
    for i in range(0, len(order), size):
        idx = np.asarray(order[i:i + size])
        if drop_last and len(idx) < size:
            break
        out.append(jax.tree.map(lambda a, idx=idx: a[idx], data))
    return out


@pytest.mark.parametrize("drop_last", [False, True])
def test_numpy_batches_follow_sampler_order(drop_last):
    data = make_data()
    sampler = DistributedSampler(37, 2, 1, seed=3)
    got = list(batches(sampler, data, 4, drop_last=drop_last, prefetch=False))
    want = expected_batches(sampler.indices(), data, 4, drop_last)
    assert [b["x"].shape[0] for b in got] == ([4] * 4 + ([] if drop_last else [3]))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g["x"], np.ndarray)
        jax.tree.map(np.testing.assert_array_equal, g, w)


def test_prefetched_batches_are_device_arrays_with_the_same_values():
    data = make_data(40)
    order = list(range(39, -1, -1))
    got = list(batches(order, data, 8))
    want = expected_batches(order, data, 8, False)
    assert len(got) == 5
    for g, w in zip(got, want, strict=True):
        assert isinstance(g["x"], jax.Array)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), g, w)


def test_prefetch_onto_a_sharding_over_eight_devices():
    mesh = make_mesh(jax.devices(), "dp")
    sharding = NamedSharding(mesh, P("dp"))
    data = make_data(64)
    sampler = DistributedSampler(64, 1, 0, seed=1)
    got = list(batches(sampler, data, 16, sharding=sharding))
    want = expected_batches(sampler.indices(), data, 16, False)
    assert len(got) == 4
    for g, w in zip(got, want, strict=True):
        assert g["x"].sharding == sharding
        assert len(g["x"].addressable_shards) == 8
        np.testing.assert_array_equal(np.asarray(g["x"]), w["x"])


def test_prefetch_runs_one_batch_ahead_and_progress_is_counted():
    sampler = DistributedSampler(40, 1, 0)
    gen = batches(sampler, np.arange(40), 10)
    next(gen)
    assert sampler.state_dict()["consumed"] == 20  # batch in hand + the prefetched one
    gen = batches(sampler, np.arange(40), 10, prefetch=False)
    sampler.set_epoch(1)
    next(gen)
    assert sampler.state_dict()["consumed"] == 10


def test_errors():
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        next(batches([0], np.arange(3), 0))
    with pytest.raises(ValueError, match="same leading"):
        next(batches([0], {"a": np.arange(3), "b": np.arange(4)}, 1))
    with pytest.raises(IndexError, match="index 5 but the arrays have 3 rows"):
        next(batches([0, 5], np.arange(3), 2, prefetch=False))
    with pytest.raises(ValueError, match="empty pytree"):
        next(batches([0], {}, 1))
