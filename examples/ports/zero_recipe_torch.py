"""The torch twin of ``zero_recipe.py``: torch's ZeRO recipe (``nn.Sequential`` of large
``nn.Linear`` layers, DDP, Adam or ``ZeroRedundancyOptimizer(Adam)``) on CPU::

    torchrun --nproc-per-node 2 examples/ports/zero_recipe_torch.py [--zero]
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from _common import save
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser(description="torch's ZeRO recipe")
    p.add_argument("--zero", action="store_true")
    p.add_argument("--width", type=int, default=2000)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    ddp = DDP(model)
    if args.zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=0.01)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    rng = np.random.default_rng(rank)
    losses, times = [], []
    for _ in range(args.steps):
        x = torch.from_numpy(rng.standard_normal((args.batch, args.width)).astype(np.float32))
        y = torch.from_numpy(rng.standard_normal((args.batch, args.width)).astype(np.float32))
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    print(f"rank {rank}: loss {losses[-1]:.4f}, peak RSS {peak_rss_mb():.0f} MB", flush=True)
    save(args.out, rank, {"losses": losses, "times": times, "peak_rss_mb": peak_rss_mb()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
