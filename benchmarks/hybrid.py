"""HybridModel iteration time: jdist (examples/hybrid_ddp_rpc.py) vs torch, same run.

Three processes (a parameter server with the embedding table, two DDP trainers) run
the jdist example, then torch's version of the same model (torch RPC + DDP over the
trainers' gloo sub-group + ``torch.distributed.autograd`` + ``DistributedOptimizer``,
from the same initial weights and batches), in the same processes. Prints the median
time per training step of each and the ratio::

    python benchmarks/hybrid.py [--steps 30] [--num-embeddings 100000] [--dim 64] \\
        [--batch 256]

``torch_main`` is also what ``tests/rpc/test_hybrid.py`` compares jdist with, there
with ``locked_steps=True``: torch's ``DistributedOptimizer`` runs ``torch.optim.SGD`` as
a TorchScript functional optimizer whose ``step`` takes no lock (torch 2.13's
``_ScriptLocalOptimizer``; its ``_LocalOptimizer``, used for optimizer classes without a
functional twin, holds a global one), so the two trainers' in-place updates of the
shared table can interleave and lose part of one (seen as one or two rows off by about
``lr * grad`` in a few runs of fifty). jdist's owner steps are serialized, as
``_LocalOptimizer``'s. ``LockedSGD`` (an ``SGD`` subclass, hence no functional twin)
gives torch that path; the benchmark keeps the plain ``SGD`` a torch user gets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

_TSTATE: dict = {}


def _locked_sgd():
    """``LockedSGD`` (see the module docstring), made on first use: importing this module
    needs no torch."""
    if "LockedSGD" not in globals():
        import torch

        globals()["LockedSGD"] = type("LockedSGD", (torch.optim.SGD,), {
            "__module__": __name__,
            "__doc__": "torch.optim.SGD, stepped under _LocalOptimizer's global lock."})
    return globals()["LockedSGD"]


def __getattr__(name: str):
    """``benchmarks.hybrid.LockedSGD``, where pickle looks it up on the parameter server."""
    if name == "LockedSGD":
        return _locked_sgd()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- torch's HybridModel
def _torch_embedding_bag(num_embeddings: int, dim: int, seed: int = 0):
    import torch

    from examples.hybrid_ddp_rpc import EmbeddingBag

    emb = torch.nn.EmbeddingBag(num_embeddings, dim, mode="sum", include_last_offset=True)
    w = EmbeddingBag.initial_weight(num_embeddings, dim, seed)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w))
    return emb


def _torch_trainer(emb, rank: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
    from torch.nn.parallel import DistributedDataParallel

    from examples.hybrid_ddp_rpc import fc_init, make_batch

    group = _TSTATE["trainers"]
    kernel, bias = fc_init(cfg["dim"])
    fc = torch.nn.Linear(cfg["dim"], kernel.shape[1])
    with torch.no_grad():
        fc.weight.copy_(torch.from_numpy(kernel.T.copy()))
        fc.bias.copy_(torch.from_numpy(bias))
    ddp = DistributedDataParallel(fc, process_group=group)
    params = emb.remote_parameters() + [RRef(p) for p in ddp.parameters()]
    sgd = _locked_sgd() if cfg.get("locked_steps") else torch.optim.SGD
    opt = DistributedOptimizer(sgd, params, lr=cfg["lr"])
    losses, times = [], []
    for step in range(cfg["steps"]):
        idx, off, target = make_batch(rank, step, cfg["batch"], cfg["num_embeddings"])
        indices = torch.from_numpy(idx[:off[-1]].astype(np.int64))
        offsets = torch.from_numpy(off.astype(np.int64))
        y = torch.from_numpy(target.astype(np.int64))
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            out = ddp(emb.forward(indices, offsets))
            loss = torch.nn.functional.cross_entropy(out, y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        if cfg["deterministic"]:
            dist.barrier(group=group)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"losses": losses, "times": times,
            "kernel": fc.weight.detach().numpy().T.copy(),
            "bias": fc.bias.detach().numpy().copy()}


def torch_main(cfg: dict, pg_port: int, rpc_port: int, locked_steps: bool = False
               ) -> dict | None:
    """torch's HybridModel in this process (rank from $RANK); rank 0 returns results.

    ``locked_steps``: the trainers' optimizer steps on the parameter server take one
    lock (``LockedSGD``; see the module docstring), as jdist's do.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from torch.distributed.nn import RemoteModule

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank,
                            world_size=3)
    _TSTATE["trainers"] = dist.new_group([1, 2])
    name = "ps" if rank == 0 else f"trainer{rank}"
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}",
                                           rpc_timeout=300, num_worker_threads=16)
    rpc.init_rpc(name, rank=rank, world_size=3, rpc_backend_options=opts)
    out = None
    if rank == 0:
        emb = RemoteModule("ps/cpu", _torch_embedding_bag,
                           args=(cfg["num_embeddings"], cfg["dim"]))
        cfg = dict(cfg, locked_steps=locked_steps)
        futs = [rpc.rpc_async(f"trainer{r}", _torch_trainer, args=(emb, r, cfg), timeout=0)
                for r in (1, 2)]
        results = [f.wait() for f in futs]
        table = emb.module_rref.local_value().weight.detach().numpy().copy()
        out = {"table": table, "trainers": results}
    rpc.shutdown()
    import gc

    gc.collect()  # the trainers' DDP reducers go before their group (torch gloo exit abort)
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------- both, one launch
def both(argv: list, pg_port: int, rpc_port: int, locked_steps: bool = False
         ) -> dict | None:
    """jdist's example then torch's version, in this process (one rank of three)."""
    from examples.hybrid_ddp_rpc import config, main

    mine = main(argv)
    theirs = torch_main(config(argv), pg_port, rpc_port, locked_steps)
    return None if mine is None else {"jdist": mine, "torch": theirs}


