"""Functions run in real processes by the multi-process DDP tests (module level: picklable)."""

from __future__ import annotations

import numpy as np


def _init():
    import jdist

    try:
        jdist.collectives.init_process_group()
    except ModuleNotFoundError:  # the store is not there yet: start JAX directly
        _init_jax_directly()
    return jdist.collectives.get_rank(), jdist.collectives.get_world_size()


def _finish():
    """Leave together: the coordinator (rank 0) must not exit before the others."""
    import jax

    import jdist
    from jdist.collectives._group import group_state

    if group_state.runtime:
        jdist.collectives.destroy_process_group()
    else:
        jax.distributed.shutdown()


def _init_jax_directly():
    import os

    import jax

    from jdist.collectives._group import ProcessGroup, group_state, make_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{os.environ['MASTER_PORT']}", world, rank)
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per = tuple(tuple(d for d in devs if d.process_index == r) for r in range(world))
    group_state.default_group = ProcessGroup(
        ranks=tuple(range(world)), rank=rank, mesh=make_mesh(devs), axis_name="dp",
        backend="gloo", devices_per_rank=per)


def _rows(batch, rank, world):
    n = len(next(iter(batch.values())))
    k = n // world
    return {key: v[rank * k:(rank + 1) * k] for key, v in batch.items()}


def train_mlp(rank, world, cap, tx_name, steps=3, group=None, flat=None):
    """DDP-train the test MLP on this rank's rows of the test batches; return params."""
    import jax
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from tests.ddp.models import MLP, data, mse

    tx = optax.sgd(0.1) if tx_name == "sgd" else optax.adam(1e-2)
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model, bucket_cap_mb=cap, process_group=group, flat_buckets=flat)
    step = ddp.train_step(mse, nnx.Optimizer(model, tx, wrt=nnx.Param))
    losses = [float(step(_rows(data(seed=s), rank, world))) for s in range(steps)]
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return losses, params


def join_linear(rank, world, n_batches, divide=True, group=None, throw=False):
    """Uneven inputs: this rank has ``n_batches`` batches; SGD on a linear model."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    class Lin(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((3,)))

    def loss(m, x):
        return jnp.sum(m.w[...] * x) / x.shape[0]

    model = Lin()
    ddp = DDP(model, process_group=group)
    step = ddp.train_step(loss, nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param))
    local = ddp.process_group.num_replicas // max(ddp.process_group.size(), 1)
    with ddp.join(divide_by_initial_world_size=divide, throw_on_early_termination=throw):
        for i in range(n_batches):
            x = np.full((local, 3), float(rank + 1) * (i + 1), np.float32)
            step(x)
    return np.asarray(model.w[...])


def no_sync_vec(rank, group=None):
    """torch's no_sync example: local grads [1,1] (rank 0) and [2,1] (rank 1), twice."""
    import jax.numpy as jnp
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    class Vec(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    ddp = DDP(Vec(), process_group=group)
    f = ddp.value_and_grad(lambda m, x: jnp.sum(m.w[...] * x))
    x = np.array([[1.0, 1.0]] if rank == 0 else [[2.0, 1.0]], np.float32)
    with ddp.no_sync():
        f(x)
    _, grads = f(x)
    return np.asarray(grads["w"][...])


def multiprocess_main():
    """2 processes x 2 devices: training, init sync, model mismatch, join."""
    import jax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.errors import ModelMismatchError
    from tests.ddp.models import MLP

    rank, world = _init()
    out = {"devices": len(jax.devices())}
    out["sgd"] = train_mlp(rank, world, 0.002, "sgd")
    # flat bucket buffers (the default across processes) and, with Adam, variadic
    # all-reduces of chained buckets over gloo (no copy)
    out["adam"] = train_mlp(rank, world, 0.002, "adam", flat=False)
    # init sync: rank 1 starts from other weights and gets rank 0's
    m = MLP(rngs=nnx.Rngs(rank + 10))
    DDP(m)
    out["synced"] = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
    try:
        DDP(MLP((16, 32 + rank, 4), rngs=nnx.Rngs(0)))
        out["mismatch"] = None
    except ModelMismatchError as e:
        out["mismatch"] = str(e)
    out["join"] = join_linear(rank, world, 5 if rank == 0 else 3)
    out["join_active"] = join_linear(rank, world, 5 if rank == 0 else 3, divide=False)
    from jdist.errors import JoinError

    try:
        join_linear(rank, world, 2 if rank == 0 else 1, throw=True)
        out["join_throw"] = None
    except JoinError as e:
        out["join_throw"] = str(e)
    from tests.ddp.test_torch_conformance import ddp_cpu_case

    out["ddp_cpu"] = ddp_cpu_case(rank, world, local_replicas=len(jax.local_devices()))
    from examples.train_ddp import main as example

    out["example"] = example(["--smoke"])
    _finish()
    return out
