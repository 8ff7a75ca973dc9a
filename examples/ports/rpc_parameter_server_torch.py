"""The torch twin of ``rpc_parameter_server.py``: pytorch/examples'
``rpc/parameter_server/rpc_parameter_server.py`` with the port's data (8x8 digits, so
``fc1`` has 256 inputs), ``--steps``, ``--no-dropout``, ``--init`` and ``--out``::

    torchrun --nproc-per-node 4 examples/ports/rpc_parameter_server_torch.py --smoke
"""

from __future__ import annotations

import argparse
import os
import time
from threading import Lock

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from _common import load_init, save
from _data import digits, shuffled_batches
from torch import optim
from torch.distributed.optim import DistributedOptimizer


class Net(nn.Module):
    def __init__(self, dropout=(0.25, 0.5)):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout2d(dropout[0])
        self.dropout2 = nn.Dropout2d(dropout[1])
        self.fc1 = nn.Linear(64 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(self.conv2(x), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self, dropout, init=None):
        super().__init__()
        self.model = Net(dropout)
        if init is not None:
            self.model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})

    def forward(self, inp):
        return self.model(inp)

    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        cpu_grads = {}
        for k, v in grads.items():
            cpu_grads[k.to("cpu")] = v.to("cpu")
        return cpu_grads

    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]

    def get_weights(self):
        return {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}


param_server = None
global_lock = Lock()


def get_parameter_server(dropout, init=None):
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer(dropout, init)
        return param_server


def run_parameter_server(rank, world_size):
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
    rpc.shutdown()


class TrainerNet(nn.Module):
    def __init__(self, dropout, init=None):
        super().__init__()
        self.param_server_rref = rpc.remote(
            "parameter_server", get_parameter_server, args=(dropout, init))

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def run_training_loop(rank, args):
    net = TrainerNet(args.dropout, load_init(args.init))
    opt = DistributedOptimizer(optim.SGD, net.get_global_param_rrefs(), lr=0.03)
    x, y, x_test, y_test = digits()
    losses, times = [], []
    for i, idx in enumerate(shuffled_batches(len(x), 32, rank, args.steps)):
        data, target = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            model_output = net(data)
            loss = F.nll_loss(model_output, target)
            if i % 5 == 0:
                print(f"Rank {rank} training batch {i} loss {loss.item()}", flush=True)
            dist_autograd.backward(cid, [loss])
            assert remote_method(ParameterServer.get_dist_gradients,
                                 net.param_server_rref, cid) != {}
            opt.step(cid)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x_test), 32):
            out = net(torch.from_numpy(x_test[i:i + 32]))
            correct += int((out.argmax(dim=1).numpy() == y_test[i:i + 32]).sum())
    weights = remote_method(ParameterServer.get_weights, net.param_server_rref)
    return {"losses": losses, "times": times, "accuracy": correct / len(x_test),
            "params": weights}


def main():
    p = argparse.ArgumentParser(description="Parameter-Server RPC based training")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--no-dropout", dest="dropout", action="store_const", const=(0.0, 0.0),
                   default=(0.25, 0.5))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--init")
    p.add_argument("--out")
    args = p.parse_args()
    if args.smoke:
        args.steps = 6
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        run_parameter_server(0, world_size)
    else:
        rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size)
        result = run_training_loop(rank, args)
        rpc.shutdown()
        save(args.out, rank, result)


if __name__ == "__main__":
    main()
