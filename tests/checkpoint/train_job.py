"""A small DDP training job with checkpoints, used in-process and under ``jdist-run``.

DDP over every device of the job (SyncBatchNorm, Adam or ZeRO-1 Adam, optionally the
PowerSGD hook), a ``DistributedSampler``, a numpy Generator and an ``nnx.Rngs`` that
perturb each batch (so their states matter), and a per-epoch log of the sample indices
each rank consumed, kept in the checkpoint as a JSON extra.

As a script (one process per rank)::

    jdist-run --nproc-per-node 2 --devices-per-proc 2 --max-restarts 3 \\
        tests/checkpoint/train_job.py --dir D --out O --steps 12 --kill 0:1:5 ...

``--kill A:R:S[:save]`` makes rank ``R`` SIGKILL itself on attempt ``A`` (the
launcher's restart count) right after step ``S`` (``save``: right after the save of
step ``S`` started, while it is being written); ``--kill A:R:S:term`` sends it SIGTERM
instead, which with ``--preemption`` (``save_on_preemption=True``) makes every rank
save the next step and exit 143.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import signal
import sys

N_SAMPLES = 96
FEATURES = 6


def _model_cls():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(FEATURES, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
            self.fc2 = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.fc2(nnx.relu(self.bn(self.fc1(x))))

    return Net


def data():
    import numpy as np

    rng = np.random.RandomState(7)
    x = rng.randn(N_SAMPLES, FEATURES).astype(np.float32)
    w = rng.randn(FEATURES, 3).astype(np.float32)
    return x, (x @ w).astype(np.float32)


def loss_fn(model, batch):
    import jax.numpy as jnp

    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def build(rank: int, world: int, *, hook: bool = True, zero: bool = False,
          group=None) -> dict:
    """The training state as ``init()`` returns it."""
    import numpy as np
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel, convert_sync_batchnorm
    from jdist.ddp.hooks import PowerSGDState, powerSGD_hook
    from jdist.optim import ZeroRedundancyOptimizer
    from jdist.sampler import DistributedSampler

    model = convert_sync_batchnorm(_model_cls()(nnx.Rngs(0)))
    comm = None
    if hook:
        comm = (PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=2,
                              min_compression_rate=0.5, random_seed=3), powerSGD_hook)
    ddp = DistributedDataParallel(model, comm_hook=comm, process_group=group)
    tx = optax.adam(1e-2)
    if zero:
        tx = ZeroRedundancyOptimizer(tx, group=ddp.process_group)
    opt = nnx.Optimizer(ddp.module, tx, wrt=nnx.Param)
    sampler = DistributedSampler(N_SAMPLES, num_replicas=world, rank=rank, shuffle=True,
                                 seed=5)
    return {"ddp": ddp, "optimizer": opt, "sampler": sampler,
            "np_rng": np.random.default_rng(100 + rank), "rngs": nnx.Rngs(noise=rank),
            "step": 0, "log": {}}


def run(manager, state: dict, total_steps: int, batch: int, kill=None) -> dict:
    """Train until ``total_steps``, saving through ``manager``; returns the state."""
    import jax
    import numpy as np

    x_all, y_all = data()
    step_fn = state["ddp"].train_step(loss_fn, state["optimizer"])
    step = state["step"]
    epoch = state["sampler"].epoch
    while step < total_steps:
        sampler = state["sampler"]
        sampler.set_epoch(epoch)
        it = iter(sampler)
        while step < total_steps:
            idx = list(itertools.islice(it, batch))
            if len(idx) < batch:
                break
            noise = state["np_rng"].normal(size=(batch, FEATURES)).astype(np.float32)
            scale = float(jax.random.uniform(state["rngs"].noise()))
            x = x_all[idx] + 0.01 * noise * scale
            step_fn({"x": x, "y": y_all[idx]})
            step += 1
            log = state["log"]
            log.setdefault(str(epoch), []).extend(int(i) for i in idx)
            state["step"] = step
            saved = manager.save(step, state)
            if kill is not None:
                kill(step, saved)
        epoch += 1
    manager.wait()
    return state


def digest(state: dict) -> dict:
    """sha256 of the parameters+buffers, the optimizer state and the hook state."""
    import jax
    import numpy as np
    from flax import nnx

    from jdist.optim._zero import _to_host

    def sha(tree):
        h = hashlib.sha256()
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            h.update(jax.tree_util.keystr(path).encode())
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            h.update(np.ascontiguousarray(_to_host(x)).tobytes())
        return h.hexdigest()

    ddp = state["ddp"]
    return {"model": sha(nnx.state(ddp.module).to_pure_dict()),
            "optimizer": sha(nnx.state(state["optimizer"]).to_pure_dict()),
            "hook": sha(ddp.comm_hook_state) if ddp.comm_hook_state is not None else None}


def _zero_full(state) -> list:
    """Every optimizer-state leaf as a full host list (ZeRO shards gathered)."""
    import jax
    from flax import nnx

    from jdist.optim._zero import _to_host

    return [_to_host(x).tolist() for x in jax.tree.leaves(
        nnx.state(state["optimizer"]).to_pure_dict())]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="per process")
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--no-hook", action="store_true")
    ap.add_argument("--elastic", action="store_true")
    ap.add_argument("--kill", action="append", default=[])
    ap.add_argument("--preemption", action="store_true",
                    help="CheckpointManager(save_on_preemption=True)")
    ap.add_argument("--reference", help="then train again from scratch, uninterrupted, "
                    "with checkpoints in this directory (the oracle), and report it too")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

    import jdist
    from jdist.checkpoint import CheckpointManager, restart_count

    jdist.init_process_group()
    rank, world = jdist.get_rank(), jdist.get_world_size()
    attempt = restart_count()
    kills = []
    for k in args.kill:
        a, r, s, *how = k.split(":")
        if int(a) == attempt and int(r) == rank:
            kills.append((int(s), how[0] if how else ""))

    def kill(step, saved):
        for s, how in kills:
            if step == s and (saved or how != "save"):
                os.kill(os.getpid(), signal.SIGTERM if how == "term" else signal.SIGKILL)

    manager = CheckpointManager(args.dir, save_interval_steps=args.interval,
                                max_to_keep=args.keep, elastic=args.elastic,
                                save_on_preemption=args.preemption)
    state = manager.restore_or_init(lambda: build(rank, world, hook=not args.no_hook,
                                                  zero=args.zero))
    resumed = manager.restored_step
    zero_after_restore = _zero_full(state) if args.zero else None
    state = run(manager, state, args.steps, args.batch, kill)
    manager.close()
    out = {"rank": rank, "world": world, "attempt": attempt, "resumed_from": resumed,
           "log": state["log"], **digest(state)}
    if args.reference:
        ref_manager = CheckpointManager(args.reference, save_interval_steps=args.interval,
                                        max_to_keep=args.keep)
        ref = run(ref_manager, build(rank, world, hook=not args.no_hook, zero=args.zero),
                  args.steps, args.batch)
        ref_manager.close()
        out["reference"] = {"log": ref["log"], **digest(ref)}
    if args.zero:
        out["zero_after_restore"] = zero_after_restore
        out["zero_final"] = _zero_full(state)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    jdist.destroy_process_group()


if __name__ == "__main__":
    main()
