"""DataParallel / data_parallel: equal to one device (forward and gradients), traps, caching."""

import dataclasses
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.dp import DataParallel, data_parallel
from jdist.dp._scatter_gather import SCALAR_WARNING, chunk_sizes

DEVS = jax.devices()
TOL = dict(rtol=1e-6, atol=1e-6)


def mlp_apply(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def mlp_params(seed=0, d_in=5, d_h=7, d_out=3):
    k = jax.random.split(jax.random.key(seed), 4)
    return {"w1": jax.random.normal(k[0], (d_in, d_h)) / 3,
            "b1": jax.random.normal(k[1], (d_h,)),
            "w2": jax.random.normal(k[2], (d_h, d_out)) / 3,
            "b2": jax.random.normal(k[3], (d_out,))}


def batch(n, d=5, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, d))


def close(a, b):
    """Leaf by leaf within TOL, the absolute part scaled by the leaf's largest entry: a
    gradient summed over replicas in another order differs by float32 rounding of its
    largest terms, which an entry that cancels to near zero shows as a large relative
    error (0.2645741 vs 0.2645758 in a leaf whose entries reach 35)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        y = np.asarray(y)
        scale = max(1.0, float(np.abs(y).max(initial=0.0)))
        np.testing.assert_allclose(np.asarray(x), y, rtol=TOL["rtol"],
                                   atol=TOL["atol"] * scale)


@pytest.mark.parametrize("n,ndev", [(16, 8), (10, 4)])
def test_functional_forward_and_grad_equal_single_device(n, ndev):
    p, x = mlp_params(), batch(n)
    dp = DataParallel((mlp_apply, p), device_ids=range(ndev))
    out = dp(x)
    assert out.devices() == {DEVS[0]}
    close(out, jax.jit(mlp_apply)(p, x))
    loss = lambda p: jnp.mean((dp.apply(p, x) - 1.0) ** 2)  # noqa: E731
    ref = lambda p: jnp.mean((mlp_apply(p, x) - 1.0) ** 2)  # noqa: E731
    g = jax.grad(loss)(p)
    close(g, jax.jit(jax.grad(ref))(p))
    assert all(leaf.devices() == {DEVS[0]} for leaf in jax.tree.leaves(g))


@dataclasses.dataclass
class Extra:  # a plain (unregistered) dataclass: scattered field by field
    m: object
    note: str = "n"


class Out(NamedTuple):
    y: object
    mode: object
    none: object


def test_tuple_dict_dataclass_and_kwargs_inputs():
    p, x = mlp_params(), batch(11)
    mask = jnp.arange(11.0)[:, None] % 3

    def apply(p, inputs, extra, *, scale, mode):
        a, b = inputs
        out = mlp_apply(p, a + b) * extra["e"].m * scale
        assert extra["e"].note == "n" and extra["e"].m.shape[0] in (3, 2, 11)
        return Out(y=out, mode=mode, none=None)

    want = jax.jit(lambda p: apply(p, (x, x * 2), {"e": Extra(mask)}, scale=0.5,
                                   mode="train").y)(p)
    got = data_parallel((apply, p), ((x, x * 2), {"e": Extra(mask)}), device_ids=[0, 1, 2, 3],
                        module_kwargs={"scale": 0.5, "mode": "train"})
    assert isinstance(got, Out)
    close(got.y, want)
    assert got.none is None
    assert got.mode == ["train"] * 4  # other objects: one per replica, as a list
    g = jax.grad(lambda p: jnp.sum(data_parallel(
        (apply, p), ((x, x * 2), {"e": Extra(mask)}), [0, 1, 2, 3],
        module_kwargs={"scale": 0.5, "mode": "t"}).y ** 2))(p)
    close(g, jax.jit(jax.grad(lambda p: jnp.sum(apply(p, (x, x * 2), {"e": Extra(mask)}, scale=0.5,
                                                      mode="t").y ** 2)))(p))


class Net(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.normal(0.5)  # cheaper to run eagerly than lecun_normal
        self.l1 = nnx.Linear(5, 8, kernel_init=init, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, kernel_init=init, rngs=rngs)

    def __call__(self, x, *, shift=0.0):
        return self.l2(jax.nn.gelu(self.l1(x))) + shift


@pytest.mark.parametrize("n", [16, 13])
def test_nnx_forward_and_nnx_grad_equal_single_device(n):
    x = batch(n)
    model = Net(nnx.Rngs(0))
    ref = nnx.clone(model)
    dp = DataParallel(model, device_ids=DEVS)
    close(dp(x, shift=1.0), nnx.jit(lambda m, x: m(x, shift=1.0))(ref, x))

    def loss(m, x):
        return jnp.mean(m(x, shift=1.0) ** 2)

    g_dp = nnx.grad(loss)(dp, x)
    g_ref = nnx.jit(nnx.grad(loss))(ref, x)
    close(g_dp["module"], g_ref)
    assert dp.module is model


def test_jit_of_grad_through_data_parallel_keeps_semantics():
    p, x = mlp_params(), batch(13)
    dp = DataParallel((mlp_apply, p), device_ids=DEVS)
    f = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(dp.apply(p, x) ** 2)))
    v, g = f(p, x)
    v_ref, g_ref = jax.jit(jax.value_and_grad(lambda p: jnp.sum(mlp_apply(p, x) ** 2)))(p)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    close(g, g_ref)


def test_batchnorm_each_replica_uses_its_chunk_and_replica0_update_is_kept():
    x = batch(10, d=3)
    model = nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
    out = DataParallel(model, device_ids=[0, 1, 2, 3])(x)  # chunks 3, 3, 3, 1... n=10
    sizes = chunk_sizes(10, 4)
    starts = np.cumsum((0,) + sizes)
    refs = []
    for i in range(len(sizes)):
        r = nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
        refs.append((r, nnx.jit(lambda m, x: m(x))(r, x[starts[i]:starts[i + 1]])))
    close(out, jnp.concatenate([o for _, o in refs]))
    close(model.mean.get_value(), refs[0][0].mean.get_value())
    close(model.var.get_value(), refs[0][0].var.get_value())
    # the same inside nnx.jit (computed as a vmap over replicas)
    traced = nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
    out_jit = nnx.jit(lambda m, x: m(x))(DataParallel(traced, device_ids=[0, 1, 2, 3]), x)
    close(out_jit, out)
    close(traced.mean.get_value(), refs[0][0].mean.get_value())


def test_output_device_and_cpu_target():
    p, x = mlp_params(), batch(9)
    out = DataParallel((mlp_apply, p), device_ids=[1, 2, 3], output_device=2)(x)
    assert out.devices() == {DEVS[2]}
    close(out, mlp_apply(p, x))
    out = data_parallel((mlp_apply, p), x, [4, 5], output_device="cpu")
    assert out.devices() == {jax.devices("cpu")[0]}
    cols = jnp.arange(14.0).reshape(2, 7)  # dim=1: chunks 3, 3, 1 of the columns
    np.testing.assert_array_equal(
        data_parallel((lambda p, x: x * p, 2.0), cols, [0, 1, 2], dim=1), 2 * cols)


def test_one_device_or_one_chunk_calls_the_module_directly():
    calls = []

    def apply(p, x):
        calls.append(type(x).__name__)
        return x * p

    dp = DataParallel((apply, 2.0), device_ids=[0, 1, 2, 3])
    np.testing.assert_array_equal(dp(jnp.ones((1, 2))), 2 * np.ones((1, 2)))  # one chunk
    np.testing.assert_array_equal(
        data_parallel((apply, 2.0), jnp.ones(3), device_ids=[3]), [2, 2, 2])  # one device
    assert calls == ["ArrayImpl", "ArrayImpl"]  # concrete arrays: not traced, not compiled


def test_repeated_calls_reuse_compiled_programs_and_replicas():
    traces = []

    def apply(p, x):
        traces.append(x.shape)
        return mlp_apply(p, x)

    p = mlp_params()
    dp = DataParallel((apply, p), device_ids=range(8))
    for seed in range(3):
        close(dp(batch(13, seed=seed)), jax.jit(mlp_apply)(p, batch(13, seed=seed)))
    assert sorted(traces) == [(1, 5), (2, 5)]  # equal chunks: one SPMD program; tail: one
    assert dp._runtime.replicas.misses == 2  # one copy per placement, made once
    dp.params = jax.tree.map(lambda a: a + 1, p)
    dp(batch(13))
    assert dp._runtime.replicas.misses == 4 and len(traces) == 2


def test_eager_grad_reuses_replicas_and_returns_cotangents_to_the_params_device():
    p = jax.device_put(mlp_params(), DEVS[3])  # parameters away from device_ids[0]
    x = batch(13)
    dp = DataParallel((mlp_apply, p), device_ids=range(8))
    loss = lambda p: jnp.mean((dp.apply(p, x) - 1.0) ** 2)  # noqa: E731
    ref = jax.jit(jax.value_and_grad(lambda p: jnp.mean((mlp_apply(p, x) - 1.0) ** 2)))
    want_l, want_g = ref(p)
    for _ in range(3):
        got_l, got_g = jax.value_and_grad(loss)(p)
        close((got_l, got_g), (want_l, want_g))
        assert all(leaf.devices() == {DEVS[3]} for leaf in jax.tree.leaves(got_g))
    assert dp._runtime.replicas.misses == 2  # copies of the same values made once
    q = jax.tree.map(lambda a: a * 2, p)  # new values: copied again, gradients follow them
    close(jax.grad(loss)(q), jax.jit(jax.grad(
        lambda p: jnp.mean((mlp_apply(p, x) - 1.0) ** 2)))(q))
    assert dp._runtime.replicas.misses == 4


def test_mismatched_batch_sizes_raise_instead_of_dropping_samples():
    dp = DataParallel((lambda p, a, b: a + b.sum(), 0.0), device_ids=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"different sizes along dim 0.*: 5.*: 2"):
        dp(jnp.ones(5), jnp.ones(2))


def test_replica_exception_names_replica_and_device():
    def apply(p, x):
        if x.shape[0] == 1:
            raise ZeroDivisionError("tail chunk is too small")
        return x * p

    with pytest.raises(ZeroDivisionError) as info:
        data_parallel((apply, 1.0), jnp.ones(10), [0, 1, 2, 3])
    msg = str(info.value)
    assert f"Caught ZeroDivisionError in replica 3 on device {DEVS[3].id}." in msg
    assert "Original Traceback (most recent call last)" in msg and "tail chunk" in msg

    def always(p, x):
        raise ValueError("bad")

    with pytest.raises(ValueError, match=re.escape(f"Caught ValueError in replica 0 on device "
                                                   f"{DEVS[0].id}.")):
        data_parallel((always, 1.0), jnp.ones(8), [0, 1, 2, 3])


def test_scalar_outputs_become_a_vector_with_torch_warning():
    def loss(p, x):
        return jnp.sum(x * p)

    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        v = data_parallel((loss, 2.0), jnp.arange(10.0), [0, 1, 2, 3])
    np.testing.assert_allclose(v, [2 * (0 + 1 + 2), 2 * (3 + 4 + 5), 2 * (6 + 7 + 8), 18.0])


def test_string_outputs_and_dict_key_mismatch():
    out = data_parallel((lambda p, x: (x * p, f"rows={x.shape[0]}"), 1.0), jnp.ones(10),
                        [0, 1, 2, 3])
    assert out[1] == ["rows=3", "rows=3", "rows=3", "rows=1"]

    def keys(p, x):
        return {"a": x} if x.shape[0] > 1 else {"b": x}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
            data_parallel((keys, 1.0), jnp.ones(10), [0, 1, 2, 3])
        with pytest.raises(ValueError, match="structured differently"):
            data_parallel((lambda p, x: x if x.shape[0] > 1 else (x, x), 1.0), jnp.ones(10),
                          [0, 1, 2, 3])
    obj = object()  # unhashable-or-not objects pass through the direct (one chunk) path
    assert data_parallel((lambda p, x: (x, [obj]), 1.0), jnp.ones(1), [0, 1])[1][0] is obj


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="nnx.Module or an"):
        DataParallel(lambda x: x)
    with pytest.raises(ValueError, match="out of range"):
        DataParallel((mlp_apply, {}), device_ids=[0, 99])
    with pytest.raises(ValueError, match="dim must be"):
        DataParallel((mlp_apply, {}), dim=-1)


def test_dropout_masks_are_independent_across_replicas():
    class Drop(nnx.Module):
        def __init__(self):
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.drop(x)

    model = Drop()
    twin = nnx.clone(model)
    key_before = jax.random.key_data(model.drop.rngs.key.get_value())
    out = DataParallel(model, device_ids=[0, 1, 2, 3])(jnp.ones((4, 64)))  # one row each
    # inside nnx.jit (vmap over replicas) replica i draws the very same mask
    out_jit = nnx.jit(lambda m, x: m(x))(DataParallel(twin, device_ids=[0, 1, 2, 3]),
                                         jnp.ones((4, 64)))
    np.testing.assert_array_equal(out_jit, out)
    masks = np.asarray(out) != 0
    assert all(not np.array_equal(masks[0], masks[i]) for i in range(1, 4))
    assert 0.25 < masks.mean() < 0.75
    assert int(model.drop.rngs.count.get_value()) == 1  # replica 0's update
    np.testing.assert_array_equal(
        jax.random.key_data(model.drop.rngs.key.get_value()), key_before)


def test_grad_wrt_python_scalar_params_and_numpy_inputs():
    x = np.arange(26, dtype=np.float32).reshape(13, 2)  # numpy batch, uneven over 8
    labels = np.arange(13)
    out = data_parallel((lambda p, x, y: (x.sum(1) * p, y), 2.0), (x, labels), range(8))
    np.testing.assert_allclose(out[0], 2 * x.sum(1), rtol=1e-6)
    np.testing.assert_array_equal(out[1], labels)
    g = jax.grad(lambda p: data_parallel((lambda p, x: x.sum(1) * p, p), x, range(8)).sum())
    np.testing.assert_allclose(g(2.0), x.sum(), rtol=1e-6)  # cotangents meet on device 0
