"""Child of test_zero_torch_mp.py: torch's multi-process ZeRO tests in one launch of 3
processes (module level, importable by the fork server).

Cases, in this order on every process (collectives pair up in launch order):
``collect_shards`` (consolidate on rank 0, broadcast the dict, load on all ranks),
``nondefault_process_group`` (ZeRO over ``new_group([0, 2])``) and ``zero_join``
(uneven inputs: rank r has 3 + r inputs per epoch; ZeRO is a Joinable).
"""

from __future__ import annotations

import resource

import numpy as np

NUM_INPUTS, NUM_EPOCHS, JOIN_LR = 3, 2, 0.01


def linear_params(sizes, seed):
    """Sequential(Linear...) as a list of (w (out, in), b), torch's uniform init."""
    rng = np.random.RandomState(seed)
    out = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        k = 1 / np.sqrt(a)
        out.append((rng.uniform(-k, k, (b, a)).astype(np.float32),
                    rng.uniform(-k, k, (b,)).astype(np.float32)))
    return out


def forward(params, x):
    for w, b in params:
        x = x @ w.T + b
    return x


def join_data(rank):
    """Rank ``rank``'s inputs (3 + rank of them) and labels (any process can make them)."""
    rng = np.random.RandomState(rank)
    inputs = [rng.randn(20, 2).astype(np.float32) for _ in range(NUM_INPUTS + rank)]
    return inputs, rng.randn(20, 3).astype(np.float32)


def join_truth(world):
    """What DDP (joined ranks contribute zero, divided by the initial world size) with a
    local Adam computes at every iteration: ``(grads, params after the step)`` lists."""
    import jax
    import jax.numpy as jnp
    import optax

    def loss(p, x, y):
        return jnp.mean((forward(p, x) - y) ** 2)

    data = [join_data(r) for r in range(world)]
    tx = optax.adam(JOIN_LR)

    @jax.jit
    def step(params, state, xs, ys, weights):
        """One DDP step: the active ranks' gradients (weight 1, joined 0) over world."""
        g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, xs, ys)
        g = jax.tree.map(lambda v: jnp.tensordot(weights, v, axes=1) / world, g)
        u, state = tx.update(g, state, params)
        return g, optax.apply_updates(params, u), state

    params = jax.tree.map(jnp.asarray, linear_params((2, 3, 3, 3), 0))
    state, grads_at, params_at = tx.init(params), [], []
    for i in range(NUM_EPOCHS * (NUM_INPUTS + world - 1)):
        xs = np.stack([d[0][i % len(d[0])] for d in data])
        weights = np.array([NUM_EPOCHS * (NUM_INPUTS + r) > i for r in range(world)],
                           np.float32)
        g, params, state = step(params, state, xs, np.stack([d[1] for d in data]), weights)
        grads_at.append(g)
        params_at.append(params)
    return grads_at, params_at


def case_collect_shards(rank):
    import jax
    import jax.numpy as jnp
    import optax

    import jdist
    from jdist.optim import ZeroRedundancyOptimizer

    rng = np.random.RandomState(0)
    target, inputs = rng.rand(3, 5).astype(np.float32), rng.rand(3, 20).astype(np.float32)
    params = linear_params((20, 10, 5), 0)
    zero = ZeroRedundancyOptimizer(optax.sgd(1e-3, momentum=0.99))
    state = zero.init(params)

    closure = jax.jit(jax.value_and_grad(
        lambda q: jnp.mean(jnp.abs(forward(q, inputs) - target))))

    params, state, _ = zero.closure_step(closure, params, state)
    zero.consolidate_state_dict(state, to=0)
    sd = [zero.state_dict() if rank == 0 else {}]
    out = {"num_state": len(jax.tree.leaves(sd[0]["state"][0].trace)) if rank == 0 else None}
    jdist.broadcast_object_list(sd, src=0)
    loaded = zero.load_state_dict(sd[0])
    out["reloaded_equal"] = all(
        np.array_equal(np.asarray(a.addressable_data(0)), np.asarray(b.addressable_data(0)))
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state), strict=True))
    return out


