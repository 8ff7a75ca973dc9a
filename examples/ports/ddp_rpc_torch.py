"""The torch twin of ``ddp_rpc.py``: pytorch/examples ``rpc/ddp_rpc/main.py`` on CPU/gloo
under torchrun (ranks from the environment instead of ``mp.spawn``), with the port's
seeded batches and flags::

    torchrun --nproc-per-node 4 examples/ports/ddp_rpc_torch.py --smoke --deterministic

``--deterministic`` also steps the table under one lock (``LockedSGD``): torch runs
``optim.SGD`` as a TorchScript functional optimizer whose steps take no lock, so the
two trainers' in-place updates of the shared table can interleave and lose part of one
(jdist's owner steps are serialized, as torch's ``_LocalOptimizer``'s).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.optim as optim
from _common import load_init, save
from _data import hybrid_batches
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


class LockedSGD(optim.SGD):
    """``optim.SGD`` without a TorchScript twin: ``DistributedOptimizer`` then steps it in
    a ``_LocalOptimizer``, under that class's global lock."""


def make_embedding_bag(num, dim, mode, init=None):
    emb = torch.nn.EmbeddingBag(num, dim, mode=mode)
    if init:
        emb.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    return emb


class HybridModel(torch.nn.Module):
    def __init__(self, remote_emb_module, rank, init=None):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        fc = torch.nn.Linear(16, 8)
        if init:
            fc.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
        self.fc = DDP(fc)
        self.rank = rank

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def _run_trainer(remote_emb_module, rank, args):
    init = load_init(args["init"])
    fc_init = {k[3:]: v for k, v in init.items() if k.startswith("fc.")} if init else None
    model = HybridModel(remote_emb_module, rank, fc_init)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    sgd = LockedSGD if args["deterministic"] else optim.SGD
    opt = DistributedOptimizer(sgd, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    losses, times = [], []
    for epoch in range(args["epochs"]):
        for indices, offsets, target in hybrid_batches(rank, epoch, args["batches"]):
            indices, offsets, target = (torch.from_numpy(a) for a in (indices, offsets,
                                                                      target))
            t0 = time.perf_counter()
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            if args["deterministic"]:
                dist.barrier()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        print(f"Training done for epoch {epoch}", flush=True)
    return {"losses": losses, "times": times,
            "fc": {k: v.detach().numpy().copy() for k, v in model.fc.module.state_dict().items()}}


def table_of(module_rref):
    return module_rref.local_value().weight.detach().numpy().copy()


def run_worker(rank, world_size, args):
    # different ports for init_rpc and the trainers' init_process_group, as the original
    rpc_backend_options = rpc.TensorPipeRpcBackendOptions()
    rpc_backend_options.init_method = f"tcp://localhost:{args['rpc_port']}"
    rpc_backend_options.rpc_timeout = args["rpc_timeout"]
    out = None
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
        init = load_init(args["init"])
        emb_init = {k[4:]: v for k, v in init.items() if k.startswith("emb.")} \
            if init else None
        remote_emb_module = RemoteModule(
            "ps", make_embedding_bag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum", "init": emb_init})
        futs = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(remote_emb_module, r, args))
                for r in [0, 1]]
        out = {"trainers": [fut.wait() for fut in futs],
               "table": rpc.rpc_sync("ps", table_of, args=(remote_emb_module.module_rref,))}
    elif rank <= 1:
        dist.init_process_group(backend="gloo", rank=rank, world_size=2,
                                init_method=f"tcp://localhost:{args['pg_port']}")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
    rpc.shutdown()
    if rank <= 1:
        import gc

        gc.collect()  # DDP's reducer before its group (gloo aborts at exit otherwise)
        dist.destroy_process_group()
    return out


def main():
    p = argparse.ArgumentParser(description="HybridModel: DDP + RPC (pytorch/examples)")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--pg-port", type=int, default=29500)
    p.add_argument("--rpc-port", type=int, default=29501)
    p.add_argument("--rpc-timeout", type=float, default=60.0)
    p.add_argument("--init")
    p.add_argument("--out")
    args = vars(p.parse_args())
    if args.pop("smoke"):
        args["epochs"], args["batches"] = 1, 3
    torch.set_num_threads(1)
    # torchrun tells every rank to be a client of any tcp:// store (its agent-store
    # flag): nobody would host the two stores this program makes; the original runs
    # under mp.spawn, where rank 0 hosts them
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = run_worker(rank, world_size, args)
    if out is not None:
        save(args["out"], rank, out)


if __name__ == "__main__":
    main()
