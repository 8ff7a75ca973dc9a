"""DistributedOptimizer: Horovod semantics checked against plain optax on averaged grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jdist.collectives._group import make_mesh
from jdist.collectives._types import ReduceOp
from jdist.ddp.hooks import comm_report
from jdist.optim import Compression, DistributedOptimizer
from tests.helpers import tree_allclose

N = 8


def _params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {"w": jax.random.normal(k1, (6, 5)), "b": jax.random.normal(k2, (5,)),
            "v": jax.random.normal(k3, (3,))}


def _grads(seed):
    p = _params()
    keys = jax.random.split(jax.random.key(seed), len(p))
    return {k: jax.random.normal(kk, (N,) + v.shape) for kk, (k, v) in zip(keys, p.items(),
                                                                          strict=True)}


def _runner(dtx, steps_grads):
    """Run dtx.update inside shard_map for each per-replica grads tree; return updates."""
    mesh = make_mesh(jax.devices()[:N], "dp")

    def body(params, grads_seq):
        state = dtx.init(params)
        outs = []
        for g in grads_seq:
            u, state = dtx.update(jax.tree.map(lambda x: x[0], g), state, params)
            outs.append(jax.tree.map(lambda x: x[None], u))
        return outs

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P("dp"),
                              check_vma=False))
    return f, (_params(), steps_grads)


def _replica(tree, i=0):
    return jax.tree.map(lambda x: x[i], tree)


def test_equals_averaged_grads_then_tx():
    tx = optax.adam(1e-2)
    gs = [_grads(1), _grads(2)]
    f, args = _runner(DistributedOptimizer(tx), gs)
    outs = f(*args)
    params, state = _params(), tx.init(_params())
    for g, out in zip(gs, outs, strict=True):
        ref, state = tx.update(jax.tree.map(lambda x: x.mean(0), g), state, params)
        for i in (0, N - 1):  # identical on every replica
            tree_allclose(_replica(out, i), ref, rtol=1e-5, atol=1e-6)


def test_fused_into_one_collective_per_dtype_and_fp16_halves_bytes():
    gs = [_grads(1)]
    f, args = _runner(DistributedOptimizer(optax.sgd(0.1)), gs)
    lowered = f.lower(*args)
    plain = comm_report(lowered)
    fused = comm_report(lowered.compile())  # XLA's combiner fuses the dtype group
    f, args = _runner(DistributedOptimizer(optax.sgd(0.1), compression=Compression.fp16), gs)
    half = comm_report(f, *args)
    assert sorted(c.elements for c in plain.collectives) == [3, 5, 30]
    assert {c.dtype for c in plain.collectives} == {"f32"}
    if jax.default_backend() == "cpu":
        assert [(c.op, c.elements) for c in fused.collectives] == [("all-reduce", 38)]
    assert {(c.op, c.dtype) for c in half.collectives} == {("all-reduce", "f16")}
    assert half.bytes * 2 == plain.bytes


def test_compression_and_predivide_keep_the_mean():
    gs = [_grads(4)]
    mean = jax.tree.map(lambda x: x.mean(0), gs[0])
    sgd = optax.sgd(1.0)
    for kw, tol in (({"gradient_predivide_factor": 4.0}, 1e-6),
                    ({"compression": Compression.fp16}, 2e-3),
                    ({"compression": Compression.bf16, "gradient_predivide_factor": 2.0}, 2e-2)):
        f, args = _runner(DistributedOptimizer(sgd, **kw), gs)
        (out,) = f(*args)
        tree_allclose(_replica(out), jax.tree.map(lambda m: -m, mean), rtol=tol, atol=tol)
        assert _replica(out)["w"].dtype == jnp.float32


def test_sum_op_and_backward_passes_per_step_accumulate_like_horovod():
    gs = [_grads(5), _grads(6), _grads(7), _grads(8)]
    sgd = optax.sgd(1.0)
    f, args = _runner(DistributedOptimizer(sgd, backward_passes_per_step=2), gs)
    outs = f(*args)
    for j, out in enumerate(outs):
        if j % 2 == 0:  # first pass of each pair: nothing applied
            tree_allclose(_replica(out), jax.tree.map(jnp.zeros_like, _params()))
        else:  # torch .grad accumulation: the *sum* of both passes, averaged over replicas
            want = jax.tree.map(lambda a, b: -(a.mean(0) + b.mean(0)), gs[j - 1], gs[j])
            tree_allclose(_replica(out, 3), want, rtol=1e-5, atol=1e-5)
    f, args = _runner(DistributedOptimizer(sgd, backward_passes_per_step=2,
                                           average_aggregated_gradients=True), gs[:2])
    tree_allclose(_replica(f(*args)[1]),
                  jax.tree.map(lambda a, b: -(a.mean(0) + b.mean(0)) / 2, gs[0], gs[1]),
                  rtol=1e-5, atol=1e-5)
    f, args = _runner(DistributedOptimizer(sgd, op=ReduceOp.SUM), gs[:1])
    tree_allclose(_replica(f(*args)[0]), jax.tree.map(lambda a: -a.sum(0), gs[0]),
                  rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_with_the_value():
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != "
                                         "Average"):
        DistributedOptimizer(sgd, op=ReduceOp.SUM, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1, got 0"):
        DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="must be > 0, got -1"):
        DistributedOptimizer(sgd, gradient_predivide_factor=-1)
    with pytest.raises(TypeError, match="expects an optax GradientTransformation, got str"):
        DistributedOptimizer("adam")
    with pytest.raises(TypeError, match="compression must be None or a jdist.optim"):
        DistributedOptimizer(sgd, compression="fp16")
    with pytest.raises(ValueError, match="op must be ReduceOp.AVG or ReduceOp.SUM"):
        DistributedOptimizer(sgd, op=ReduceOp.MAX)
    dtx = DistributedOptimizer(sgd)
    p = _params()
    with pytest.raises(ValueError, match="must run inside jax.shard_map over the group's mesh "
                                         "axis 'dp'"):
        dtx.update(p, dtx.init(p), p)


def test_equals_ddp_averaged_grads_then_tx():
    """DistributedOptimizer on per-replica local grads == tx on DDP's reduced grads."""
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from tests.ddp.models import MLP, data, mse

    model = MLP((16, 32, 4), rngs=nnx.Rngs(0))
    params = jax.device_get(nnx.state(model, nnx.Param))
    batch = data(n=64)
    _, ddp_grads = DDP(MLP((16, 32, 4), rngs=nnx.Rngs(0))).value_and_grad(mse)(batch)
    gdef = nnx.graphdef(model)

    def local_grads(p, b):
        return jax.grad(lambda q: mse(nnx.merge(gdef, q), b))(p)

    per_replica = [local_grads(params, {k: v[i * 8:(i + 1) * 8] for k, v in batch.items()})
                   for i in range(N)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_replica)
    tx = optax.adam(1e-2)
    mesh = make_mesh(jax.devices()[:N], "dp")
    dtx = DistributedOptimizer(tx)

    def body(p, g):
        u, _ = dtx.update(jax.tree.map(lambda x: x[0], g), dtx.init(p), p)
        return u

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(),
                              check_vma=False))
    want, _ = tx.update(jax.device_get(ddp_grads), tx.init(params), params)
    tree_allclose(f(params, stacked), want, rtol=1e-5, atol=1e-6)


