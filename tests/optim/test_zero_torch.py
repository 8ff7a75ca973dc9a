"""torch's test_zero_redundancy_optimizer.py, translated (in-process cases).

One process drives N replicas (``group_of(n)``: torch's ranks are replicas here). torch's
``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`` becomes
``ZeroRedundancyOptimizer(ParamGroups(optax_factory, groups, **defaults))`` with the
parameters as a list of one pytree per group; torch's ``lr`` is optax's
``learning_rate``. The multi-process cases are in test_zero_torch_mp.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.ddp import DistributedDataParallel as DDP
from jdist.optim import ParamGroups, ZeroRedundancyOptimizer, flat_partition, set_hyperparams
from tests.helpers import tree_allclose
from tests.optim.test_zero import group_of


def arr(*v):
    return jnp.asarray(v, jnp.float32)


def f32(v):
    return pytest.approx(float(np.float32(v)))


def sgd_state(state):
    """The momentum buffer (optax's ``trace``) of group 0 of a ParamGroups(sgd) state."""
    return state.groups[0].inner_state[0].trace


# ---- TestZeroRedundancyOptimizerSingleRank ---------------------------------------------
def test_state_dict():
    lr1, lr2, momentum = 0.1, 0.01, 0.9
    x = [arr(1.0)]
    o = ZeroRedundancyOptimizer(ParamGroups(optax.sgd, learning_rate=lr1, momentum=momentum),
                                group=group_of(1))
    x, state = o.step(x, [arr(1.0)], o.init(x))
    np.testing.assert_allclose(x[0], [0.9], rtol=1e-6)
    o.consolidate_state_dict(state, to=0)
    sd = o.state_dict()
    np.testing.assert_allclose(sgd_state(sd["state"]), [1.0])
    assert "param_groups" in sd and "state" in sd
    group = sd["param_groups"][0]
    assert group["learning_rate"] == f32(0.1) and group["momentum"] == f32(0.9)
    assert group["nesterov"] is False
    # optax.sgd has no weight_decay or dampening (torch's 0.0 defaults): absent, not 0
    assert "weight_decay" not in group and "dampening" not in group
    assert sd["param_groups"] == o.param_groups(state)
    # reloaded into an optimizer built with LR2 (and momentum 0): LR1 and 0.9 come back
    o = ZeroRedundancyOptimizer(ParamGroups(optax.sgd, learning_rate=lr2, momentum=0.0),
                                group=group_of(1))
    o.init(x)
    state = o.load_state_dict(sd)
    np.testing.assert_allclose(sgd_state(state.inner), [1.0])
    assert o.param_groups(state)[0]["learning_rate"] == f32(lr1)
    x, state = o.step(x, [arr(1.0)], state)
    np.testing.assert_allclose(x[0], [0.71], rtol=1e-6)
    np.testing.assert_allclose(sgd_state(state.inner), [1.9], rtol=1e-6)
    assert x[0].sharding.mesh == o.group.mesh  # params stay on the optimizer's devices


@pytest.mark.parametrize("n", [1, 2])
def test_lr_scheduler(n):
    """torch's StepLR(o, 1) (gamma 0.1 each step) is an optax schedule; ZeRO == local."""
    sched = optax.exponential_decay(0.01, transition_steps=1, decay_rate=0.1, staircase=True)
    o = ZeroRedundancyOptimizer(ParamGroups(optax.sgd, learning_rate=sched), group=group_of(n))
    o2 = optax.sgd(sched)
    # torch's scheduler way: set the group's lr in the state between steps
    o3 = ZeroRedundancyOptimizer(ParamGroups(optax.sgd, learning_rate=0.01), group=group_of(n))
    x = x2 = x3 = [arr(1.0)]
    state, state2, state3 = o.init(x), o2.init(x2), o3.init(x3)
    for _ in range(5):
        x, state = o.step(x, [arr(1.0)], state)
        u, state2 = o2.update([arr(1.0)], state2, x2)
        x2 = optax.apply_updates(x2, u)
        x3, state3 = o3.step(x3, [arr(1.0)], state3)
        lr = o3.param_groups(state3)[0]["learning_rate"]
        state3 = set_hyperparams(state3, 0, learning_rate=lr * 0.1)
        np.testing.assert_allclose(x[0], x2[0], rtol=1e-6)
        np.testing.assert_allclose(x3[0], x2[0], rtol=1e-6)
    np.testing.assert_allclose(x[0], [1 - 0.011111], rtol=1e-5)


def test_step_with_kwargs():
    """``step(**kwargs)`` reaches the inner update (optax's extra args)."""
    def init(params):
        return {"sgd": optax.sgd(0.1).init(params), "kwarg": jnp.zeros(())}

    def update(updates, state, params=None, *, kwarg=None, **_):
        u, s = optax.sgd(0.1).update(updates, state["sgd"], params)
        return u, {"sgd": s, "kwarg": jnp.asarray(kwarg, jnp.float32)}

    o = ZeroRedundancyOptimizer(optax.GradientTransformationExtraArgs(init, update),
                                group=group_of(1))
    x = [arr(1.0)]
    x, state = o.step(x, [arr(1.0)], o.init(x), kwarg=5)
    assert float(state.inner["kwarg"]) == 5.0
    np.testing.assert_allclose(x[0], [0.9], rtol=1e-6)


def test_step_with_extra_inner_key():
    """A factory with an extra hyperparameter: ZeRO's param_groups show it."""
    def sgd_with_new_key(learning_rate, new_key):
        del new_key
        return optax.sgd(learning_rate)

    o = ZeroRedundancyOptimizer(ParamGroups(sgd_with_new_key, learning_rate=0.1,
                                            new_key=lambda count: 0.1), group=group_of(1))
    x = [arr(1.0)]
    x, state = o.step(x, [arr(1.0)], o.init(x))
    assert o.param_groups(state)[0]["new_key"] == f32(0.1)
    np.testing.assert_allclose(x[0], [0.9], rtol=1e-6)


def test_step_without_closure():
    o = ZeroRedundancyOptimizer(optax.sgd(0.1), group=group_of(1))
    x = [arr(1.0)]
    x, _ = o.step(x, [arr(1.0)], o.init(x))
    np.testing.assert_allclose(x[0], [0.9], rtol=1e-6)


def linear_stack(sizes, seed=0):
    """torch.nn.Sequential of Linear layers (weights (out, in), biases), torch's
    uniform(-1/sqrt(in), 1/sqrt(in)) init, as numpy."""
    rng = np.random.RandomState(seed)
    ws, bs = [], []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        k = 1 / np.sqrt(a)
        ws.append(rng.uniform(-k, k, (b, a)).astype(np.float32))
        bs.append(rng.uniform(-k, k, (b,)).astype(np.float32))
    return ws, bs


def test_constructor():
    lr = 0.01
    weights, biases = linear_stack((5, 10, 10, 10))
    cases = [([], ValueError),                        # empty parameter list
             (1.2, TypeError),                        # a float
             ([*weights, 42], TypeError),             # an iterable with a non-array
             ((w for w in weights), TypeError),       # a generator: jdist departs (pytree)
             (list(weights) + list(biases), None),    # a list
             (jnp.ones(1), None)]                     # a bare array: a one-leaf pytree
    for params, error in cases:
        zero = ZeroRedundancyOptimizer(optax.sgd(lr), group=group_of(2))
        if error is None:
            zero.init(params)
        else:
            with pytest.raises(error):
                zero.init(params)
    # torch's iterable of dicts: two groups (weights, biases)
    zero = ZeroRedundancyOptimizer(ParamGroups(optax.sgd, [{}, {}], learning_rate=lr),
                                   group=group_of(2))
    zero.init([weights, biases])
    o = ZeroRedundancyOptimizer(
        ParamGroups(optax.adamw, [{"weight_decay": 0.0}, {"weight_decay": 0.01}],
                    learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8), group=group_of(2))
    state = o.init([weights, biases])
    assert len(o.param_groups(state)) == 2
    assert len(state.inner.groups) == 2
    with pytest.raises(ValueError, match="has a 'params' entry"):
        ParamGroups(optax.sgd, [{"params": weights}], learning_rate=lr)
    with pytest.raises(TypeError, match=r"sets \['lr'\], which optax.*sgd does not take"):
        ParamGroups(optax.sgd, lr=lr)


def test_same_dense_param_type():
    """torch refuses mixed dense types; jdist steps them exactly (one collective per
    dtype). Sparse arrays do not exist in JAX's dense pytrees (departure)."""
    params = [jnp.ones(3, jnp.float32), jnp.ones(5, jnp.bfloat16), jnp.ones(2, jnp.float32)]
    grads = [jnp.full(3, 0.5, jnp.float32), jnp.full(5, 0.25, jnp.bfloat16),
             jnp.ones(2, jnp.float32)]
    o = ZeroRedundancyOptimizer(optax.sgd(0.1, momentum=0.9), group=group_of(2))
    got, _ = o.step(params, grads, o.init(params))
    u, _ = optax.sgd(0.1, momentum=0.9).update(grads, optax.sgd(0.1, 0.9).init(params))
    want = optax.apply_updates(params, u)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32))


