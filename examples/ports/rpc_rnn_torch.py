"""The torch twin of ``rpc_rnn.py``: embedding and decoder as torch ``RemoteModule`` s
on "ps", an ``nn.LSTM`` on the trainer, dist autograd and ``DistributedOptimizer``::

    torchrun --nproc-per-node 2 examples/ports/rpc_rnn_torch.py --smoke
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from _common import save
from _data import token_batches
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

VOCAB, EMB, HIDDEN = 64, 32, 64


class RNNModel:
    def __init__(self):
        self.emb = RemoteModule("ps/cpu", nn.Embedding, args=(VOCAB, EMB))
        self.rnn = nn.LSTM(EMB, HIDDEN, batch_first=True)
        self.decoder = RemoteModule("ps/cpu", nn.Linear, args=(HIDDEN, VOCAB))

    def parameter_rrefs(self):
        return (self.emb.remote_parameters() + [rpc.RRef(p) for p in self.rnn.parameters()]
                + self.decoder.remote_parameters())

    def loss(self, tokens, targets):
        x = self.emb(tokens)
        h, _ = self.rnn(x)
        logits = self.decoder(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train(steps: int) -> dict:
    torch.manual_seed(0)
    model = RNNModel()
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.5)
    losses, times = [], []
    for i, (tokens, targets) in enumerate(token_batches(steps, VOCAB)):
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            loss = model.loss(torch.from_numpy(tokens), torch.from_numpy(targets))
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if i % 10 == 0:
            print(f"step {i} loss {losses[-1]:.4f}", flush=True)
    return {"losses": losses, "times": times}


def main():
    p = argparse.ArgumentParser(description="RNN over a parameter server (RPC), torch")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--smoke", action="store_true", help="6 steps")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.steps = 6
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc("ps" if rank == 0 else "trainer", rank=rank, world_size=world_size)
    result = train(args.steps) if rank == 1 else {}
    rpc.shutdown()
    save(args.out, rank, result)


if __name__ == "__main__":
    main()
