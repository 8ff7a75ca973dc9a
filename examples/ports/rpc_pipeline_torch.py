"""The torch twin of ``rpc_pipeline.py``: pytorch/examples ``rpc/pipeline/main.py`` with
the port's small shards, data and flags, and the ``DistributedOptimizer`` of the
tutorial's earlier revision::

    torchrun --nproc-per-node 3 examples/ports/rpc_pipeline_torch.py --smoke
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from _common import load_init, save
from _data import pipeline_batches
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

num_classes = 10


class ShardBase(nn.Module):
    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def _load(self, init):
        if init is not None:
            self.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]

    def running_means(self):
        return {k.split(".")[0]: v.detach().numpy().copy()
                for k, v in self.state_dict().items() if k.endswith("running_mean")}

    def weights(self):
        return {k: v.detach().numpy().copy() for k, v in self.state_dict().items()
                if "running" not in k and "num_batches" not in k}


class Shard1(ShardBase):
    def __init__(self, init=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self._load(init)

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return out


class Shard2(ShardBase):
    def __init__(self, init=None):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, num_classes)
        self._load(init)

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))
        return out


class DistNet(nn.Module):
    def __init__(self, split_size, workers, inits=(None, None)):
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], Shard1, args=(inits[0],))
        self.p2_rref = rpc.remote(workers[1], Shard2, args=(inits[1],))

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


def run_master(args):
    init = load_init(args.init)
    inits = (None, None) if init is None else tuple(
        {k[len(p):]: v for k, v in init.items() if k.startswith(p)} for p in ("p1.", "p2."))
    model = DistNet(args.split_size, ["worker1", "worker2"], inits)
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    losses, times = [], []
    for inputs, labels in pipeline_batches(args.num_batches, args.batch_size):
        inputs, labels = torch.from_numpy(inputs), torch.from_numpy(labels)
        t0 = time.perf_counter()
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"losses": losses, "times": times,
            "p1": model.p1_rref.rpc_sync().weights(),
            "p2": model.p2_rref.rpc_sync().weights(),
            "means": [model.p1_rref.rpc_sync().running_means(),
                      model.p2_rref.rpc_sync().running_means()]}


def main():
    p = argparse.ArgumentParser(description="pipeline parallelism over RPC")
    p.add_argument("--num-batches", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--split-size", type=int, default=8)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--init")
    p.add_argument("--out")
    args = p.parse_args()
    if args.smoke:
        args.num_batches, args.batch_size, args.split_size = 2, 8, 2
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=256, rpc_timeout=300)
    out = None
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        out = run_master(args)
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    rpc.shutdown()
    if out is not None:
        save(args.out, rank, out)


if __name__ == "__main__":
    main()
