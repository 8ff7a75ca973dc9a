"""HybridModel: a remote embedding table (RPC) + a DDP-replicated linear layer.

torch's "Combining DDP with distributed RPC" tutorial, in JAX. Three processes::

    jdist-run --nproc-per-node 3 examples/hybrid_ddp_rpc.py [--steps 20] [--smoke]

- rank 0, ``ps``: the parameter server. It holds the embedding table (an
  ``EmbeddingBag`` NNX module, as a :class:`jdist.rpc.RemoteModule`) and acts as the
  master: it starts ``run_trainer`` on both trainers by RPC and collects their results.
- ranks 1 and 2, ``trainer1`` / ``trainer2``: each runs a linear layer wrapped in
  :class:`jdist.ddp.DistributedDataParallel` over the trainers' sub-group
  (``jdist.new_group([1, 2])``; all three processes join the default group so that
  the sub-group can be made). One step::

      with dist_autograd.context() as cid:
          loss = dist_autograd.backward(cid, lambda: stage(remote_emb(idx, off), y))
          opt.step(cid)

  ``remote_emb(idx, off)`` is a differentiable RPC to the table; ``stage`` is the DDP
  layer plus cross-entropy (:func:`jdist.rpc.dist_autograd.ddp_stage`), whose
  gradients DDP averages over the two trainers; the embedding gradient goes back to the
  parameter server by RPC and waits in the context there. One
  :class:`jdist.rpc.DistributedOptimizer` (SGD) per trainer then updates the remote
  table (with this trainer's embedding gradient) and the local layer (with the
  averaged gradient).

Deterministic mode (the default; ``--no-deterministic`` turns it off): after each step
the trainers meet at a barrier of their group, so every forward of step ``k`` reads the
table left by both trainers' updates of step ``k - 1``. The forward lookups of one step
cannot race the other trainer's update of that step anyway: that update comes after
the DDP all-reduce, which needs both trainers' forwards. The result is exactly
``T <- T - lr * (g_1 + g_2)`` per step, which the tests compare with a single-process
computation and with torch. Without the barrier (torch's tutorial has none), a fast
trainer may read the table before the slow one's update of the previous step has
landed: training still works (asynchronous SGD on the table), but the numbers depend
on timing. The linear layer is identical on both trainers in both modes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jdist
from jdist import rpc
from jdist.ddp import DistributedDataParallel
from jdist.rpc import DistributedOptimizer, RemoteModule, RRef, dist_autograd

NUM_CLASSES = 8
_STATE: dict = {}


# ---------------------------------------------------------------- model
class EmbeddingBag(nnx.Module):
    """torch's ``nn.EmbeddingBag(num, dim, mode="sum", include_last_offset=True)``.

    Weights come from a numpy seed (so torch can start from the same table).
    """

    def __init__(self, num_embeddings: int, dim: int, seed: int = 0):
        self.weight = nnx.Param(jnp.asarray(self.initial_weight(num_embeddings, dim, seed)))

    @staticmethod
    def initial_weight(num_embeddings: int, dim: int, seed: int = 0) -> np.ndarray:
        """The starting table (float32 normal from a numpy seed)."""
        return np.random.RandomState(seed).randn(num_embeddings, dim).astype(np.float32)

    def __call__(self, indices, offsets):
        return embedding_bag(self.weight[...], indices, offsets)


def embedding_bag(weight, indices, offsets):
    """Sum of ``weight[indices]`` per bag: bag ``b`` is ``offsets[b]:offsets[b + 1]``.

    ``offsets`` has one entry per bag plus the end (torch's ``include_last_offset``);
    ``indices`` may be padded past ``offsets[-1]`` (padding is ignored), which keeps
    the shapes fixed from batch to batch (no recompilation).
    """
    indices, offsets = jnp.asarray(indices), jnp.asarray(offsets)
    pos = jnp.arange(indices.shape[0])
    seg = jnp.searchsorted(offsets[1:], pos, side="right")  # padding -> out of range
    return jax.ops.segment_sum(weight[indices], seg, num_segments=offsets.shape[0] - 1)


def fc_init(dim: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """torch ``nn.Linear(dim, 8)``-style uniform init, as (kernel (dim, 8), bias)."""
    rs = np.random.RandomState(seed)
    bound = 1.0 / np.sqrt(dim)
    kernel = rs.uniform(-bound, bound, (dim, NUM_CLASSES)).astype(np.float32)
    bias = rs.uniform(-bound, bound, (NUM_CLASSES,)).astype(np.float32)
    return kernel, bias


class FC(nnx.Module):
    """The dense layer trained with DDP."""

    def __init__(self, dim: int, seed: int = 1):
        kernel, bias = fc_init(dim, seed)
        self.kernel = nnx.Param(jnp.asarray(kernel))
        self.bias = nnx.Param(jnp.asarray(bias))

    def __call__(self, x):
        return x @ self.kernel[...] + self.bias[...]


def loss_of(logits, target):
    """Mean cross-entropy (torch's ``nn.CrossEntropyLoss()``)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()


def fc_loss(module, x, target):
    return loss_of(module(x), target)


MAX_BAG = 4


def make_batch(rank: int, step: int, batch: int, num_embeddings: int):
    """Trainer ``rank``'s batch of step ``step``: (indices, offsets, target).

    Bags hold 1..MAX_BAG indices; ``indices`` is padded to ``batch * MAX_BAG``;
    ``offsets`` has ``batch + 1`` entries (the last one ends the real indices).
    """
    rs = np.random.RandomState(1000 * rank + step)
    lengths = rs.randint(1, MAX_BAG + 1, size=batch)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    indices = np.zeros(batch * MAX_BAG, np.int32)
    indices[:offsets[-1]] = rs.randint(0, num_embeddings, size=int(offsets[-1]))
    target = rs.randint(0, NUM_CLASSES, size=batch).astype(np.int32)
    return indices, offsets, target


# ---------------------------------------------------------------- trainer
def forward_loss(remote_emb, stage, indices, offsets, target):
    """HybridModel forward + loss: remote lookup, then the local DDP layer."""
    return stage(remote_emb(indices, offsets), target)


def run_trainer(remote_emb: RemoteModule, rank: int, cfg: dict) -> dict:
    """One trainer's loop (started on the trainer by the parameter server's RPC)."""
    group = _STATE["trainers"]
    ddp = DistributedDataParallel(FC(cfg["dim"]), process_group=group)
    stage = dist_autograd.ddp_stage(ddp, fc_loss)
    opt = DistributedOptimizer(optax.sgd, remote_emb.remote_parameters() + [RRef(ddp.module)],
                               learning_rate=cfg["lr"])
    losses, times = [], []
    for step in range(cfg["steps"]):
        idx, off, target = make_batch(rank, step, cfg["batch"], cfg["num_embeddings"])
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            loss = dist_autograd.backward(cid, forward_loss, remote_emb, stage, idx, off,
                                          target)
            opt.step(cid)
        if cfg["deterministic"]:
            jdist.barrier(group=group)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"losses": losses, "times": times,
            "kernel": np.asarray(ddp.module.kernel[...]),
            "bias": np.asarray(ddp.module.bias[...])}


# ---------------------------------------------------------------- single process
def reference(cfg: dict) -> dict:
    """The same mathematics in one process (deterministic mode), in float64 numpy with
    the gradients written out: table, layer, losses.

    Independent of JAX on purpose: the tests compare jdist (and torch) with it.
    """
    table = EmbeddingBag.initial_weight(cfg["num_embeddings"], cfg["dim"]).astype(np.float64)
    kernel, bias = (a.astype(np.float64) for a in fc_init(cfg["dim"]))
    losses: dict[int, list] = {1: [], 2: []}
    for step in range(cfg["steps"]):
        g_t = np.zeros_like(table)
        g_k, g_b = np.zeros_like(kernel), np.zeros_like(bias)
        for r in (1, 2):
            idx, off, target = make_batch(r, step, cfg["batch"], cfg["num_embeddings"])
            idx = idx[:off[-1]]  # the padding is in no bag
            bag = np.searchsorted(off[1:], np.arange(idx.shape[0]), side="right")
            x = np.zeros((off.shape[0] - 1, table.shape[1]))
            np.add.at(x, bag, table[idx])
            logits = x @ kernel + bias
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            rows = np.arange(target.shape[0])
            losses[r].append(float(-np.log(p[rows, target]).mean()))
            d_logits = p
            d_logits[rows, target] -= 1.0
            d_logits /= target.shape[0]
            np.add.at(g_t, idx, (d_logits @ kernel.T)[bag])  # this trainer's table gradient
            g_k += x.T @ d_logits / 2  # DDP averages the layer's gradients
            g_b += d_logits.sum(axis=0) / 2
        table = table - cfg["lr"] * g_t  # both trainers' updates of the table
        kernel, bias = kernel - cfg["lr"] * g_k, bias - cfg["lr"] * g_b
    return {"table": table, "kernel": kernel, "bias": bias, "losses": losses}


# ---------------------------------------------------------------- main
def config(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--num-embeddings", type=int, default=100)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--smoke", action="store_true", help="3 steps (used by the tests)")
    a = p.parse_args(argv)
    cfg = vars(a)
    if cfg.pop("smoke"):
        cfg["steps"] = 3
    return cfg


def main(argv=None) -> dict | None:
    """Run one process of the job; rank 0 returns the results."""
    cfg = config(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 3:
        raise SystemExit(f"hybrid_ddp_rpc needs 3 processes (a parameter server and two "
                         f"trainers), got WORLD_SIZE={world}; run with --nproc-per-node 3")
    jdist.init_process_group()
    _STATE["trainers"] = jdist.new_group([1, 2])  # every process calls it, as in torch
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=120))
    out = None
    if rank == 0:
        emb = RemoteModule("ps/cpu", EmbeddingBag, (cfg["num_embeddings"], cfg["dim"]))
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer, (emb, r, cfg), timeout=0)
                for r in (1, 2)]
        results = [f.wait() for f in futs]
        table = np.asarray(emb.get_module_rref().local_value().weight[...])
        out = {"table": table, "trainers": results, "cfg": cfg}
        for r, res in zip((1, 2), results, strict=True):
            print(f"trainer{r}: loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}, "
                  f"{1e3 * float(np.median(res['times'])):.1f} ms/step", flush=True)
    rpc.shutdown()
    jdist.destroy_process_group()
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
