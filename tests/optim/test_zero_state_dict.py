"""ZeRO state <-> a plain (unsharded) optimizer's state, both ways; torch's TypeError
for parameters that are not arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.optim import ZeroRedundancyOptimizer
from tests.helpers import tree_allclose
from tests.optim.test_zero import group_of


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 5, rngs=rngs)
        self.l2 = nnx.Linear(5, 2, rngs=rngs)


def is_matrix(p):
    return jax.tree.map(lambda x: x.ndim > 1, p)


TXS = {"adam": lambda: optax.adam(1e-2),
       "adamw_mask_callable": lambda: optax.chain(
           optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1, mask=is_matrix))}
# the forms in which a plain nnx.Optimizer's state reaches load_state_dict
FORMS = {"nnx_state_of_optimizer": lambda opt: nnx.state(opt),
         "opt_state_variables": lambda opt: opt.opt_state,
         "pure_opt_state_in_dict": lambda opt: {"state": nnx.as_pure(opt.opt_state)}}


def grads(model, i):
    """Random gradients as an nnx.State of Params (what nnx.Optimizer.update takes)."""
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(i), len(jax.tree.leaves(state))))
    return jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), state)


def pure_params(model):
    return nnx.as_pure(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("name", sorted(TXS))
def test_plain_nnx_optimizer_state_loads_into_zero_and_back(name, form):
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TXS[name](), wrt=nnx.Param)
    for i in range(2):
        opt.update(model, grads(model, i))
    # plain -> ZeRO: continue two steps sharded, equal to continuing the plain optimizer
    zero = ZeroRedundancyOptimizer(TXS[name](), group=group_of(4))
    params = pure_params(model)
    zero.init(params)
    state = zero.load_state_dict(FORMS[form](opt))
    for i in range(2, 4):
        g = grads(model, i)
        params, state = zero.step(params, nnx.as_pure(g), state)
        opt.update(model, g)
    tree_allclose(jax.device_get(params), jax.device_get(pure_params(model)))
    # ZeRO -> plain: the consolidated state continues in a plain nnx.Optimizer
    zero.consolidate_state_dict(state)
    full = zero.state_dict()["state"]
    tree_allclose(full, jax.device_get(nnx.as_pure(opt.opt_state)))
    other = nnx.Optimizer(model, TXS[name](), wrt=nnx.Param)
    for var, x in zip(jax.tree.leaves(other.opt_state, is_leaf=lambda v: isinstance(
            v, nnx.Variable)), jax.tree.leaves(full), strict=True):
        var[...] = jnp.asarray(x)
    g = grads(model, 9)
    params, _ = zero.step(params, nnx.as_pure(g), state)
    other.update(model, g)
    tree_allclose(jax.device_get(params), jax.device_get(pure_params(model)))


def test_load_state_dict_names_a_missing_or_misshapen_entry():
    zero = ZeroRedundancyOptimizer(optax.adam(1e-2), group=group_of(2))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    zero.init(params)
    other = optax.adam(1e-2).init({"w": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match=r"state_dict entry \[0\]\.mu\['b'\] is missing"):
        zero.load_state_dict({"state": other})
    wrong = optax.adam(1e-2).init({"w": jnp.ones((2, 3)), "b": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"\[0\]\.mu\['w'\] has shape \(2, 3\)"):
        zero.load_state_dict(wrong)


# torch (test_zero_redundancy_optimizer.py, test_constructor): a float, or a list with a
# non-tensor, is a TypeError; an empty list a ValueError
BAD_PARAMS = {"float": (1.2, TypeError, "float 1.2"),
              "list_with_int": ([1, np.ones(3, np.float32)], TypeError, r"\[0\] is int 1"),
              "dict_with_str": ({"w": "x"}, TypeError, r"\['w'\] is str"),
              "empty_list": ([], ValueError, "empty parameter list")}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_bad_params_raise_torchs_exception_classes(case):
    params, exc, msg = BAD_PARAMS[case]
    with pytest.raises(exc, match=msg):
        ZeroRedundancyOptimizer(optax.sgd(0.1), group=group_of(2)).init(params)


@pytest.mark.parametrize("to_n", [2, 8])
def test_stored_leaves_resize_to_another_replica_count_exactly(to_n):
    """What a checkpoint restore on another world size does with each flat leaf."""
    params = {"w": jnp.arange(21.0).reshape(7, 3), "b": jnp.ones(5), "s": jnp.ones(())}
    tx = optax.adamw(1e-2, weight_decay=0.1, mask=is_matrix)
    zero4 = ZeroRedundancyOptimizer(tx, group=group_of(4))
    state = zero4.step(params, jax.tree.map(jnp.cos, params), zero4.init(params))[1]
    zero4.consolidate_state_dict(state)
    zero_n = ZeroRedundancyOptimizer(tx, group=group_of(to_n))
    zero_n.init(params)
    want = zero_n.load_state_dict(zero4.state_dict())
    got = [zero_n.resize_state_leaf(np.asarray(x), w.shape[0]) if x.ndim else np.asarray(x)
           for x, w in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True)]
    for g, w in zip(got, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, np.asarray(w))
    with pytest.raises(ValueError, match="restore on the saving world size"):
        zero_n.resize_state_leaf(np.arange(1.0, 9.0), 4)
