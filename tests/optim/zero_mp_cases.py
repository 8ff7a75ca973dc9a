"""Child function for the multi-process ZeRO test (module level, importable by spawn)."""

from __future__ import annotations

import numpy as np

STEPS = 3


def params_np():
    rng = np.random.RandomState(0)
    return {"w1": rng.randn(13, 7).astype(np.float32), "b1": rng.randn(7).astype(np.float32),
            "w2": rng.randn(7, 3).astype(np.float32)}


def grads_np(world):
    """Per-step, per-replica gradients (the same numbers on every process)."""
    rng = np.random.RandomState(1)
    return [{k: rng.randn(world, *v.shape).astype(np.float32) for k, v in params_np().items()}
            for _ in range(STEPS)]


def make_tx(name: str):
    """The transformations run over 2 processes: plain Adam and two tree-dependent ones
    (a callable weight-decay mask after a global-norm clip; multi_transform labels)."""
    import jax
    import optax

    def is_matrix(p):
        return jax.tree.map(lambda x: x.ndim > 1, p)

    if name == "adam":
        return optax.adam(1e-2)
    if name == "clip_adamw_mask":
        return optax.chain(optax.clip_by_global_norm(0.5),
                           optax.adamw(1e-2, weight_decay=0.1, mask=is_matrix))
    labels = lambda p: jax.tree.map(lambda m: "decay" if m else "plain", is_matrix(p))  # noqa: E731
    return optax.multi_transform({"decay": optax.lamb(1e-2, weight_decay=0.1),
                                  "plain": optax.sgd(0.05, momentum=0.9)}, labels)


CASES = ("adam", "clip_adamw_mask", "multi_transform")


def _run_case(name, world):
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jdist.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(make_tx(name))
    mesh, axis = zero.group.mesh, zero.axis
    state = zero.init(params_np())
    local_bytes = sum(s.data.nbytes for x in jax.tree.leaves(state)
                      for s in x.addressable_shards)
    specs = zero.state_partition_specs(state)

    def glob(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                            lambda idx: x[idx])

    def body(p, s, g):
        u, s = zero.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(axis)),
                                 out_specs=(P(), specs), check_vma=False))
    params = jax.tree.map(lambda x: glob(x, P()), params_np())
    for g in grads_np(world):
        params, state = step(params, state, jax.tree.map(lambda x: glob(x, P(axis)), g))
        jax.block_until_ready((params, state))
    return zero, state, local_bytes, params


def zero_child() -> dict:
    import jax

    import jdist

    jdist.init_process_group(timeout=60)
    rank, world = jdist.get_rank(), jdist.get_world_size()
    out = {"rank": rank, "world": world, "cases": {}}
    for name in CASES:
        zero, state, local_bytes, params = _run_case(name, world)
        case = {"local_bytes": local_bytes,
                "params": jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)}
        zero.consolidate_state_dict(state, to=0)
        if rank == 0:
            case["state"] = zero.state_dict()["state"]
        else:
            try:
                zero.state_dict()
            except RuntimeError as e:
                case["error"] = str(e)
        out["cases"][name] = case
    jdist.destroy_process_group()
    return out
