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
