"""DataParallel.value_and_grad: one compiled program, same numbers as one device."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.dp import DataParallel
from jdist.dp._scatter_gather import SCALAR_WARNING, chunk_sizes
from tests.dp.test_data_parallel import batch, close, mlp_apply, mlp_params


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize("n,ndev", [(16, 8), (13, 4), (10, 8), (3, 8), (5, 1)])
def test_functional_loss_and_grads_equal_one_device(n, ndev):
    """Even chunks, an uneven tail (13 over 4 = 4,4,4,1), fewer chunks than devices
    (10 over 8 = five chunks of 2), and one device: loss and gradients of one device."""
    p, x = mlp_params(), batch(n)
    y = jnp.ones((n, 3))
    dp = DataParallel((mlp_apply, p), device_ids=range(ndev))
    f = dp.value_and_grad(mse)
    loss, g = f(p, x, y)
    want_loss, want_g = jax.jit(jax.value_and_grad(lambda q: mse(mlp_apply(q, x), y)))(p)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    close(g, want_g)
    # where torch puts them: the loss on output_device, gradients on device_ids[0]
    assert loss.devices() == {jax.devices()[0]}
    assert all(a.devices() == {jax.devices()[0]} for a in jax.tree.leaves(g))
    # the same as differentiating through the eager DataParallel
    eager_loss, eager_g = jax.value_and_grad(lambda q: mse(dp.apply(q, x), y))(p)
    np.testing.assert_allclose(loss, eager_loss, rtol=1e-6)
    close(g, eager_g)
    # repeated calls (new values, same shapes) reuse the one compiled program
    for seed in (2, 3):
        xs = batch(n, seed=seed)
        loss, g = f(p, xs, y)
        close(g, jax.grad(lambda q, xs=xs: mse(mlp_apply(q, xs), y))(p))
    assert f.traces == 1
    assert dp.value_and_grad(mse) is f  # cached per loss function


def test_inputs_tuple_kwargs_has_aux_and_output_device():
    p = mlp_params()
    x, z = batch(12), batch(12, seed=5)

    def apply(q, a, b, scale=1.0):
        return {"sum": mlp_apply(q, a) + scale * mlp_apply(q, b), "a": mlp_apply(q, a)}

    def loss_fn(out, y, w):
        return jnp.sum(w * (out["sum"] - y) ** 2) + jnp.mean(out["a"]), out["a"].shape

    y, w = jnp.ones((12, 3)), jnp.float32(0.5)
    dp = DataParallel((apply, p), device_ids=[0, 1, 2], output_device=2)
    (loss, aux), g = dp.value_and_grad(loss_fn, has_aux=True)(p, (x, z), y, w, scale=0.25)
    ref = jax.value_and_grad(lambda q: loss_fn(apply(q, x, z, scale=0.25), y, w),
                             has_aux=True)
    (want, want_aux), want_g = ref(p)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert tuple(aux) == tuple(want_aux) == (12, 3)
    close(g, want_g)
    assert loss.devices() == {jax.devices()[2]}


def test_nnx_batchnorm_state_grads_and_optimizer_step():
    """An NNX model with BatchNorm: replica 0's statistics are kept (as when calling the
    DataParallel), gradients match nnx.grad through the eager DataParallel, and the
    returned State drives nnx.Optimizer(dp, ...)."""

    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.bn(self.lin(x))

    x, y = batch(10), jnp.ones((10, 4))
    fused_dp = DataParallel(Net(), device_ids=[0, 1, 2, 3])  # chunks 3, 3, 3, 1
    loss, g = fused_dp.value_and_grad(mse)(x, y)
    eager = DataParallel(Net(), device_ids=[0, 1, 2, 3])
    want_loss, want_g = nnx.value_and_grad(lambda m: mse(m(x), y))(eager)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    close(g, want_g)
    assert set(g.keys()) == {"module"}
    # replica 0's batch statistics: the BatchNorm of the first chunk alone
    first = Net()
    first(x[:chunk_sizes(10, 4)[0]])
    close(fused_dp.module.bn.mean.get_value(), first.bn.mean.get_value())
    close(fused_dp.module.bn.var.get_value(), first.bn.var.get_value())
    # an optimizer step with the returned gradients equals one with nnx.grad's
    opt = nnx.Optimizer(fused_dp, optax.sgd(0.1), wrt=nnx.Param)
    opt_ref = nnx.Optimizer(eager, optax.sgd(0.1), wrt=nnx.Param)
    opt.update(fused_dp, g)
    opt_ref.update(eager, want_g)
    close(nnx.state(fused_dp, nnx.Param), nnx.state(eager, nnx.Param))


def test_dropout_keys_are_folded_per_replica_as_in_the_forward():
    class Drop(nnx.Module):
        def __init__(self):
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(7))
            self.w = nnx.Param(jnp.ones(64))

        def __call__(self, x):
            return self.drop(x * self.w)

    x = jnp.ones((4, 64))
    a, b = Drop(), Drop()
    out = DataParallel(a, device_ids=[0, 1, 2, 3])(x)  # one row per replica
    _, g = DataParallel(b, device_ids=[0, 1, 2, 3]).value_and_grad(
        lambda o: jnp.sum(o))(x)
    # d/dw sum(drop(x * w)) = sum over rows of each replica's mask / keep-prob
    np.testing.assert_allclose(g["module"]["w"].get_value(), jnp.sum(out, axis=0), rtol=1e-6)
    assert int(b.drop.rngs.count.get_value()) == int(a.drop.rngs.count.get_value()) == 1


def test_scalar_outputs_warn_and_bad_uses_raise():
    p, x = mlp_params(), batch(8)
    dp = DataParallel((lambda q, a: jnp.sum(mlp_apply(q, a)), p), device_ids=[0, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, g = dp.value_and_grad(jnp.sum)(p, x)
    assert any(SCALAR_WARNING in str(w.message) for w in caught)
    close(g, jax.grad(lambda q: jnp.sum(mlp_apply(q, x)))(p))
    strings = DataParallel((lambda q, a: (mlp_apply(q, a), "tag"), p), device_ids=[0, 1])
    with pytest.raises(TypeError, match="non-array leaves.*'tag'"):
        strings.value_and_grad(lambda out: jnp.sum(out[0]))(p, x)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        dp.value_and_grad("mse")
    with pytest.raises(TypeError, match=r"\(params, inputs, \*loss_args\)"):
        dp.value_and_grad(jnp.sum)(x)
    with pytest.raises(ValueError, match="different sizes along dim 0"):
        DataParallel((lambda q, a, b: mlp_apply(q, a) + mlp_apply(q, b), p),
                     device_ids=[0, 1]).value_and_grad(jnp.sum)(p, (x, batch(6)))


def test_uneven_tail_with_another_output_structure_raises_as_in_the_eager_path():
    def keys(p, x):
        return {"a": x * p} if x.shape[0] > 1 else {"b": x * p}

    dp = DataParallel((keys, 1.0), device_ids=[0, 1, 2, 3])  # chunks 3, 3, 3, 1
    with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
        dp.value_and_grad(lambda out: jnp.sum(out["a"]))(1.0, jnp.ones(10))
    tuples = DataParallel((lambda p, x: x * p if x.shape[0] > 1 else (x, x), 1.0),
                          device_ids=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="structured differently"):
        tuples.value_and_grad(jnp.sum)(1.0, jnp.ones(10))
