"""One axis helper (``jdist/collectives/_axis.py``) for collectives, optimizers and hooks.

Each user outside ``shard_map`` gets the same ``UnboundAxisError`` (a ``NameError`` as
JAX's own, and a ``ValueError`` as before for the optimizers and hooks) naming itself,
the axis and the fix; ZeRO's traced functions never store the layout on the optimizer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jdist.collectives import functional as F
from jdist.collectives._axis import UnboundAxisError, axis_of, bound_size, is_bound
from jdist.optim import DistributedOptimizer, ZeroRedundancyOptimizer
from tests.optim.test_zero import group_of, params0


def test_axis_of_and_bound_size():
    assert axis_of("tp") == "tp" and axis_of(("a",)) == "a" and axis_of(("a", "b")) == ("a", "b")
    assert axis_of(None) == "dp" and axis_of(group_of(2)) == "dp"
    with pytest.raises(TypeError, match=r"pass tuple\(\['a'\]\) instead"):
        axis_of(["a"])
    with pytest.raises(TypeError, match="got 3"):
        axis_of(3)
    assert not is_bound("dp")
    with pytest.raises(UnboundAxisError, match="^me: mesh axis 'dp' is not bound here. fix it$"):
        bound_size("dp", "me", "fix it")
    mesh = group_of(4).mesh
    sizes = jax.jit(jax.shard_map(lambda x: x * bound_size("dp", "me", "") + is_bound("dp"),
                                  mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))(jnp.ones(4))
    np.testing.assert_array_equal(np.asarray(sizes), [5.0] * 4)


def test_every_user_raises_the_same_unbound_axis_error():
    p = params0()
    dtx = DistributedOptimizer(optax.sgd(0.1))
    zero = ZeroRedundancyOptimizer(optax.sgd(0.1), group=group_of(2))
    calls = {
        "jdist.collectives.functional.all_reduce": lambda: F.all_reduce(jnp.ones(2), "dp"),
        "DistributedOptimizer.update": lambda: dtx.update(p, dtx.init(p), p),
        "ZeroRedundancyOptimizer.update": lambda: zero.update(p, zero.init(p), p),
    }
    for what, call in calls.items():
        with pytest.raises(UnboundAxisError) as info:
            call()
        assert isinstance(info.value, NameError) and isinstance(info.value, ValueError)
        assert str(info.value).startswith(f"{what}: mesh axis 'dp' is not bound here."), info


def test_zero_layout_is_not_stored_by_traced_functions():
    g = group_of(4)
    zero = ZeroRedundancyOptimizer(optax.adam(1e-2), group=g)

    def body(params, grads):
        state = zero.init(params)  # traced: the local shard state
        u, _ = zero.update(grads, state, params)
        return optax.apply_updates(params, u)

    grads = jax.tree.map(lambda x: jnp.ones_like(x), params0())
    out = jax.jit(jax.shard_map(body, mesh=g.mesh, in_specs=(P(), P()), out_specs=P(),
                                check_vma=False))(params0(), grads)
    assert zero.layout is None  # static layout passed as an argument, never set on self
    ref_u, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params0()), params0())
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(optax.apply_updates(params0(), ref_u)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    zero.init(params0())  # eager: remembered for the specs and state dicts
    assert zero.layout is not None
