"""pytorch/examples ``distributed/rpc/ddp_rpc/main.py`` (the HybridModel) in jdist.

Four processes: ``master`` (rank 2) makes a ``RemoteModule`` holding an ``EmbeddingBag``
on ``ps`` (rank 3) and starts the training loop on ``trainer0`` / ``trainer1`` (ranks
0, 1), which form their own process group for the DDP-replicated ``Linear(16, 8)``::

    jdist-run --nproc-per-node 4 examples/ports/ddp_rpc.py [--smoke] [--deterministic]

Each step: a distributed autograd context, the remote embedding lookup of variable-size
bags, the DDP layer, cross-entropy, ``dist_autograd.backward``, and one
``DistributedOptimizer`` step that updates the table on ``ps`` and the local layer.

What a torch user changes: ``jdist.testing.EmbeddingBag`` (Flax has none) for
``nn.EmbeddingBag``; ``dist_autograd.backward(cid, loss_fn, ...)`` runs the forward
pass, and a DDP module inside it is written ``dist_autograd.ddp_stage(ddp, loss,
pad_batch_to=64)`` (the stage's DDP step reduces the layer's gradients over the
trainers and hands the lookup's gradient back to the RPC); the loss drops its
``.mean()`` (one loss per bag: the stage pads every batch to 64 bags, so one program
serves every batch size, and takes the exact mean over the real bags; ``RemoteModule``
pads the ``EmbeddingBag`` lookups to shape buckets itself); ``optax.sgd`` with
``learning_rate=``; ``RRef(module)`` for the local layer's parameters
(``model.fc.parameters()``).

``--pad`` (not in the original) feeds the same batches padded and masked by hand
instead (:func:`pad_bags`: fixed shapes for the lookup and the DDP step, exact).

``--deterministic`` (not in the original) makes the trainers meet at a barrier after
each step, so each lookup reads the table after both trainers' previous updates (the
original updates the shared table asynchronously: its numbers depend on timing).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import optax
from _common import load_init, save
from _data import hybrid_batches
from flax import nnx

import jdist as dist
from jdist import rpc
from jdist.ddp import DistributedDataParallel as DDP
from jdist.rpc import DistributedOptimizer, RemoteModule, RRef, dist_autograd
from jdist.testing import EmbeddingBag, state_dict_to_nnx

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


def make_embedding_bag(num, dim, mode, init=None, include_last_offset=False):
    """The table on ``ps`` (``init``: torch's weights, for the comparison)."""
    emb = EmbeddingBag(num, dim, mode=mode, include_last_offset=include_last_offset,
                       rngs=nnx.Rngs(0))
    if init:
        state_dict_to_nnx(init, emb)
    return emb


def cross_entropy(fc, x, target):
    """The DDP layer and ``nn.CrossEntropyLoss(reduction="none")`` on one replica's
    shard: one loss per bag; ``ddp_stage(..., pad_batch_to=)`` takes their exact mean over
    the real bags (torch's ``.mean()``)."""
    return optax.softmax_cross_entropy_with_integer_labels(fc(x), target)


PAD_BATCH_TO = 64  # ddp_stage's one batch shape: at least the largest batch (50 bags)


MAX_INDICES = MAX_BAGS = 50  # the largest batch hybrid_batches makes


def pad_bags(indices, offsets, target):
    """``--pad``: the same batch in fixed shapes, so every step runs the programs compiled
    for the first (each new shape compiles the lookup and the DDP step again): indices
    padded to MAX_INDICES past the last offset (ignored), MAX_BAGS bags, the padding bags
    empty and masked out of the loss. The loss and gradients are the unpadded ones."""
    n, b = len(indices), len(offsets)
    idx = np.zeros(MAX_INDICES, np.int64)
    idx[:n] = indices
    off = np.full(MAX_BAGS + 1, n, np.int64)  # include_last_offset: the last entry ends
    off[:b] = offsets
    tgt = np.zeros(MAX_BAGS, np.int64)
    tgt[:b] = target
    mask = np.zeros(MAX_BAGS, np.float32)
    mask[:b] = 1
    return idx, off, tgt, mask


def masked_cross_entropy(fc, x, target, mask):
    """``cross_entropy`` over the real bags only (``--pad``)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(fc(x), target)
    return (ce * mask).sum() / mask.sum()


class HybridModel:
    """A remote EmbeddingBag (sparse part) + a DDP-replicated Linear (dense part)."""

    def __init__(self, remote_emb_module, rank, init=None, pad=False):
        self.remote_emb_module = remote_emb_module
        fc = nnx.Linear(16, 8, rngs=nnx.Rngs(rank))
        if init:
            state_dict_to_nnx(init, fc)
        self.fc = DDP(fc)
        if pad:  # --pad: the batch comes padded and masked (pad_bags)
            self.fc_loss = dist_autograd.ddp_stage(self.fc, masked_cross_entropy)
        else:  # variable-size batches: one padded, masked DDP program for all sizes
            self.fc_loss = dist_autograd.ddp_stage(self.fc, cross_entropy,
                                                   pad_batch_to=PAD_BATCH_TO)
        self.rank = rank

    def loss(self, indices, offsets, *target_and_mask):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc_loss(emb_lookup, *target_and_mask)


def _run_trainer(remote_emb_module, rank, args):
    init = load_init(args["init"])
    fc_init = {k[3:]: v for k, v in init.items() if k.startswith("fc.")} if init else None
    model = HybridModel(remote_emb_module, rank, fc_init, args["pad"])
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    model_parameter_rrefs.append(RRef(model.fc.module))
    opt = DistributedOptimizer(optax.sgd, model_parameter_rrefs, learning_rate=0.05)
    losses, times = [], []
    for epoch in range(args["epochs"]):
        for batch in hybrid_batches(rank, epoch, args["batches"]):
            t0 = time.perf_counter()
            if args["pad"]:
                batch = pad_bags(*batch)
            with dist_autograd.context() as context_id:
                loss = dist_autograd.backward(context_id, model.loss, *batch)
                opt.step(context_id)
            if args["deterministic"]:
                dist.barrier()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        print(f"Training done for epoch {epoch}", flush=True)
    return {"losses": losses, "times": times,
            "fc": {k: np.asarray(v) for k, v in nnx.state(model.fc.module).flat_state()}}


def table_of(module_rref):
    return np.asarray(module_rref.local_value().embedding[...])


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
            kwargs={"mode": "sum", "init": emb_init, "include_last_offset": args["pad"]})
        futs = []
        for trainer_rank in [0, 1]:
            trainer_name = f"trainer{trainer_rank}"
            futs.append(rpc.rpc_async(trainer_name, _run_trainer,
                                      args=(remote_emb_module, trainer_rank, args)))
        out = {"trainers": [fut.wait() for fut in futs],
               "table": rpc.rpc_sync("ps", table_of,
                                     args=(remote_emb_module.get_module_rref(),))}
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
        dist.destroy_process_group()
    return out


def main():
    p = argparse.ArgumentParser(description="HybridModel: DDP + RPC (pytorch/examples)")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batches", type=int, default=10, help="batches per epoch")
    p.add_argument("--smoke", action="store_true", help="1 epoch of 3 batches")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--pad", action="store_true",
                   help="fixed batch shapes (see pad_bags): one compilation, not one per shape")
    p.add_argument("--pg-port", type=int, default=29500, help="the trainers' group")
    p.add_argument("--rpc-port", type=int, default=29501, help="RPC's rendezvous")
    p.add_argument("--rpc-timeout", type=float, default=60.0,
                   help="seconds (torch's default 60 bounds the whole training call)")
    p.add_argument("--init", help="initial weights (emb.weight, fc.*) as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = vars(p.parse_args())
    if args.pop("smoke"):
        args["epochs"], args["batches"] = 1, 3
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != 4:
        raise SystemExit(f"ddp_rpc needs 4 processes (2 trainers, master, ps), got "
                         f"WORLD_SIZE={world_size}; run with jdist-run --nproc-per-node 4")
    out = run_worker(rank, world_size, args)
    if out is not None:
        save(args["out"], rank, out)
        print("Distributed RPC example completed successfully.")


if __name__ == "__main__":
    main()
