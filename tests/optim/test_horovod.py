"""Horovod's sequence: broadcast rank 0's parameters and optimizer state, then train
with ``AllReduceOptimizer`` across real processes, against one process on the global
batch.

One 2-process launch runs the cases: a pytree MLP with optax state, an NNX module
with an ``nnx.Optimizer`` (updated in place). Ranks start from different parameters; after
the broadcast both hold rank 0's, placed on the group's mesh (replicated), and three
steps on each rank's half of the global batch equal three steps of plain SGD with
momentum (pytree) and Adam (NNX) on the whole batch. The same launch checks that
``all_reduce_flat``'s flat buffer gives the per-leaf form's bits over gloo (SUM, AVG,
MIN, MAX over six dtypes) and a numpy reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers import run_procs, tree_allclose

WORLD, STEPS, BATCH, LR = 2, 3, 16, 1e-2


def _data():
    rng = np.random.RandomState(7)
    return (rng.randn(STEPS, BATCH, 5).astype(np.float32),
            rng.randn(STEPS, BATCH, 2).astype(np.float32))


def _params(seed):
    rng = np.random.RandomState(seed)
    return {"w1": rng.randn(5, 8).astype(np.float32), "b1": np.zeros(8, np.float32),
            "w2": rng.randn(8, 2).astype(np.float32) * 0.3, "b2": np.zeros(2, np.float32)}


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _model(seed):
    return nnx.Sequential(nnx.Linear(5, 8, rngs=nnx.Rngs(seed)), nnx.tanh,
                          nnx.Linear(8, 2, rngs=nnx.Rngs(seed + 100)))


def _nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _pytree_case(jdist, g, rank, xs, ys, local):
    from jax.sharding import PartitionSpec as P

    dtx = jdist.optim.AllReduceOptimizer(optax.sgd(LR, momentum=0.9))
    params = jdist.optim.broadcast_parameters(_params(rank), root_rank=0)
    state = jdist.optim.broadcast_optimizer_state(dtx.init(params), root_rank=0)
    sharding_ok = all(x.sharding.spec == P() and x.sharding.mesh == g.mesh
                      for x in jax.tree.leaves((params, state)))
    initial = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)

    def body(p, s, x, y):
        loss, grads = jax.value_and_grad(_loss)(p, x, y)
        u, s = dtx.update(grads, s, p)
        return optax.apply_updates(p, u), s, loss[None]

    step = jax.jit(jax.shard_map(body, mesh=g.mesh, in_specs=(P(), P(), P("dp"), P("dp")),
                                 out_specs=(P(), P(), P("dp")), check_vma=False))
    losses = []
    for x, y in zip(xs, ys, strict=True):
        params, state, loss = step(params, state, local(x), local(y))
        # hvd.allreduce of a per-rank metric: this process's loss, averaged eagerly
        losses.append(float(jdist.all_reduce(np.asarray(loss.addressable_data(0))[0],
                                             jdist.ReduceOp.AVG)))
    return {"initial": initial, "sharding_ok": sharding_ok, "losses": losses,
            "params": jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)}


def _nnx_case(jdist, g, rank, xs, ys, local):
    from jax.sharding import PartitionSpec as P

    model = _model(rank)
    opt = nnx.Optimizer(model, jdist.optim.AllReduceOptimizer(optax.adam(LR)), wrt=nnx.Param)
    jdist.optim.broadcast_parameters(model, root_rank=0)
    jdist.optim.broadcast_optimizer_state(opt, root_rank=0)
    gdef, state = nnx.split((model, opt))

    def body(state, x, y):
        m, o = nnx.merge(gdef, state)
        o.update(m, nnx.grad(_nnx_loss)(m, x, y))
        return nnx.state((m, o))

    step = jax.jit(jax.shard_map(body, mesh=g.mesh, in_specs=(P(), P("dp"), P("dp")),
                                 out_specs=P(), check_vma=False))
    for x, y in zip(xs, ys, strict=True):
        state = step(state, local(x), local(y))
    nnx.update((model, opt), state)
    return {"params": jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                                   nnx.to_pure_dict(nnx.state(model, nnx.Param))),
            "step": int(np.asarray(opt.step.value.addressable_data(0)))}


FLAT_DTYPES = ("float32", "bfloat16", "float16", "int32", "uint8", "bool")


def _flat_inputs(rank):
    rng = np.random.default_rng(rank)
    out = {}
    for dt in FLAT_DTYPES:
        for i, shape in enumerate(((3, 5), (), (7,))):
            x = rng.standard_normal(shape) * 4
            out[f"{dt}_{i}"] = (x > 0) if dt == "bool" else np.asarray(jnp.asarray(x, dt))
    return out


def _flat_case(g):
    """all_reduce_flat over gloo: the flat form's bits equal the per-leaf form's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jdist.collectives import ReduceOp, all_reduce_flat

    rows = NamedSharding(g.mesh, P("dp"))
    tree = {k: jax.make_array_from_process_local_data(rows, v[None])
            for k, v in _flat_inputs(g.rank).items()}

    def body(t):
        t = jax.tree.map(lambda v: v[0], t)
        out = {}
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX):
            sub = {k: v for k, v in t.items()
                   if op is not ReduceOp.AVG or k.startswith("float")}
            for flat in (True, False):
                red = all_reduce_flat(sub, op, "dp", flat=flat)
                out[op.name, flat] = jax.tree.map(lambda v: v[None], red)
        return out

    f = jax.jit(jax.shard_map(body, mesh=g.mesh, in_specs=P("dp"), out_specs=P("dp"),
                              check_vma=False))
    return jax.tree.map(lambda v: np.asarray(v.addressable_data(0)[0]), f(tree))


