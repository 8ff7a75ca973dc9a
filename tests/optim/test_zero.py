"""ZeroRedundancyOptimizer: sharded Adam equals unsharded optax; memory; state dicts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp.hooks import comm_report
from jdist.optim import ZeroRedundancyOptimizer, flat_partition
from tests.helpers import tree_allclose


def group_of(n):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs, "dp"), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"LOCAL{n}")


def params0():
    k = jax.random.split(jax.random.key(0), 3)
    return {"w1": jax.random.normal(k[0], (13, 7)), "b1": jnp.zeros((7,)),
            "w2": jax.random.normal(k[1], (7, 3)), "scale": jnp.ones(())}


def grads_seq(n, steps):
    keys = jax.random.split(jax.random.key(1), steps)
    return [jax.tree.map(lambda p, kk=kk: jax.random.normal(kk, (n,) + p.shape), params0())
            for kk in keys]


def zero_steps(zero, params, state, seq):
    """jit(shard_map) K steps: per-replica grads -> ZeRO update -> apply."""
    g = zero.group
    specs = zero.state_partition_specs(state)

    def body(params, state, seq):
        for grads in seq:
            u, state = zero.update(jax.tree.map(lambda x: x[0], grads), state, params)
            params = optax.apply_updates(params, u)
        return params, state

    f = jax.jit(jax.shard_map(body, mesh=g.mesh, in_specs=(P(), specs, P("dp")),
                              out_specs=(P(), specs), check_vma=False))
    seq = jax.device_put(seq, NamedSharding(g.mesh, P("dp")))
    return f, (params, state, seq)


def plain_steps(tx, params, seq):
    state = tx.init(params)
    for grads in seq:
        u, state = tx.update(jax.tree.map(lambda x: x.mean(0), grads), state, params)
        params = optax.apply_updates(params, u)
    return params, state


def local_bytes(state):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sharded_adam_equals_unsharded_and_state_is_one_nth(n):
    tx = optax.adam(1e-2)
    zero = ZeroRedundancyOptimizer(tx, group=group_of(n))
    state = zero.init(params0())
    full = sum(np.asarray(x).nbytes for x in jax.tree.leaves(tx.init(params0())))
    # per replica: mu and nu hold ceil(size / n) elements of each matrix/vector leaf;
    # the scalar leaf's mu, nu and Adam's int32 count are replicated
    shard = sum(-(-int(np.prod(p.shape)) // n) for p in jax.tree.leaves(params0()) if p.ndim)
    assert local_bytes(state) == 2 * 4 * shard + 2 * 4 + 4
    assert local_bytes(state) <= full / n + 2 * 4 * 3 + 2 * 4 + 4  # padding: < 1 per leaf
    seq = grads_seq(n, 2)
    f, args = zero_steps(zero, params0(), state, seq)
    p_zero, state = f(*args)
    p_ref, s_ref = plain_steps(tx, params0(), seq)
    tree_allclose(p_zero, p_ref, rtol=1e-6, atol=1e-6)
    # consolidation gives exactly the unsharded optax state
    zero.consolidate_state_dict(state, to=0)
    sd = zero.state_dict()
    tree_allclose(sd["state"], s_ref, rtol=1e-6, atol=1e-6)


def test_state_dict_round_trip_and_resharding():
    tx = optax.adam(1e-2)
    seq = grads_seq(4, 4)
    zero4 = ZeroRedundancyOptimizer(tx, group=group_of(4))
    f, args = zero_steps(zero4, params0(), zero4.init(params0()), seq[:2])
    p_mid, s_mid = f(*args)
    with pytest.raises(RuntimeError, match=r"Optimizer state has not been consolidated on this "
                                           r"rank. Please call `consolidate_state_dict\(to=0\)`"):
        zero4.state_dict()
    zero4.consolidate_state_dict(s_mid, to=0)
    sd = zero4.state_dict()
    # reload into the same size: same shards
    back = zero4.load_state_dict(sd)
    tree_allclose(back, s_mid, rtol=0, atol=0)
    # and into a ZeRO over 2 replicas: continue training, equal to unsharded all along
    p_mid = jax.device_get(p_mid)
    ref_p, _ = plain_steps(tx, params0(), seq[:2])
    tree_allclose(p_mid, ref_p, rtol=1e-6, atol=1e-6)
    zero2 = ZeroRedundancyOptimizer(tx, group=group_of(2))
    zero2.init(p_mid)
    s2 = zero2.load_state_dict(sd)
    seq2 = [jax.tree.map(lambda x: x[:2], g) for g in seq[2:]]
    f2, args2 = zero_steps(zero2, p_mid, s2, seq2)
    p_end, _ = f2(*args2)
    state, params = sd["state"], p_mid
    for grads in seq2:
        u, state = tx.update(jax.tree.map(lambda x: x.mean(0), grads), state, params)
        params = optax.apply_updates(params, u)
    tree_allclose(p_end, params, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="to=5 is not a rank of the group"):
        zero4.consolidate_state_dict(s_mid, to=5)


def test_ddp_mode_collectives_and_partition():
    lay = flat_partition(params0(), 8)
    # w1 91 -> 12, b1 7 -> 1, w2 21 -> 3 per replica; the scalar is not in the buffer
    assert [(k, total, shard) for k, _, _, total, shard in lay.groups] == [("float32", 119, 16)]
    tx = optax.sgd(0.1)
    zero = ZeroRedundancyOptimizer(tx, group=group_of(8))
    f, args = zero_steps(zero, params0(), zero.init(params0()), grads_seq(8, 1))
    ops = [(c.op, c.elements, c.result_elements) for c in comm_report(f, *args).collectives]
    assert sorted(ops) == [("all-gather", 16, 128), ("all-reduce", 1, 1),
                           ("reduce-scatter", 128, 16)]
    # already-averaged gradients (DDP): no reduce-scatter, same result as averaging first
    ddp_zero = ZeroRedundancyOptimizer(tx, group=group_of(8), average_gradients=False)
    seq = grads_seq(8, 1)
    mean = [jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), g) for g in seq]
    f2, args2 = zero_steps(ddp_zero, params0(), ddp_zero.init(params0()), mean)
    assert [c.op for c in comm_report(f2, *args2).collectives] == ["all-gather"]
    tree_allclose(f2(*args2)[0], f(*args)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"outside it, use zero.step\(params, grads, state\)"):
        zero.update(params0(), zero.init(params0()), params0())
    with pytest.raises(ValueError, match="empty parameter list"):
        ZeroRedundancyOptimizer(tx).init({})
    with pytest.raises(TypeError, match="expects an optax GradientTransformation"):
        ZeroRedundancyOptimizer(object())


def test_zero_step_after_ddp_gradients_equals_plain_optax():
    """torch's pattern: DDP averages gradients, ZeRO steps its shard and gathers."""
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from tests.ddp.models import MLP, data, mse

    tx = optax.adam(1e-2)
    model = MLP((16, 32, 4), rngs=nnx.Rngs(0))
    ref_params = jax.device_get(nnx.state(model, nnx.Param))
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(tx)
    state = zero.init(nnx.state(model, nnx.Param))
    vg = ddp.value_and_grad(mse)
    ref_state, all_grads = tx.init(ref_params), []
    for i in range(3):
        _, grads = vg(data(seed=i))
        all_grads.append(jax.device_get(grads))
        new_params, state = zero.step(nnx.state(ddp.module, nnx.Param), grads, state)
        nnx.update(ddp.module, new_params)
    for grads in all_grads:
        u, ref_state = tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    tree_allclose(jax.device_get(nnx.state(ddp.module, nnx.Param)), ref_params,
                  rtol=1e-6, atol=1e-6)
    assert local_bytes(state) < sum(np.asarray(x).nbytes for x in jax.tree.leaves(ref_state))
    # the specs also cover an nnx.Optimizer's state (leaves wrapped in Variables)
    opt = nnx.Optimizer(MLP((16, 32, 4), rngs=nnx.Rngs(0)), ZeroRedundancyOptimizer(tx),
                        wrt=nnx.Param)
    specs = jax.tree.leaves(opt.tx.state_partition_specs(nnx.split(opt)[1]),
                            is_leaf=lambda x: isinstance(x, P))
    # mu and nu of 2 kernels and 2 biases; Adam's count and the nnx step
    assert sorted(specs, key=str) == [P("dp")] * 8 + [P(), P()]
