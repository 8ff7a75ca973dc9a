"""The torch twin of ``ddp_example.py``: pytorch/examples ``ddp/example.py`` on CPU/gloo.

Same program, with the jdist port's data (numpy seeds), ``--steps``, ``--init`` and
``--out``. Run with ``torchrun --nproc-per-node 2 examples/ports/ddp_example_torch.py``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from _common import load_init, save
from _data import toy_batch
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank: int, args) -> dict:
    model = ToyModel()
    if args.init:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in load_init(args.init).items()})
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    losses, times = [], []
    for i in range(args.steps):
        x, y = (torch.from_numpy(a) for a in toy_batch(rank, i))
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(ddp_model(x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # for the record: jdist's step returns the replicas' mean
        losses.append(float(mean) / dist.get_world_size())
        print(f"rank {rank} step {i} loss {losses[-1]:.6f}", flush=True)
    return {"losses": losses, "times": times,
            "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}}


def main() -> None:
    p = argparse.ArgumentParser(description="DDP ToyModel (pytorch/examples ddp/example.py)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="3 steps")
    p.add_argument("--init", help="initial weights: a state dict as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.steps = 3
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"[{os.getpid()}]: world_size = {dist.get_world_size()}, rank = {rank}")
    save(args.out, rank, demo_basic(rank, args))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
