"""A recorded call's parameter holder seen through its pytree flattening (``_PytreeView``)
must find exactly what ``nnx.split`` finds, or not be used.

References: ``nnx.grad`` of the same loss on the original module, and ``Tracked`` with
``graph=True`` (``nnx.split``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.rpc.autograd._params import Tracked, _pytree_view


class Block(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


def _loss(module, x):
    return jnp.sum(jnp.tanh(module(x)))


def _ids(variables):
    return sorted(id(v) for v in variables)


def test_the_view_sees_the_split_variables_and_gives_nnx_grads():
    x = np.random.RandomState(0).randn(5, 3).astype(np.float32)
    m, ref = Block(), Block()
    t = Tracked(m)
    assert t._view is not None
    graph = Tracked(m, graph=True)
    assert _ids(t.variables) == _ids(graph.variables)
    assert _ids(t._rest_vars) == _ids(graph._rest_vars)

    copies = []

    def f(pvals):
        copies.append(t.rebuild(pvals))
        return _loss(copies[-1], x), t.state_after()

    (value, state), grads = jax.value_and_grad(f, has_aux=True)(t.values())
    t.write_back(state)
    want_value, want = nnx.value_and_grad(_loss)(ref, x)  # updates ref's state in place
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    got = {id(v): g for v, g in zip(t.variables, grads, strict=True)}
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        want_g = dict(nnx.to_flat_state(want))[path]
        np.testing.assert_allclose(got[id(var)], want_g.get_value(), rtol=1e-5, atol=1e-6)
    # the state went back into the original: batch statistics and the RNG counter moved
    np.testing.assert_allclose(m.bn.mean.get_value(), ref.bn.mean.get_value(), rtol=1e-6)
    assert int(m.drop.rngs.count.get_value()) == int(ref.drop.rngs.count.get_value()) == 1
    # the copy has Variables of its own: the original's stay as they were
    assert copies[0].lin.kernel is not m.lin.kernel and copies[0].bn.mean is not m.bn.mean
    np.testing.assert_array_equal(m.lin.kernel.get_value(), ref.lin.kernel.get_value())


def test_shared_submodules_and_non_pytree_modules_take_nnx_split():
    lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    class Shared(nnx.Module):
        def __init__(self):
            self.a, self.b = lin, lin

    class Graph(nnx.Module, pytree=False):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

    for module in (Shared(), Graph()):
        assert _pytree_view(module) is None
        t = Tracked(module)
        assert t._view is None
        assert _ids(t.variables) == _ids(Tracked(module, graph=True).variables)
    # the shared kernel's gradient is the sum over both uses, as nnx.grad gives it
    s, x = Shared(), jnp.ones((1, 2))
    t = Tracked(s)
    grads = jax.grad(lambda p: jnp.sum(jnp.sin((c := t.rebuild(p)).a(x) * c.b(x))))(
        t.values())
    want = nnx.grad(lambda m: jnp.sum(jnp.sin(m.a(x) * m.b(x))))(s)
    got = {id(v): g for v, g in zip(t.variables, grads, strict=True)}
    np.testing.assert_allclose(got[id(lin.kernel)], want["a"]["kernel"].get_value(),
                               rtol=1e-6)


def test_a_changed_structure_is_checked_again():
    m = Block()
    first = Tracked(m)
    assert first._view is not None and len(first.variables) == 4
    m.extra = nnx.Linear(4, 1, rngs=nnx.Rngs(1))  # a new submodule: new parameters
    again = Tracked(m)
    assert again._view is not None and again.gdef != first.gdef
    assert _ids(again.variables) == _ids(Tracked(m, graph=True).variables)
    assert len(again.variables) == 6
    m.lin.kernel = nnx.Param(jnp.zeros((3, 4)))  # a replaced Variable, same structure
    third = Tracked(m)
    assert third.gdef == again.gdef and any(v is m.lin.kernel for v in third.variables)
    m.lin.bias = m.bn.bias  # the structure verified, but one Variable at two places
    assert _pytree_view(m) is None
    assert _ids(Tracked(m).variables) == _ids(Tracked(m, graph=True).variables)


def _same_as_fresh_split(t, m):
    """``t`` (from ``Tracked.of_module``) is what a split of ``m`` now gives."""
    fresh = Tracked(m, graph=True)
    assert t.gdef == fresh.gdef and t._tdef == fresh._tdef
    assert [id(v) for v in t.variables] == [id(v) for v in fresh.variables]
    for a, b in zip(t.values(), fresh.values(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    def arrays(state):
        return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree_util.tree_leaves(state)]

    rest, want = arrays(t.rest), arrays(fresh.rest)
    assert len(rest) == len(want)
    for a, b in zip(rest, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_of_module_reuses_its_split_while_the_module_keeps_its_variables():
    """The split made once per module reads the current values (an optimizer writes
    into the Variables, a forward advances the RNG counters and batch statistics) and is
    made again when the module holds other Variables or another structure."""
    m = Block()
    first = Tracked.of_module(m)
    _same_as_fresh_split(first, m)
    m.lin.kernel[...] = m.lin.kernel[...] + 1.0  # an optimizer step, in place
    m(np.ones((2, 3), np.float32))  # batch statistics and the dropout RNG count move
    again = Tracked.of_module(m)
    assert again.gdef is first.gdef  # the same split, not a new one
    _same_as_fresh_split(again, m)
    m.lin.bias = nnx.Param(jnp.full((4,), 7.0))  # another Variable: split again
    third = Tracked.of_module(m)
    assert third.gdef is not first.gdef
    assert any(a is not b for a, b in zip(third.variables, first.variables, strict=True))
    _same_as_fresh_split(third, m)
    m.extra = nnx.Param(jnp.zeros(2))  # another structure: split again
    fourth = Tracked.of_module(m)
    assert len(fourth.variables) == len(first.variables) + 1
    _same_as_fresh_split(fourth, m)