def case_nondefault_process_group(rank):
    """ZeRO over the even ranks [0, 2]: group rank != WORLD rank on rank 2."""
    import jax
    import jax.numpy as jnp
    import optax

    import jdist
    from jdist.optim import ZeroRedundancyOptimizer

    pg = jdist.new_group(ranks=[0, 2])
    if rank not in (0, 2):
        return None
    rng = np.random.RandomState(rank)  # different data per rank
    zero = ZeroRedundancyOptimizer(optax.sgd(1e-3, momentum=0.99), group=pg)
    params = linear_params((20, 10, 5), 0)
    state = zero.init(params)
    seen = []
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda q, x, y: jnp.mean(jnp.abs(forward(q, x) - y))))
    for _ in range(5):
        target, inputs = rng.rand(3, 5).astype(np.float32), rng.rand(3, 20).astype(np.float32)

        def closure(p, target=target, inputs=inputs):
            loss, g = value_and_grad(p, inputs, target)
            g = jax.tree.map(np.asarray, g)
            g = jdist.collectives.all_reduce_coalesced(g, jdist.ReduceOp.AVG, group=pg)
            return loss, g

        params, state, _ = zero.closure_step(closure, params, state)
        seen.append(jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params))
    return {"group_rank": pg.rank, "params": seen}


def case_zero_join(rank, world):
    import jax
    import optax

    from jdist.algorithms.join import Join, Joinable, JoinHook
    from jdist.optim import ZeroRedundancyOptimizer

    grads_at, params_at = join_truth(world)
    zero = ZeroRedundancyOptimizer(optax.adam(JOIN_LR))

    class SetGradsJoinHook(JoinHook):
        """Sets the gradients a joined rank's ZeRO steps with (before ZeRO's hook)."""

        def __init__(self, zero_optim, grads):
            self.zero, self.grads, self.index = zero_optim, grads, 0

        def main_hook(self):
            self.zero.join_grads = self.grads[self.index]
            self.index += 1

    class GradientSetter(Joinable):
        def __init__(self):
            super().__init__()

        def join_hook(self, **kwargs):
            assert "zero_optim" in kwargs and "grads" in kwargs
            return SetGradsJoinHook(kwargs["zero_optim"], kwargs["grads"])

        @property
        def join_device(self):
            return zero.join_device

        @property
        def join_process_group(self):
            return zero.join_process_group

    mine = NUM_EPOCHS * (NUM_INPUTS + rank)
    setter = GradientSetter()
    params = linear_params((2, 3, 3, 3), 0)
    state = zero.init(params)
    worst = 0.0
    with Join([setter, zero], zero_optim=zero, grads=grads_at[mine:]):
        for it in range(mine):
            Join.notify_join_context(setter)
            params, state = zero.step(params, grads_at[it], state)
            got = jax.tree.leaves(jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                                               params))
            worst = max(worst, max(float(np.abs(a - np.asarray(b)).max()) for a, b in
                                   zip(got, jax.tree.leaves(params_at[it]), strict=True)))
    final = jax.tree.leaves(zero.latest[0])
    final_diff = max(float(np.abs(np.asarray(a.addressable_data(0)) - np.asarray(b)).max())
                     for a, b in zip(final, jax.tree.leaves(params_at[-1]), strict=True))
    return {"steps": mine, "worst": worst, "final_diff": final_diff}


def child() -> dict:
    import jdist

    jdist.init_process_group(timeout=60)
    rank, world = jdist.get_rank(), jdist.get_world_size()
    out = {"rank": rank, "world": world,
           "collect_shards": case_collect_shards(rank),
           "nondefault_process_group": case_nondefault_process_group(rank),
           "zero_join": case_zero_join(rank, world)}
    jdist.destroy_process_group()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = usage.ru_utime + usage.ru_stime  # this rank's CPU time (suite budget)
    return out
