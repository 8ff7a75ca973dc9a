"""The digits DDP demo with checkpoints: kill a rank, watch the job restart and resume.

``examples/train_ddp.py`` plus a :class:`jdist.checkpoint.CheckpointManager`. The
whole resume logic is one line, ``state = manager.restore_or_init(init)``: on the
first launch it calls ``init()``; after ``jdist-run`` restarts the job it restores the
newest step every rank finished (model, Adam state, sampler position, RNG) and
training continues from there, exactly as if it had never stopped.

Run it on 2 processes with 2 virtual CPU devices each, killing rank 1 at step 30::

    jdist-run --nproc-per-node 2 --devices-per-proc 2 --max-restarts 1 \\
        examples/train_resume.py --ckpt /tmp/digits-ckpt --kill-at 30

    python examples/train_resume.py --ckpt /tmp/d --devices 4   # one process
    python examples/train_resume.py --ckpt /tmp/d --smoke        # a few steps (tests)

Run it again with the same ``--ckpt`` and it resumes where the last run stopped (or
reports that training is done).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="DDP digits CNN with checkpoints")
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (all ranks)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="global batch (all processes)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--kill-at", type=int, default=None,
                    help="SIGKILL the last rank after this step (once its last save is "
                    "on disk), on the first attempt only")
    ap.add_argument("--devices", type=int, default=4, help="virtual devices (1 process)")
    ap.add_argument("--smoke", action="store_true", help="a few steps, for tests")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # the DDP demo's pieces: virtual devices, data, model (its module imports no JAX)
    from train_ddp import _cnn_and_loss, _digits, _setup

    if not os.environ.get("JDIST_RUN_ID"):  # under jdist-run, --devices-per-proc decides
        _setup(args.devices)

    import numpy as np
    import optax
    from flax import nnx

    import jdist
    from jdist.checkpoint import CheckpointManager, restart_count
    from jdist.ddp import DistributedDataParallel
    from jdist.sampler import DistributedSampler

    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not jdist.is_initialized():
        jdist.init_process_group()
        started = True
    rank, world = (jdist.get_rank(), jdist.get_world_size()) if jdist.is_initialized() \
        else (0, 1)

    CNN, loss_fn = _cnn_and_loss()

    images, labels = _digits(np)
    train = np.random.default_rng(0).permutation(len(images))[297:]

    def init() -> dict:
        """Everything the run needs, as on a first launch."""
        ddp = DistributedDataParallel(CNN(nnx.Rngs(0)))
        opt = nnx.Optimizer(ddp.module, optax.adam(args.lr), wrt=nnx.Param)
        sampler = DistributedSampler(len(train), num_replicas=world, rank=rank, seed=0,
                                     drop_last=True)
        return {"ddp": ddp, "optimizer": opt, "sampler": sampler, "step": 0,
                "losses": []}

    manager = CheckpointManager(args.ckpt, save_interval_steps=args.save_every,
                                max_to_keep=2)
    state = manager.restore_or_init(init)  # the one line of resume logic
    attempt = restart_count()
    if rank == 0:
        where = (f"resumed from step {manager.restored_step}" if manager.restored_step
                 is not None else "a fresh start")
        print(f"attempt {attempt}: {where}", flush=True)

    per_process = args.batch // world
    step_fn = state["ddp"].train_step(loss_fn, state["optimizer"])
    epochs, max_steps = (1, 6) if args.smoke else (args.epochs, None)
    step = state["step"]
    for epoch in range(state["sampler"].epoch, epochs):
        sampler = state["sampler"]
        sampler.set_epoch(epoch)  # the same epoch keeps a restored position
        it = iter(sampler)  # taken batch by batch: the position counts consumed samples
        while max_steps is None or step < max_steps:
            idx = np.fromiter(itertools.islice(it, per_process), np.int64)
            if idx.size < per_process:
                break
            loss = float(step_fn({"x": images[train[idx]], "y": labels[train[idx]]}))
            step += 1
            state["step"] = step
            state["losses"].append(loss)
            manager.save(step, state)
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss:.4f}", flush=True)
            if args.kill_at == step and attempt == 0 and rank == world - 1:
                # wait for the write in flight, so the demo resumes from the last save
                # (a kill while it is written falls back to the save before it)
                manager.wait()
                print(f"rank {rank}: killing myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    if rank == 0:
        print(f"done: {step} steps, last loss {state['losses'][-1]:.4f} "
              f"({world} process(es), {attempt} restart(s))", flush=True)
    if started:
        jdist.destroy_process_group()
    return {"step": step, "losses": state["losses"], "attempt": attempt,
            "restored_step": manager.restored_step}


if __name__ == "__main__":
    main()
