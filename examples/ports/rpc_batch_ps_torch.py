"""The torch twin of ``rpc_batch_ps.py``: pytorch/examples' ``rpc/batch/parameter_server.py``
on CPU with the port's small CNN and data::

    python examples/ports/rpc_batch_ps_torch.py --batch-update-size 2 --smoke  # mp.spawn
    torchrun --nproc-per-node 3 examples/ports/rpc_batch_ps_torch.py --smoke
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from _common import load_init, save
from _data import batch_ps_trainer_data
from torch import optim

num_classes = 10


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size, init=None):
        self.model = Model()
        if init is not None:
            self.model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.001, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut

    def get_weights(self):
        return {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}


class Trainer:
    def __init__(self, ps_rref, num_batches):
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()
        self.rank = dist.get_rank()
        self.num_batches = num_batches

    def train(self):
        m = self.ps_rref.rpc_sync().get_model()
        losses, times = [], []
        for inputs, labels in batch_ps_trainer_data(self.rank, self.num_batches):
            inputs, labels = torch.from_numpy(inputs), torch.from_numpy(labels)
            t0 = time.perf_counter()
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            )
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        return {"losses": losses, "times": times}


def run_trainer(ps_rref, num_batches):
    return Trainer(ps_rref, num_batches).train()


def run_ps(trainers, args):
    ps = BatchUpdateParameterServer(len(trainers), load_init(args.init))
    ps_rref = rpc.RRef(ps)
    futs = [rpc.rpc_async(trainer, run_trainer, args=(ps_rref, args.num_batches))
            for trainer in trainers]
    results = torch.futures.wait_all(futs)
    return {"trainers": results, "params": ps.get_weights()}


def run(rank, world_size, args):
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(args.master_port))
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    out = None
    if rank != 0:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        out = run_ps([f"trainer{r}" for r in range(1, world_size)], args)
    rpc.shutdown()
    dist.destroy_process_group()
    if out is not None:
        save(args.out, rank, out)


def main():
    p = argparse.ArgumentParser(description="batch-updating parameter server")
    p.add_argument("--num-batches", type=int, default=6)
    p.add_argument("--batch-update-size", type=int, default=5)
    p.add_argument("--master-port", type=int, default=29500, help="mp.spawn runs")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--init")
    p.add_argument("--out")
    args = p.parse_args()
    if args.smoke:
        args.num_batches = 3
    if "RANK" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        world_size = args.batch_update_size + 1
        mp.spawn(run, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
