"""replicate: one copy per device, reused while unchanged, differentiable (reduce-add)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.dp import ReplicaCache, replicate

DEVS = jax.devices()


def test_replicas_live_on_each_device_with_equal_values():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    reps = replicate(params, DEVS[:4], cache=ReplicaCache())
    assert len(reps) == 4
    for d, r in zip(DEVS[:4], reps, strict=True):
        for leaf, ref in zip(jax.tree.leaves(r), jax.tree.leaves(params), strict=True):
            assert leaf.devices() == {d}
            np.testing.assert_array_equal(leaf, ref)


def test_replicas_reused_while_params_unchanged_and_recopied_after_change():
    cache = ReplicaCache()
    params = {"w": jnp.ones(3)}
    first = replicate(params, [0, 1, 2], cache=cache)
    again = replicate({"w": params["w"]}, [0, 1, 2], cache=cache)  # same leaf objects
    assert all(a["w"] is b["w"] for a, b in zip(first, again, strict=True))
    assert cache.misses == 1
    changed = {"w": params["w"] + 1}
    new = replicate(changed, [0, 1, 2], cache=cache)
    assert cache.misses == 2 and new[0]["w"] is not first[0]["w"]
    np.testing.assert_array_equal(new[2]["w"], [2, 2, 2])
    replicate(changed, [0, 1], cache=cache)  # another device set is another entry
    assert cache.misses == 3


def test_replicate_nnx_module_gives_independent_modules():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    reps = replicate(model, [1, 3])
    assert all(isinstance(r, nnx.Linear) for r in reps)
    assert reps[1].kernel.get_value().devices() == {DEVS[3]}
    np.testing.assert_array_equal(reps[0].kernel.get_value(), model.kernel.get_value())
    reps[0].bias.set_value(reps[0].bias.get_value() + 1)
    assert float(model.bias.get_value().sum()) == 0.0


def test_gradient_through_replicas_is_summed_on_the_source():
    w = jax.device_put(jnp.arange(3.0), DEVS[0])

    def f(w):
        reps = replicate(w, DEVS[:3])
        return sum(jnp.sum(jax.device_put(r * (i + 1), DEVS[0]) ** 2)
                   for i, r in enumerate(reps))

    g = jax.grad(f)(w)
    np.testing.assert_allclose(g, 2 * w * (1 + 4 + 9), rtol=1e-6)
    assert g.devices() == {DEVS[0]}