# ---- TestZeroRedundancyOptimizerDistributed (replicas in one process) -------------------
def test_step():
    """Replica r: x = r + 1 through Linear(1, 1) (w 1, b 2), backward(x); grads averaged
    by ZeRO's reduce-scatter inside shard_map == SGD on the averaged gradients."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, lr = 2, 0.01
    zero = ZeroRedundancyOptimizer(optax.sgd(lr), group=group_of(n))
    params = {"w": arr(1.0), "b": arr(2.0)}
    state = zero.init(params)
    xs = jnp.arange(1.0, n + 1.0)
    grads = {"w": xs * xs, "b": xs}  # d(y * x)/dw = x^2, /db = x per replica
    specs = zero.state_partition_specs(state)

    def body(p, s, g):
        u, s = zero.update(jax.tree.map(lambda v: v[0], g), s, p)
        return optax.apply_updates(p, u), s

    f = jax.jit(jax.shard_map(body, mesh=zero.group.mesh, in_specs=(P(), specs, P("dp")),
                              out_specs=(P(), specs), check_vma=False))
    g = jax.device_put(jax.tree.map(lambda v: v[:, None], grads),
                       NamedSharding(zero.group.mesh, P("dp")))
    got, _ = f(params, state, g)
    tree_allclose(got, {"w": arr(1 - lr * 2.5), "b": arr(2 - lr * 1.5)})


def test_step_with_closure():
    """torch's ``step(closure)`` is ``closure_step``: the closure returns the loss and
    the replicas' averaged gradients. torch steps each parameter with its owner rank's
    *own* closure gradient (w 1.1 on rank 0 of 2); jdist averages (w 1.15): departure."""
    n, x_vals, error = 2, arr(1.0, 2.0), 1.0
    for _ in range(2):  # torch's parameters_as_bucket_view False/True: one layout here
        zero = ZeroRedundancyOptimizer(optax.sgd(0.1), group=group_of(n))
        params = {"w": arr(1.0), "b": arr(2.0)}

        def loss_fn(p, target=x_vals * 1.0 + 2.0 + error):
            return jnp.mean(jnp.abs(x_vals * p["w"] + p["b"] - target))  # L1, per replica

        params, _, loss = zero.closure_step(jax.value_and_grad(loss_fn), params,
                                            zero.init(params))
        assert float(loss) == error
        tree_allclose(params, {"w": arr(1.0 + 0.1 * 1.5), "b": arr(2.1)})
    with pytest.raises(TypeError, match=r"must return \(loss, grads\)"):
        zero.closure_step(loss_fn, params, zero.init(params))


def local_elements(zero, state):
    return sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(state)
               if x.ndim == 1)


def test_sharding():
    """torch gives whole parameters to ranks (sorted-greedy: each rank sum(sizes));
    jdist splits every leaf evenly: ceil(size / N) of each per replica (departure)."""
    sizes, n = [9, 7, 5, 3], 4
    params = [jnp.ones((s, 1)) for s in sizes * n]
    zero = ZeroRedundancyOptimizer(optax.sgd(0.01, momentum=0.9), group=group_of(n))
    state = zero.init(params)
    per_replica = sum(-(-s // n) for s in sizes * n)
    assert local_elements(zero, state) == per_replica == n * (3 + 2 + 2 + 1)
    assert flat_partition(params, n).groups[0][4] == per_replica
    assert per_replica >= sum(sizes)  # padding: at most N - 1 elements per leaf


def test_add_param_group():
    lr, n, sizes = 0.01, 2, [9, 7, 5, 3]
    rng = np.random.RandomState(0)

    def check(first, added, step=True):
        zero = ZeroRedundancyOptimizer(ParamGroups(optax.sgd, learning_rate=lr,
                                                   momentum=0.9), group=group_of(n))
        state = zero.init([first])
        assert len(zero.param_groups(state)) == 1
        state = zero.add_param_group({"params": added}, state)
        assert len(zero.param_groups(state)) == 2 and len(state.inner.groups) == 2
        # every replica holds its piece of every leaf, the new group's included
        assert local_elements(zero, state) == sum(
            -(-p.size // n) for p in jax.tree.leaves([first, added]))
        if not step:
            return
        # and steps the grown parameter list like an unsharded optimizer
        params = [first, added]
        grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5), params)
        got, _ = zero.step(params, grads, state)
        tx = ParamGroups(optax.sgd, [{}, {}], learning_rate=lr, momentum=0.9)
        u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        tree_allclose(got, optax.apply_updates(params, u))

    # all trainable: sizes * N without the last, then a (3, 1) group
    check([jnp.asarray(rng.rand(s, 1), jnp.float32) for s in (sizes * n)[:-1]],
          [jnp.asarray(rng.rand(3, 1), jnp.float32)])
    # torch's big non-trainable first parameter is simply not given to the optimizer
    check([jnp.asarray(rng.rand(s, 1), jnp.float32) for s in [3, 5, 2, 6, 4]],
          [jnp.asarray(rng.rand(3, 1), jnp.float32)], step=False)
    with pytest.raises(TypeError, match="add_param_group needs parameter groups"):
        z = ZeroRedundancyOptimizer(optax.sgd(lr), group=group_of(n))
        z.add_param_group({"params": [jnp.ones(3)]}, z.init([jnp.ones(2)]))


def test_multiple_param_groups():
    """ZeRO with two groups up front == ZeRO + add_param_group == the unsharded
    optimizer with the same two groups."""
    batch, iters, wd, lr = 8, 2, 0.01, 0.01
    weights, biases = linear_stack((5, 10, 10, 5))
    inputs = np.random.RandomState(1).randn(iters, batch, 5).astype(np.float32)
    groups = [{"weight_decay": 0.0}, {"weight_decay": wd}]
    o1 = ZeroRedundancyOptimizer(ParamGroups(optax.adamw, groups, learning_rate=lr),
                                 group=group_of(2))
    o2 = ZeroRedundancyOptimizer(ParamGroups(optax.adamw, learning_rate=lr,
                                             weight_decay=0.0), group=group_of(2))
    o3 = ParamGroups(optax.adamw, groups, learning_rate=lr)
    p = [[jnp.asarray(w) for w in weights], [jnp.asarray(b) for b in biases]]
    p1, p2, p3 = p, p, p
    s1, s3 = o1.init(p), o3.init(p)
    s2 = o2.add_param_group({"params": p[1], "weight_decay": wd}, o2.init(p[:1]))

    @jax.jit
    def grad(params, x):
        def loss(params):
            out = x
            for w, b in zip(*params, strict=True):
                out = out @ w.T + b
            return out.sum()
        return jax.grad(loss)(params)

    plain = jax.jit(lambda g, s, p: o3.update(g, s, p))
    for x in inputs:
        xj = jnp.asarray(x)
        p1, s1 = o1.step(p1, grad(p1, xj), s1)
        p2, s2 = o2.step(p2, grad(p2, xj), s2)
        u, s3 = plain(grad(p3, xj), s3, p3)
        p3 = optax.apply_updates(p3, u)
        tree_allclose(jax.device_get(p1), jax.device_get(p3), rtol=1e-5, atol=1e-6)
        tree_allclose(jax.device_get(p2), jax.device_get(p3), rtol=1e-5, atol=1e-6)


class Seq3(nnx.Module):
    """torch's Sequential(Linear(2, 3), Linear(3, 3), Linear(3, 3))."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in ((2, 3), (3, 3), (3, 3))])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def abs_sum(model, batch):
    return jnp.abs(model(batch)).sum()


