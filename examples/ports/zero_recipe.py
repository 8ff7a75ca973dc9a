"""torch's ZeRO recipe (``ZeroRedundancyOptimizer`` tutorial) in jdist: a stack of large
``Linear`` layers trained by DDP with Adam, or with Adam sharded by ZeRO::

    jdist-run --nproc-per-node 2 examples/ports/zero_recipe.py [--zero] [--steps 3]

What changes from the torch program: the stack is an NNX module; the step is
``ddp.train_step(loss_fn, nnx.Optimizer(model, tx, wrt=nnx.Param))`` with
``tx = optax.adam(0.01)`` or ``ZeroRedundancyOptimizer(optax.adam(0.01))`` (the ZeRO step
runs inside DDP's compiled step); inputs from a numpy seed (the recipe uses
``torch.randn``). Each rank reports its peak resident memory (``benchmarks/memory.py``
compares it with torch's).
"""

from __future__ import annotations

import argparse
import resource
import time

import jax.numpy as jnp
import numpy as np
import optax
from _common import save
from flax import nnx

import jdist
from jdist.ddp import DistributedDataParallel as DDP
from jdist.optim import ZeroRedundancyOptimizer


class Stack(nnx.Module):
    def __init__(self, width: int, layers: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser(description="torch's ZeRO recipe: DDP + Adam or ZeRO(Adam)")
    p.add_argument("--zero", action="store_true", help="shard Adam's state (ZeRO)")
    p.add_argument("--width", type=int, default=2000)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    jdist.init_process_group("gloo")
    rank = jdist.get_rank()
    model = Stack(args.width, args.layers, nnx.Rngs(rank))  # DDP syncs from rank 0
    ddp = DDP(model)
    tx = optax.adam(0.01)
    opt = nnx.Optimizer(model, ZeroRedundancyOptimizer(tx) if args.zero else tx,
                        wrt=nnx.Param)
    step = ddp.train_step(loss_fn, opt)
    rng = np.random.default_rng(rank)
    losses, times = [], []
    for _ in range(args.steps):
        x = rng.standard_normal((args.batch, args.width)).astype(np.float32)
        y = rng.standard_normal((args.batch, args.width)).astype(np.float32)
        t0 = time.perf_counter()
        losses.append(float(step((x, y))))
        times.append(time.perf_counter() - t0)
    print(f"rank {rank}: loss {losses[-1]:.4f}, peak RSS {peak_rss_mb():.0f} MB", flush=True)
    save(args.out, rank, {"losses": losses, "times": times, "peak_rss_mb": peak_rss_mb()})
    jdist.destroy_process_group()


if __name__ == "__main__":
    main()