def test_allreduce_optimizer_is_horovods_distributed_optimizer_not_torchs():
    import jdist.optim
    import jdist.rpc

    assert jdist.optim.DistributedOptimizer is jdist.optim.AllReduceOptimizer
    assert "AllReduceOptimizer" in jdist.optim.__all__
    assert "jdist.rpc.DistributedOptimizer" in jdist.optim.AllReduceOptimizer.__doc__
    # torch's RPC call shape (an optax factory, not a transformation) points to jdist.rpc
    with pytest.raises(TypeError, match=r"optax.sgd\(0.1\) \(for torch's RPC "
                                        r"DistributedOptimizer.*use jdist.rpc.Distributed"):
        jdist.optim.AllReduceOptimizer(optax.sgd)
    assert jdist.rpc.DistributedOptimizer is not jdist.optim.DistributedOptimizer


@pytest.mark.parametrize("kw", [{}, {"compression": Compression.fp16},
                                {"gradient_predivide_factor": 2.0}, {"op": ReduceOp.SUM}],
                         ids=["avg", "fp16", "predivide", "sum"])
def test_flat_form_is_one_all_reduce_per_dtype_and_the_same_bits(kw):
    """The gloo form (one flat buffer per dtype) gives the per-leaf form's bits."""
    gs = [_grads(9)]
    f_flat, args = _runner(DistributedOptimizer(optax.sgd(0.1), flat=True, **kw), gs)
    f_leaf, _ = _runner(DistributedOptimizer(optax.sgd(0.1), flat=False, **kw), gs)
    ars = comm_report(f_flat.lower(*args)).collectives
    assert [c.elements for c in ars] == [38]  # 30 + 5 + 3 floats in one buffer
    for a, b in zip(jax.tree.leaves(f_flat(*args)), jax.tree.leaves(f_leaf(*args)),
                    strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_grads_summed_by_check_vma_raise_and_varying_params_average():
    """Under check_vma=True, grad of P() params is already the replicas' sum: reducing it
    again would silently scale SGD by N. Refused, naming both fixes."""
    mesh = make_mesh(jax.devices()[:N], "dp")
    dtx = DistributedOptimizer(optax.sgd(1.0))
    xs = jax.random.normal(jax.random.key(3), (N, 4, 6))

    def loss(p, xb):
        return jnp.sum((xb @ p["w"] + p["b"]) ** 2) + jnp.sum(p["v"] ** 2)

    def step(vary):
        def body(p, xb):
            q = jax.lax.pcast(p, "dp", to="varying") if vary else p
            u, _ = dtx.update(jax.grad(loss)(q, xb[0]), dtx.init(p), p)
            return u
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P()))

    with pytest.raises(ValueError, match="typed invariant over mesh axis 'dp'.*check_vma=False"):
        step(False)(_params(), xs)
    want = jax.tree.map(lambda *g: -sum(g) / N,
                        *[jax.grad(loss)(_params(), xs[i]) for i in range(N)])
    tree_allclose(step(True)(_params(), xs), want, rtol=1e-5, atol=1e-5)
