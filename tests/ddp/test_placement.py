"""The batch placement of a DDP step: the fast transfer gives what jax.device_put gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.collectives._group import local_group
from jdist.ddp import _placement

LEAVES = {
    "f32": np.arange(8 * 3, dtype=np.float32).reshape(8, 3),
    "f64": np.linspace(0, 1, 8 * 2).reshape(8, 2),  # no x64: float32, as jax.device_put
    "i64": np.arange(8, dtype=np.int64),
    "bool": np.arange(8) % 3 == 0,
    "strided": np.arange(8 * 6, dtype=np.float32).reshape(8, 6)[:, ::2],
    "jax": jnp.ones((8, 2), jnp.bfloat16),
}


def _expected(x, sharding):
    return jax.device_put(x, sharding)


@pytest.mark.parametrize("fast", [True, False])
def test_shard_batch_matches_device_put(monkeypatch, fast):
    calls = []
    if fast:  # count the internal transfers: one per numpy leaf
        inner = _placement._batched_put
        monkeypatch.setattr(_placement, "_batched_put",
                            lambda *a: calls.append(a[0].shape) or inner(*a))
    else:  # another JAX version without the internal transfer: the public API
        monkeypatch.setattr(_placement, "_batched_put", None)
    _placement._row_plan.cache_clear()
    group = local_group()
    sharding = NamedSharding(group.mesh, P(group.axis_name))
    out = _placement.shard_batch(dict(LEAVES), group)
    assert len(calls) == (len(LEAVES) - 1 if fast else 0)  # the jax leaf: device_put
    for k, x in LEAVES.items():
        want = _expected(x, sharding)
        assert out[k].sharding == sharding, k
        assert out[k].dtype == want.dtype, (k, out[k].dtype, want.dtype)
        assert out[k].shape == want.shape, k
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(want), err_msg=k)
        for s in out[k].addressable_shards:  # every device holds its own rows
            np.testing.assert_array_equal(np.asarray(s.data), np.asarray(want)[s.index])
    _placement._row_plan.cache_clear()


def test_shard_batch_uneven_still_raises():
    group = local_group()
    with pytest.raises(ValueError, match="does not split evenly"):
        _placement.shard_batch(np.zeros((7, 2), np.float32), group)


def _one_device_group():
    """A group of this process on one device (a multi-process job's usual layout)."""
    from jax.sharding import Mesh

    from jdist.collectives._group import ProcessGroup

    dev = jax.devices()[0]
    return ProcessGroup(ranks=(0,), rank=0, mesh=Mesh(np.array([dev]), ("dp",)),
                        axis_name="dp", backend="gloo", devices_per_rank=((dev,),))


REPLICATED = {
    "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "f64": np.linspace(0, 1, 4),  # no x64: float32, as jax.device_put
    "i64": np.arange(5, dtype=np.int64),
    "np_scalar": np.float32(2.5),
    "py_float": 0.25,
    "py_int": 3,
    "jax": jnp.arange(4, dtype=jnp.bfloat16),
    "jax_elsewhere": jax.device_put(jnp.ones(3), jax.devices()[-1]),
    "key": jax.random.key(0),
}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("devices", ["all", "one"])
def test_replicated_matches_device_put(monkeypatch, fast, devices):
    if not fast:  # another JAX version without the internal transfer: the public API
        monkeypatch.setattr(_placement, "_batched_put", None)
    group = local_group() if devices == "all" else _one_device_group()
    sharding = NamedSharding(group.mesh, P())
    out = _placement.replicated(dict(REPLICATED), group)
    for k, x in REPLICATED.items():
        want = jax.device_put(jnp.asarray(x), sharding)
        assert out[k].sharding == sharding, k
        assert out[k].dtype == want.dtype, (k, out[k].dtype, want.dtype)
        assert out[k].shape == want.shape, k
        if k == "key":
            want, got = jax.random.key_data(want), jax.random.key_data(out[k])
        else:
            got = out[k]
        for s in got.addressable_shards:  # every device holds the whole value
            np.testing.assert_array_equal(np.asarray(s.data), np.asarray(want), err_msg=k)
    assert _placement.replicated(out, group)["f32"] is out["f32"]  # placed: unchanged


@pytest.mark.parametrize("devices", ["all", "one"])
def test_replicated_numpy_is_copied(devices):
    """Writing into the numpy array after placing it (a step still queued) changes
    nothing: the transfer may keep a numpy buffer on CPU, so the fast path copies."""
    group = local_group() if devices == "all" else _one_device_group()
    x = np.arange(1024, dtype=np.float32)
    out = _placement.replicated(x, group)
    x[:] = -1
    for s in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), np.arange(1024, dtype=np.float32))