def run(argv: list, timeout: float = 900.0) -> dict:
    """Launch 3 processes running :func:`both`; rank 0's results."""
    import benchmarks.hybrid as me  # by module name: the children import it
    from jdist.launch import spawn
    from jdist.launch._spawn import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return spawn(me.both, args=(argv, free_port(), free_port()), nprocs=3, timeout=timeout,
                 env={"PYTHONPATH": path})[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--num-embeddings", type=int, default=100000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    argv = ["--steps", str(a.steps), "--num-embeddings", str(a.num_embeddings),
            "--dim", str(a.dim), "--batch", str(a.batch)]
    out = run(argv)
    warm = max(1, a.steps // 5)
    rows = []
    for lib in ("jdist", "torch"):
        t = np.concatenate([np.asarray(r["times"][warm:]) for r in out[lib]["trainers"]])
        rows.append((lib, 1e3 * float(np.median(t))))
    diff = float(np.abs(out["jdist"]["table"] - out["torch"]["table"]).max())
    print(f"HybridModel: embedding {a.num_embeddings} x {a.dim}, batch {a.batch}, "
          f"{a.steps} steps (first {warm} not timed), 3 processes, CPU")
    for lib, ms in rows:
        print(f"  {lib:6s} {ms:9.2f} ms / step (median over both trainers)")
    print(f"  ratio jdist / torch: {rows[0][1] / rows[1][1]:.2f}")
    print(f"  max |table_jdist - table_torch| after {a.steps} steps: {diff:.2e}")
    from benchmarks._parse import bench_json, row, table

    case = f"train step, table {a.num_embeddings} x {a.dim}, batch {a.batch}"
    print(bench_json("hybrid", [table(
        "HybridModel (PS embedding by RPC + DDP linear, dist autograd, DistributedOptimizer)",
        "torch", "jdist / torch (time: lower is better)",
        [row(case, "ms", rows[0][1], rows[1][1], rows[0][1] / rows[1][1],
             f"max table difference {diff:.1e}")])]))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