PARITY_TX = {"Adam": lambda: optax.adam(1e-3), "SGD": lambda: optax.sgd(1e-3),
             # torch's AdamW default weight decay (optax's is 1e-4)
             "AdamW": lambda: optax.adamw(1e-3, weight_decay=0.01)}


def parity_tx(name, maximize):
    """torch's ``maximize=True`` ascends: the gradient negated before the optimizer."""
    tx = PARITY_TX[name]()
    return optax.chain(optax.scale(-1.0), tx) if maximize else tx


def _opt_vars(opt):
    return jax.tree.leaves(opt.opt_state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _load(opt, leaves):
    for var, x in zip(_opt_vars(opt), jax.tree.leaves(leaves), strict=True):
        var[...] = x


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("name", sorted(PARITY_TX))
def test_local_optimizer_parity(name, maximize):
    """DDP + ZeRO == DDP + the local optimizer step by step; then the state dicts load
    across (local -> ZeRO, consolidated ZeRO -> local) and back, parity kept. torch's
    run-time ``requires_grad`` toggling has no JAX counterpart (a frozen parameter is
    one outside ``wrt``): not translated."""
    batches, rng = 2, np.random.RandomState(0)
    zero = ZeroRedundancyOptimizer(parity_tx(name, maximize))
    ddp_z, ddp_l = DDP(Seq3(nnx.Rngs(0))), DDP(Seq3(nnx.Rngs(0)))
    opt_z = nnx.Optimizer(ddp_z.module, zero, wrt=nnx.Param)
    opt_l = nnx.Optimizer(ddp_l.module, parity_tx(name, maximize), wrt=nnx.Param)
    step_z, step_l = ddp_z.train_step(abs_sum, opt_z), ddp_l.train_step(abs_sum, opt_l)

    def check_step():
        x = rng.rand(64, 2).astype(np.float32)
        np.testing.assert_allclose(float(step_z(x)), float(step_l(x)), rtol=1e-6)
        tree_allclose(jax.device_get(nnx.state(ddp_z.module, nnx.Param)),
                      jax.device_get(nnx.state(ddp_l.module, nnx.Param)), atol=1e-6)

    for _ in range(batches):
        check_step()
    local_sd = jax.device_get(nnx.as_pure(opt_l.opt_state))
    zero.consolidate_state_dict(nnx.as_pure(opt_z.opt_state), to=0)
    zero_sd = zero.state_dict()
    _load(opt_l, zero_sd["state"])                    # ZeRO -> local
    _load(opt_z, zero.load_state_dict(local_sd))      # local -> ZeRO
    check_step()
    _load(opt_l, local_sd)                            # each its own again
    _load(opt_z, zero.load_state_dict(zero_sd))
    check_step()


def test_param_groups_and_join_hook_name_their_fixes():
    """jdist's own checks around the torch surface (no torch counterpart)."""
    tx = ParamGroups(optax.sgd, [{}, {"learning_rate": 0.5}], learning_rate=0.1)
    with pytest.raises(ValueError, match=r"one pytree per group \(2 groups\), got a list of 1"):
        tx.init([jnp.ones(2)])
    with pytest.raises(ValueError, match="one pytree per group"):
        tx.init({"w": jnp.ones(2)})
    state = tx.init([jnp.ones(2), jnp.ones(3)])
    assert [g["learning_rate"] for g in tx.param_groups(state)] == [f32(0.1), f32(0.5)]
    state = set_hyperparams(state, 1, learning_rate=0.25)
    assert [g["learning_rate"] for g in tx.param_groups(state)] == [f32(0.1), 0.25]
    with pytest.raises(KeyError, match=r"holds no hyperparameter \['lr'\]"):
        set_hyperparams(state, 0, lr=0.1)
    with pytest.raises(IndexError, match="group 2 is out of range"):
        set_hyperparams(state, 2, learning_rate=0.1)
    with pytest.raises(ValueError, match="non-empty list of dicts"):
        ParamGroups(optax.sgd, [], learning_rate=0.1)
    zero = ZeroRedundancyOptimizer(optax.sgd(0.1), group=group_of(2))
    hook = zero.join_hook()
    with pytest.raises(RuntimeError, match=r"run at least one zero.step\(...\)"):
        hook.main_hook()
    params = [jnp.ones(3)]
    zero.step(params, [jnp.ones(3)], zero.init(params))
    with pytest.raises(RuntimeError, match="zero.join_grads, which is None"):
        hook.main_hook()
    zero.join_grads = lambda: [jnp.ones(3)]  # what an earlier joinable's hook sets
    hook.main_hook()  # one shadow step from the last step's (params, state)
    np.testing.assert_allclose(zero.latest[0][0], np.full(3, 0.8), rtol=1e-6)
    assert zero.join_process_group is zero.group and zero.join_device in jax.devices()


def test_param_groups_of_a_labelled_single_tree():
    """One parameter tree (an nnx.Optimizer's): torch's groups as multi_transform labels
    of inject_hyperparams optimizers; param_groups reads them from the ZeRO state."""
    adamw = optax.inject_hyperparams(optax.adamw)
    tx = optax.multi_transform(
        {"decay": adamw(learning_rate=0.01, weight_decay=0.01),
         "no_decay": adamw(learning_rate=0.01, weight_decay=0.0)},
        lambda p: jax.tree.map(lambda x: "decay" if x.ndim > 1 else "no_decay", p))
    zero = ZeroRedundancyOptimizer(tx, group=group_of(2))
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    state = zero.init(params)
    assert [g["weight_decay"] for g in zero.param_groups(state)] == [f32(0.01), 0.0]
