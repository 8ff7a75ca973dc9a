"""pytorch/examples ``distributed/ddp/example.py`` ported to jdist.

A ``ToyModel`` (Linear 10 -> 10, ReLU, Linear 10 -> 5) wrapped in DDP, trained with SGD
on an MSE loss; each process draws its own batch of 20. The lines a torch user changes:

    torch                                         jdist (`import jdist as dist`)
    dist.init_process_group(backend)              dist.init_process_group()
    ddp_model = DDP(model, device_ids=[rank])     ddp_model = DistributedDataParallel(model)
    optimizer = optim.SGD(params, lr=0.001)       optimizer = nnx.Optimizer(model,
                                                      optax.sgd(0.001), wrt=nnx.Param)
    optimizer.zero_grad(); out = ddp_model(x)     step = ddp_model.train_step(loss_fn,
    loss_fn(out, y).backward(); optimizer.step()      optimizer); loss = step((x, y))

Run (``--steps`` adds steps to torch's single one; ``--smoke`` is 3 steps)::

    jdist-run --nproc-per-node 2 examples/ports/ddp_example.py [--steps 1]

The torch twin is ``ddp_example_torch.py`` (``torchrun``), same data (numpy seeds) and,
with ``--init`` (a state dict in ``.npz``), the same initial weights.
"""

from __future__ import annotations

import argparse
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
from _common import load_init, save
from _data import toy_batch
from flax import nnx

import jdist as dist
from jdist.ddp import DistributedDataParallel
from jdist.testing import state_dict_to_nnx


class ToyModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.net1 = nnx.Linear(10, 10, rngs=rngs)
        self.net2 = nnx.Linear(10, 5, rngs=rngs)

    def __call__(self, x):
        return self.net2(nnx.relu(self.net1(x)))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)  # nn.MSELoss()


def demo_basic(rank: int, args) -> dict:
    print(f"[{os.getpid()}] rank = {dist.get_rank()}, world_size = {dist.get_world_size()}")
    model = ToyModel(nnx.Rngs(0))
    if args.init:
        state_dict_to_nnx(load_init(args.init), model)
    ddp_model = DistributedDataParallel(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.001), wrt=nnx.Param)
    step = ddp_model.train_step(loss_fn, optimizer)
    losses, times = [], []
    for i in range(args.steps):
        batch = toy_batch(rank, i)  # drawn outside the timed step, as in the torch twin
        t0 = time.perf_counter()
        losses.append(float(step(batch)))  # mean loss over the replicas
        times.append(time.perf_counter() - t0)
        print(f"rank {rank} step {i} loss {losses[-1]:.6f}", flush=True)
    print(f"training completed in rank {rank}!")
    return {"losses": losses, "times": times,
            "params": {k: np.asarray(v) for k, v in
                       nnx.state(model, nnx.Param).flat_state()}}


def main() -> None:
    p = argparse.ArgumentParser(description="DDP ToyModel (pytorch/examples ddp/example.py)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="3 steps")
    p.add_argument("--init", help="initial weights: a torch state dict as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.steps = 3
    dist.init_process_group()
    rank = dist.get_rank()
    print(f"[{os.getpid()}]: world_size = {dist.get_world_size()}, rank = {rank}")
    save(args.out, rank, demo_basic(rank, args))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
