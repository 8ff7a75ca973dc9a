"""PowerSGD through DDP on 2 real processes x 2 devices == one process with 4 devices.

The hook state is per replica (error memories differ), so this checks that it is kept
and threaded correctly when replicas live in different processes.
"""

from __future__ import annotations

import jax
import numpy as np

from tests.helpers import run_procs, tree_allclose

STEPS = 4


def _batch(seed):
    rng = np.random.RandomState(seed)
    return {"x": rng.randn(32, 16).astype(np.float32), "y": rng.randn(32, 4).astype(np.float32)}


def _train(group=None, rank=0, world=1):
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.ddp import hooks as H
    from tests.ddp.models import MLP, mse

    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model, process_group=group)
    ddp.register_comm_hook(H.PowerSGDState(start_powerSGD_iter=2), H.powerSGD_hook)
    step = ddp.train_step(mse, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    k = 32 // world
    losses = []
    for s in range(STEPS):
        b = {key: v[rank * k:(rank + 1) * k] for key, v in _batch(s).items()}
        losses.append(float(step(b)))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    st = ddp.comm_hook_state
    return losses, params, int(np.asarray(st.iter)), len(st.error_dict)


def hooks_child():
    import jdist

    jdist.collectives.init_process_group(timeout=60)
    rank, world = jdist.collectives.get_rank(), jdist.collectives.get_world_size()
    try:
        return _train(rank=rank, world=world)
    finally:
        jdist.collectives.destroy_process_group()


def test_powersgd_ddp_two_processes_equals_one_process():
    from jdist.collectives._group import ProcessGroup, make_mesh

    res = run_procs(hooks_child, 2, devices_per_proc=2, timeout=240)
    devs = tuple(jax.devices()[:4])
    group = ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs, "dp"), axis_name="dp",
                         backend="local", devices_per_rank=(devs,), name="LOCAL4")
    ref_losses, ref_params, ref_iter, ref_buckets = _train(group=group)
    for losses, params, it, buckets in res:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        tree_allclose(params, ref_params, rtol=1e-5, atol=1e-6)
        assert (it, buckets) == (ref_iter, ref_buckets) == (STEPS, ref_buckets)
