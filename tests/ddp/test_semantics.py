"""torch DDP semantics on one process: unused parameters, no_sync, buffers, SyncBatchNorm."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp import FunctionalDDP, convert_sync_batchnorm
from jdist.errors import UnusedParametersError
from tests.ddp.models import MLP, data, max_diff, mse, reference_train


class WithSpare(nnx.Module):
    def __init__(self, rngs, frozen=False):
        self.body = MLP(rngs=rngs)
        self.spare = nnx.Linear(4, 4, rngs=rngs)
        self.frozen = frozen

    def __call__(self, x):
        y = self.body(x)
        if self.frozen:  # used, but no gradient flows to it
            y = y + jax.lax.stop_gradient(self.spare(y))
        return y


@pytest.mark.parametrize("frozen", [False, True])
def test_unused_parameters_raise_naming_paths_and_fix(frozen):
    ddp = DDP(WithSpare(nnx.Rngs(0), frozen))
    with pytest.raises(UnusedParametersError) as e:
        ddp.value_and_grad(mse)(data())
    msg = str(e.value)
    assert "'spare/bias'" in msg and "'spare/kernel'" in msg
    assert "find_unused_parameters=True" in msg
    assert "body/" not in msg


def test_find_unused_reduces_zeros_for_unused():
    b = data()
    ref = WithSpare(nnx.Rngs(0), True)
    ref_grads = nnx.grad(mse)(ref, b)
    ddp = DDP(WithSpare(nnx.Rngs(0), True), find_unused_parameters=True, bucket_cap_mb=0.001)
    _, grads = ddp.value_and_grad(mse)(b)
    assert max_diff(grads, ref_grads) < 1e-6
    np.testing.assert_array_equal(np.asarray(grads["spare"]["kernel"][...]), 0.0)


class Vec(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(2))

    def __call__(self, x):
        return jnp.sum(self.w[...] * x)


def _two_replica_group():
    devs = tuple(jax.devices()[:2])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name="two")


def test_no_sync_accumulates_locally_then_reduces_once_torch_numbers():
    # torch: rank 0 grads [1,1]+[1,1], rank 1 [2,1]+[2,1] -> both [3,2]
    ddp = DDP(Vec(), process_group=_two_replica_group())
    f = ddp.value_and_grad(lambda m, x: m(x[0]))
    x = np.array([[1.0, 1.0], [2.0, 1.0]], np.float32)
    with ddp.no_sync():
        assert not ddp.require_backward_grad_sync
        _, g = f(x)
        assert g is None
    _, g = f(x)
    np.testing.assert_allclose(np.asarray(g["w"][...]), [3.0, 2.0])
    _, g = f(x)  # accumulation was consumed by the synced step
    np.testing.assert_allclose(np.asarray(g["w"][...]), [1.5, 1.0])


def test_no_sync_program_has_no_collective_and_train_step_matches_accumulation():
    b1, b2 = data(seed=1), data(seed=2)
    both = {k: np.concatenate([b1[k], b2[k]]) for k in b1}
    ref = MLP(rngs=nnx.Rngs(0))
    # accumulated (summed) micro-batch grads == 2 x full-batch mean grad of the union
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.05), wrt=nnx.Param)
    ref_opt.update(ref, jax.tree.map(lambda g: 2 * g, nnx.grad(mse)(ref, both)))
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model)
    step = ddp.train_step(mse, nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    with ddp.no_sync():
        step(b1)
    assert max_diff(nnx.state(model, nnx.Param), before) == 0.0  # no update inside
    step(b2)
    assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param)) < 1e-5
    eng = ddp._engine
    (key,) = [k for k in eng._programs if k[0] == "grad" and k[2] is False]
    _, params, buffers = nnx.split(model, nnx.Param, ...)
    from jdist.ddp import _placement

    # train_step programs take the Variables' arrays as flat lists (no State per step)
    params, buffers = jax.tree.leaves(params), jax.tree.leaves(buffers)
    lowered = eng._programs[key].lower(
        _placement.replicated(params, eng.group), eng.buffers_in(buffers), None, None,
        None, _placement.shard_batch(b1, eng.group), (), None)
    text = lowered.compile().as_text()
    assert not re.search(r"all-reduce|all-gather|collective-permute|all-to-all", text)


def test_no_sync_train_step_then_value_and_grad_reduces_the_accumulation():
    """Gradients accumulated by a train step (flat arrays) feed a value_and_grad step."""
    b1, b2 = data(seed=1), data(seed=2)
    ref = MLP(rngs=nnx.Rngs(0))
    want = jax.tree.map(jnp.add, nnx.grad(mse)(ref, b1), nnx.grad(mse)(ref, b2))
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model)
    step = ddp.train_step(mse, nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param))
    with ddp.no_sync():
        step(b1)
    _, grads = ddp.value_and_grad(mse)(b2)
    assert max_diff(grads, want) < 1e-5
    assert ddp._engine.acc is None


class BNNet(nnx.Module):
    def __init__(self, rngs):
        self.bn = nnx.BatchNorm(3, momentum=0.9, rngs=rngs)
        self.lin = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.lin(self.bn(x))


def _bn_loss(m, b):
    return jnp.mean((m(b["x"]) - b["y"]) ** 2)


def _bn_data(seed, n=16):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 3).astype(np.float32) * (1 + np.arange(n)[:, None] % 8)
    return {"x": x, "y": rng.randn(n, 2).astype(np.float32)}


def test_buffers_broadcast_from_replica_0_and_skipped_after_no_sync():
    model = BNNet(nnx.Rngs(0))
    ddp = DDP(model)
    f = ddp.value_and_grad(_bn_loss)
    batches = [_bn_data(s) for s in range(4)]
    shard = lambda b, r: b["x"][2 * r:2 * r + 2]  # noqa: E731  (16 rows / 8 replicas)
    m = lambda x: x.mean(0)  # noqa: E731

    def expect(prev, b):  # each replica's running mean after one forward
        return np.stack([0.9 * prev[r] + 0.1 * m(shard(b, r)) for r in range(8)])

    f(batches[0])  # synced: broadcast replica 0 (all zero), then local updates
    rm = expect(np.zeros((8, 3)), batches[0])
    np.testing.assert_allclose(np.asarray(ddp.replica_buffers()["bn"]["mean"][...]), rm,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), rm[0], rtol=1e-5, atol=1e-6)
    with ddp.no_sync():
        f(batches[1])  # previous step synced: broadcast replica 0 first
    rm = expect(np.repeat(rm[:1], 8, 0), batches[1])
    np.testing.assert_allclose(np.asarray(ddp.replica_buffers()["bn"]["mean"][...]), rm,
                               rtol=1e-5, atol=1e-6)
    f(batches[2])  # right after no_sync: no broadcast, every replica keeps its own
    rm = expect(rm, batches[2])
    np.testing.assert_allclose(np.asarray(ddp.replica_buffers()["bn"]["mean"][...]), rm,
                               rtol=1e-5, atol=1e-6)
    f(batches[3])  # synced again: broadcast
    rm = expect(np.repeat(rm[:1], 8, 0), batches[3])
    np.testing.assert_allclose(np.asarray(ddp.replica_buffers()["bn"]["mean"][...]), rm,
                               rtol=1e-5, atol=1e-6)
    # broadcast_buffers=False (forward_sync_buffers=False): replicas never exchange buffers
    ddp = DDP(BNNet(nnx.Rngs(0)), forward_sync_buffers=False)  # torch 2.13's name
    f = ddp.value_and_grad(_bn_loss)
    rm = np.zeros((8, 3))
    for b in batches[:2]:
        f(b)
        rm = expect(rm, b)
    np.testing.assert_allclose(np.asarray(ddp.replica_buffers()["bn"]["mean"][...]), rm,
                               rtol=1e-5, atol=1e-6)


def test_sync_batchnorm_equals_global_batch_batchnorm():
    batches = [_bn_data(s) for s in range(3)]
    ref = BNNet(nnx.Rngs(0))
    reference_train(ref, optax.sgd(0.1), batches, _bn_loss)
    model = convert_sync_batchnorm(BNNet(nnx.Rngs(0)))
    assert model.bn.axis_name == "dp"
    ddp = DDP(model)
    step = ddp.train_step(_bn_loss, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    for b in batches:
        step(b)
    assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param)) < 1e-5
    assert max_diff(nnx.state(model, nnx.BatchStat), nnx.state(ref, nnx.BatchStat)) < 1e-5
    # eval mode: plain BatchNorm with running statistics, outputs split over replicas
    model.eval()
    ref.eval()
    x = batches[0]["x"]
    np.testing.assert_allclose(np.asarray(ddp(x)), np.asarray(ref(jnp.asarray(x))),
                               rtol=1e-5, atol=1e-5)


def test_functional_entry_point_trains_plain_pytrees():
    b = data()
    ref = MLP(rngs=nnx.Rngs(0))
    ref_losses = reference_train(ref, optax.adam(1e-2), [b, b])
    _, params = nnx.split(MLP(rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(params))

    def apply(p, x):
        for i in range(3):
            layer = p["layers"][i]
            x = x @ layer["kernel"] + layer["bias"]
            x = jnp.tanh(x) if i < 2 else x
        return x

    ddp = FunctionalDDP(params, bucket_cap_mb=0.002)
    step = ddp.train_step(lambda p, b: jnp.mean((apply(p, b["x"]) - b["y"]) ** 2),
                          optax.adam(1e-2))
    losses = [float(step(b)) for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ref_params = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
    assert max_diff(ddp.params, ref_params) < 1e-5
    np.testing.assert_allclose(np.asarray(ddp.apply(apply)(b["x"])),
                               np.asarray(ref(jnp.asarray(b["x"]))), rtol=1e-5, atol=1e-5)


def test_functional_entry_point_with_linen_and_batch_stats():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=None)(x)
            return nn.Dense(2)(x)

    net = Net()
    b = _bn_data(0)
    variables = net.init(jax.random.key(0), b["x"])

    def loss(params, buffers, batch):
        out, upd = net.apply({"params": params, **buffers}, batch["x"], mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2), upd

    ddp = FunctionalDDP(variables["params"], buffers={"batch_stats": variables["batch_stats"]})
    step = ddp.train_step(loss, optax.sgd(0.1))
    step(b)
    # reference: replica 0's statistics come from its 2 rows; gradients from all rows
    # (BatchNorm without axis_name normalizes each replica's shard separately)
    rows = [{k: v[2 * r:2 * r + 2] for k, v in b.items()} for r in range(8)]
    grads = [jax.grad(lambda p, rb=rb: loss(p, {"batch_stats": variables["batch_stats"]},
                                            rb)[0])(variables["params"]) for rb in rows]
    mean_grad = jax.tree.map(lambda *g: sum(g) / 8, *grads)
    expect = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], mean_grad)
    assert max_diff(ddp.params, expect) < 1e-5
    _, upd0 = loss(variables["params"], {"batch_stats": variables["batch_stats"]}, rows[0])
    assert max_diff(ddp.buffers, upd0) < 1e-6


def test_no_sync_with_find_unused_keeps_grads_of_params_used_only_earlier():
    # torch issue #69031: a parameter used only in a no_sync micro-batch lost its gradient
    model = WithSpare(nnx.Rngs(0))
    ref = WithSpare(nnx.Rngs(0))
    b1, b2 = data(seed=1), data(seed=2)

    def with_spare(m, b):
        return jnp.mean((m.spare(m.body(b["x"])) - b["y"]) ** 2)

    ddp = DDP(model, find_unused_parameters=True)
    with ddp.no_sync():
        ddp.value_and_grad(with_spare)(b1)
    _, grads = ddp.value_and_grad(mse)(b2)  # spare unused in this micro-batch
    g1, g2 = nnx.grad(with_spare)(ref, b1), nnx.grad(mse)(ref, b2)
    expect = jax.tree.map(lambda a, b: a + b, g1, g2)
    assert max_diff(grads, expect) < 1e-5
    assert float(jnp.abs(grads["spare"]["kernel"][...]).max()) > 0


def test_one_process_steps_block_only_on_cpu(monkeypatch):
    """XLA:CPU steps wait for their program (in-process collectives can deadlock with
    many programs in flight); on GPU/TPU a step keeps JAX's asynchronous dispatch."""
    from jdist.ddp import _engine

    calls = []
    real = _engine._block_on_one
    monkeypatch.setattr(_engine, "_block_on_one", lambda out, n: calls.append(n) or real(out, n))
    b1 = data(seed=1)
    losses, waits = [], []
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(_engine.Engine, "_platform", property(lambda self, p=platform: p))
        model = MLP(rngs=nnx.Rngs(0))
        ddp = DDP(model)
        step = ddp.train_step(mse, nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param))
        before = len(calls)
        losses.append([float(step(b1)) for _ in range(3)])
        waits.append(len(calls) - before)
        assert all(n == ddp.process_group.num_replicas for n in calls)
    assert waits == [3, 0]  # one wait per step on CPU, none on "gpu"
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)  # same numbers either way
