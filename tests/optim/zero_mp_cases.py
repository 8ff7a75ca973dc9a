"""Child function for the multi-process ZeRO test (module level, importable by spawn)."""

from __future__ import annotations

import numpy as np

STEPS = 3


def params_np():
    rng = np.random.RandomState(0)
    return {"w1": rng.randn(13, 7).astype(np.float32), "b1": np.zeros(7, np.float32),
            "w2": rng.randn(7, 3).astype(np.float32)}


def grads_np(world):
    """Per-step, per-replica gradients (the same numbers on every process)."""
    rng = np.random.RandomState(1)
    return [{k: rng.randn(world, *v.shape).astype(np.float32) for k, v in params_np().items()}
            for _ in range(STEPS)]


def zero_child() -> dict:
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdist
    from jdist.optim import ZeroRedundancyOptimizer

    jdist.init_process_group(timeout=60)
    rank, world = jdist.get_rank(), jdist.get_world_size()
    zero = ZeroRedundancyOptimizer(optax.adam(1e-2))
    mesh, axis = zero.group.mesh, zero.axis
    state = zero.init(params_np())
    local_bytes = sum(s.data.nbytes for x in jax.tree.leaves(state)
                      for s in x.addressable_shards)

    def glob(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                            lambda idx: x[idx])

    specs = zero.state_partition_specs(state)

    def body(p, s, g):
        u, s = zero.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(axis)),
                                 out_specs=(P(), specs), check_vma=False))
    params = jax.tree.map(lambda x: glob(x, P()), params_np())
    for g in grads_np(world):
        params, state = step(params, state, jax.tree.map(lambda x: glob(x, P(axis)), g))
        jax.block_until_ready((params, state))
    out = {"rank": rank, "world": world, "local_bytes": local_bytes,
           "params": jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)}
    zero.consolidate_state_dict(state, to=0)
    if rank == 0:
        out["state"] = zero.state_dict()["state"]
    else:
        try:
            zero.state_dict()
        except RuntimeError as e:
            out["error"] = str(e)
    jdist.destroy_process_group()
    return out
