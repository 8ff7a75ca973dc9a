"""ZeroRedundancyOptimizer inside DistributedDataParallel.train_step (issue 6, item 5)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from jdist.optim import ZeroRedundancyOptimizer
from tests.ddp.models import MLP, data, mse
from tests.helpers import tree_allclose

SIZES = (16, 32, 4)


def train(tx, steps=3, no_sync_first=False):
    model = MLP(SIZES, rngs=nnx.Rngs(0))
    ddp = DDP(model)
    opt = nnx.Optimizer(ddp.module, tx, wrt=nnx.Param)
    step = ddp.train_step(mse, opt)
    losses = []
    if no_sync_first:
        with ddp.no_sync():
            step(data(seed=100))
    for i in range(steps):
        losses.append(float(step(data(seed=i))))
    return ddp, opt, losses


def test_zero_train_step_equals_plain_adam_and_shards_state(monkeypatch):
    averaged = []
    orig = ZeroRedundancyOptimizer._update

    def spy(self, grads, state, params, average, **extra):
        averaged.append(average)
        return orig(self, grads, state, params, average, **extra)

    monkeypatch.setattr(ZeroRedundancyOptimizer, "_update", spy)
    n = jax.device_count()
    assert n == 8
    ref_ddp, ref_opt, ref_losses = train(optax.adam(1e-2))
    zero = ZeroRedundancyOptimizer(optax.adam(1e-2))
    ddp, opt, losses = train(zero)

    tree_allclose(jax.device_get(nnx.state(ddp.module, nnx.Param)),
                  jax.device_get(nnx.state(ref_ddp.module, nnx.Param)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
    assert int(opt.step[...]) == int(ref_opt.step[...]) == 3
    # DDP's all-reduce averaged the gradients; ZeRO only sliced them (no second reduction)
    assert averaged and not any(averaged)

    # per device: 1/N of each leaf's mu and nu (flat, padded to a multiple of N) + scalars
    params = jax.tree.leaves(nnx.state(ddp.module, nnx.Param))
    total = sum(int(np.prod(p.shape)) for p in params)
    lens = sorted(-(-int(np.prod(p.shape)) // n) for p in params) * 2  # mu, nu
    state = jax.tree.leaves(nnx.split(opt)[1])
    ref_state = jax.tree.leaves(nnx.split(ref_opt)[1])
    vectors = [x for x in state if x.ndim == 1]
    assert sorted(x.addressable_shards[0].data.shape[0] for x in vectors) == sorted(lens)
    for x in vectors:
        assert x.shape[0] % n == 0
        assert {s.data.shape for s in x.addressable_shards} == {(x.shape[0] // n,)}
    assert all(x.ndim == 0 for x in state if x.ndim != 1)  # Adam's count, nnx step
    local = sum(x.addressable_shards[0].data.size for x in state)
    full = sum(x.addressable_shards[0].data.size for x in ref_state)  # replicated: all of it
    assert full == 2 * total + 2
    assert local == sum(lens) + 2 and local <= full / n + len(lens) * (n - 1) / n + 2

    # the consolidated state equals plain adam's state after the same steps
    zero.consolidate_state_dict(nnx.as_pure(opt.opt_state), to=0)
    got, want = zero.state_dict()["state"][0], nnx.as_pure(ref_opt.opt_state)[0]
    for a, b in ((got.mu, want.mu), (got.nu, want.nu)):
        la, lb = jax.tree.leaves(a), jax.tree.leaves(jax.device_get(b))
        assert len(la) == len(lb) == 4
        for x, y in zip(la, lb, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_zero_train_step_after_no_sync_equals_plain_adam():
    ref_ddp, _, ref_losses = train(optax.adam(1e-2), steps=2, no_sync_first=True)
    ddp, _, losses = train(ZeroRedundancyOptimizer(optax.adam(1e-2)), steps=2,
                           no_sync_first=True)
    tree_allclose(jax.device_get(nnx.state(ddp.module, nnx.Param)),
                  jax.device_get(nnx.state(ref_ddp.module, nnx.Param)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)


def test_zero_on_another_group_is_rejected():
    devs = tuple(jax.devices()[:4])
    g4 = ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs, "dp"), axis_name="dp",
                      backend="local", devices_per_rank=(devs,), name="LOCAL4")
    ddp = DDP(MLP(SIZES, rngs=nnx.Rngs(0)))
    opt = nnx.Optimizer(ddp.module, ZeroRedundancyOptimizer(optax.adam(1e-2), group=g4),
                        wrt=nnx.Param)
    with pytest.raises(ValueError, match="group=ddp.process_group"):
        ddp.train_step(mse, opt)


def test_zero_train_step_with_tree_dependent_tx_equals_plain():
    """A callable weight-decay mask and a global-norm clip (a collective across the
    shards) inside DDP's train step (check_vma on): equal to the unsharded optimizer."""
    def make():
        return optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(
            1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))

    ref_ddp, _, ref_losses = train(make(), steps=2)
    ddp, _, losses = train(ZeroRedundancyOptimizer(make()), steps=2)
    tree_allclose(jax.device_get(nnx.state(ddp.module, nnx.Param)),
                  jax.device_get(nnx.state(ref_ddp.module, nnx.Param)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