def child():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdist
    import jdist.optim  # noqa: F401

    jdist.init_process_group(timeout=60)
    rank, g = jdist.get_rank(), jdist.get_default_group()
    xs, ys = _data()
    half = BATCH // WORLD

    def local(a):  # this rank's rows of the global batch, as the global array
        return jax.make_array_from_process_local_data(
            NamedSharding(g.mesh, P("dp")), a[rank * half:(rank + 1) * half], a.shape)

    out = {"pytree": _pytree_case(jdist, g, rank, xs, ys, local),
           "nnx": _nnx_case(jdist, g, rank, xs, ys, local), "flat": _flat_case(g)}
    jdist.destroy_process_group()
    return out


def _reference():
    xs, ys = _data()
    tx = optax.sgd(LR, momentum=0.9)  # not scale-invariant: a wrong mean would show
    p, s, losses = _params(0), tx.init(_params(0)), []
    for x, y in zip(xs, ys, strict=True):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        losses.append(float(loss))
    model = _model(0)
    opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    for x, y in zip(xs, ys, strict=True):
        opt.update(model, nnx.grad(_nnx_loss)(model, x, y))
    return p, losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_broadcast_then_train_across_processes_equals_one_process():
    res = run_procs(child, WORLD, timeout=240)
    ref_params, ref_losses, ref_nnx = _reference()
    for r in res:
        tree_allclose(r["pytree"]["initial"], _params(0), rtol=0, atol=0)  # rank 0's, exactly
        assert r["pytree"]["sharding_ok"]
        tree_allclose(r["pytree"]["params"], ref_params, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["pytree"]["losses"], ref_losses, rtol=1e-5)
        tree_allclose(r["nnx"]["params"], ref_nnx, rtol=1e-5, atol=1e-6)
        assert r["nnx"]["step"] == STEPS
    tree_allclose(res[0]["pytree"]["params"], res[1]["pytree"]["params"], rtol=0, atol=0)
    ins = [_flat_inputs(r) for r in range(WORLD)]
    for (op, flat), got in res[0]["flat"].items():
        if not flat:
            continue
        for k, v in got.items():  # gloo's flat buffer: the per-leaf bits, every dtype
            w = res[0]["flat"][op, False][k]
            assert v.dtype == w.dtype and v.shape == w.shape, (op, k)
            assert v.tobytes() == w.tobytes(), (op, k)
            a, b = (x[k].astype(np.float64) for x in ins)
            want = {"SUM": a + b, "AVG": (a + b) / 2, "MIN": np.minimum(a, b),
                    "MAX": np.maximum(a, b)}[op]
            if k.startswith("bool"):
                want = want > 0  # SUM and MAX are OR, MIN is AND
            elif not k.startswith("float"):
                want = want.astype(v.dtype)  # integer sums wrap as the dtype does
            tol = 0.05 if k.startswith(("bfloat16", "float16")) else 1e-6
            np.testing.assert_allclose(v.astype(np.float64), want, rtol=tol, atol=tol,
                                       err_msg=f"{op} {k}")


def test_one_process_places_on_the_local_mesh_and_steps():
    """Without init_process_group: nothing to broadcast; values placed on the embedded
    group's mesh (8 devices), usable by a shard_map step as they are."""
    from jax.sharding import PartitionSpec as P

    import jdist.optim
    from jdist.collectives._group import resolve_group

    mesh = resolve_group(None).mesh
    model = _model(0)
    before = nnx.to_pure_dict(nnx.state(model))
    out = jdist.optim.broadcast_parameters(model)
    assert out is model
    leaves = jax.tree.leaves(nnx.state(model))
    assert all(x.sharding.mesh == mesh and x.sharding.spec == P() for x in leaves)
    tree_allclose(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                  {k: v for k, v in before.items()}, rtol=0, atol=0)
    params = jdist.optim.broadcast_parameters({"w": np.ones((2, 3), np.float32), "n": 3})
    assert params["n"] == 3 and params["w"].sharding.mesh == mesh
    with pytest.raises(ValueError, match="root_rank=1 but there is one process"):
        jdist.optim.broadcast_parameters(_params(0), root_rank=1)
