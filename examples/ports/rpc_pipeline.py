"""pytorch/examples ``distributed/rpc/pipeline/main.py`` in jdist: a model split in two
shards on two workers, pipelined over micro-batches by RPC, trained from the master
with distributed autograd and a ``DistributedOptimizer``::

    jdist-run --nproc-per-node 3 examples/ports/rpc_pipeline.py [--smoke]

For each micro-batch the master wraps it in an ``RRef``, asks worker1's shard for
``remote().forward(x_rref)`` (the output stays on worker1 as an RRef) and hands that
RRef to worker2's shard (``rpc_async().forward(y_rref)``), which fetches it with
``to_here()``; gradients flow back along the same path. Two small convolutional
shards with BatchNorm stand in for ResNet-50's halves (8 x 8 inputs); the optimizer
is the ``DistributedOptimizer`` of the tutorial's earlier revision (the current one
calls local optimizers' ``step()`` after ``dist_autograd.backward``, whose gradients
live in the context, not in ``.grad``, so it trains nothing).

What a torch user changes: the shards in NNX (channels-last inside, NCHW at the
interface), their layers run as one ``nnx.jit`` program (``run_seq``: the shard's
forward runs under distributed autograd's ``jax.vjp``, op by op unless jitted; the
RPCs stay outside the jit); ``dist_autograd.backward(cid, loss_fn, ...)`` runs the
forward pass; ``parameter_rrefs`` from ``nnx.variables``; ``optax.sgd`` with
``learning_rate=``; ``rpc.wait_all`` for ``torch.futures.wait_all``; the master's
``torch.cat`` and loss jitted too (``concat``, ``mse_of``); the shards'
``forward`` marked ``@dist_autograd.pure``, so each worker records it as one compiled
forward+VJP program (the RRef's value fetched first) instead of tracing it every call.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import load_init, save
from _data import pipeline_batches
from flax import nnx

from jdist import rpc
from jdist.rpc import DistributedOptimizer, RRef, dist_autograd
from jdist.testing import state_dict_to_nnx

num_classes = 10


@nnx.jit
def run_seq(shard, x):
    """A shard's layers as one compiled program (its ``seq``); the RPCs stay outside."""
    return shard.seq(x)


class ShardBase(nnx.Module):
    def __init__(self):
        self._lock = threading.Lock()

    def _load(self, init):
        if init is not None:
            state_dict_to_nnx(init, self)

    def parameter_rrefs(self):
        params = nnx.variables(self, nnx.Param)
        return [RRef(p) for p in jax.tree.leaves(
            params, is_leaf=lambda v: isinstance(v, nnx.Variable))]

    def weights(self):
        return {k: np.asarray(v) for k, v in nnx.state(self, nnx.Param).flat_state()}

    def running_means(self):
        return {k[0]: np.asarray(v) for k, v in nnx.state(self, nnx.BatchStat).flat_state()
                if k[-1] == "mean"}


class Shard1(ShardBase):
    """Conv 3 -> 8, BatchNorm, ReLU, 2x2 max-pool."""

    def __init__(self, init=None):
        super().__init__()
        rngs = nnx.Rngs(1)
        self.conv = nnx.Conv(3, 8, (3, 3), padding=1, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self._load(init)

    def seq(self, x):
        x = jnp.transpose(x, (0, 2, 3, 1))
        out = nnx.max_pool(nnx.relu(self.bn(self.conv(x))), (2, 2), strides=(2, 2))
        return jnp.transpose(out, (0, 3, 1, 2))

    @dist_autograd.pure  # under dist autograd: one compiled forward+VJP program
    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = run_seq(self, x)
        return out


class Shard2(ShardBase):
    """Conv 8 -> 16, BatchNorm, ReLU, global average pool, Linear 16 -> classes."""

    def __init__(self, init=None):
        super().__init__()
        rngs = nnx.Rngs(2)
        self.conv = nnx.Conv(8, 16, (3, 3), padding=1, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.fc = nnx.Linear(16, num_classes, rngs=rngs)
        self._load(init)

    def seq(self, x):
        x = jnp.transpose(x, (0, 2, 3, 1))
        return self.fc(jnp.mean(nnx.relu(self.bn(self.conv(x))), axis=(1, 2)))

    @dist_autograd.pure  # under dist autograd: one compiled forward+VJP program
    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = run_seq(self, x)
        return out


class DistNet:
    """The two shards on ``workers`` and the pipelining over micro-batches."""

    def __init__(self, split_size, workers, inits=(None, None)):
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], Shard1, args=(inits[0],))
        self.p2_rref = rpc.remote(workers[1], Shard2, args=(inits[1],))

    def __call__(self, xs):
        out_futures = []
        for i in range(0, xs.shape[0], self.split_size):
            x_rref = RRef(xs[i:i + self.split_size])
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return concat(rpc.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


@jax.jit
def concat(outputs):
    """``torch.cat`` of the micro-batches' outputs, compiled (a local part)."""
    return jnp.concatenate(outputs)


@jax.jit
def mse_of(outputs, labels):
    """``nn.MSELoss()``, compiled (a local part of the loss function)."""
    return jnp.mean((outputs - labels) ** 2)


def mse(model, inputs, labels):
    return mse_of(model(inputs), labels)


def run_master(args):
    init = load_init(args.init)
    inits = (None, None) if init is None else tuple(
        {k[len(p):]: v for k, v in init.items() if k.startswith(p)} for p in ("p1.", "p2."))
    model = DistNet(args.split_size, ["worker1", "worker2"], inits)
    opt = DistributedOptimizer(optax.sgd, model.parameter_rrefs(), learning_rate=0.05)
    losses, times = [], []
    for i, (inputs, labels) in enumerate(pipeline_batches(args.num_batches,
                                                          args.batch_size)):
        print(f"Processing batch {i}", flush=True)
        t0 = time.perf_counter()
        with dist_autograd.context() as context_id:
            loss = dist_autograd.backward(context_id, mse, model, inputs, labels)
            opt.step(context_id)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"losses": losses, "times": times,
            "p1": model.p1_rref.rpc_sync().weights(),
            "p2": model.p2_rref.rpc_sync().weights(),
            "means": [model.p1_rref.rpc_sync().running_means(),
                      model.p2_rref.rpc_sync().running_means()]}


def run_worker(rank, world_size, args):
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=256, rpc_timeout=300)
    out = None
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
        out = run_master(args)
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    rpc.shutdown()
    return out


def main():
    p = argparse.ArgumentParser(description="pipeline parallelism over RPC")
    p.add_argument("--num-batches", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--split-size", type=int, default=8, help="micro-batch size")
    p.add_argument("--smoke", action="store_true", help="2 batches of 8 in 4 micro-batches")
    p.add_argument("--init", help="initial weights (p1.*, p2.*) as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.num_batches, args.batch_size, args.split_size = 2, 8, 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != 3:
        raise SystemExit(f"rpc_pipeline needs 3 processes (master and two shard workers), got "
                         f"WORLD_SIZE={world_size}; run with jdist-run --nproc-per-node 3")
    out = run_worker(rank, world_size, args)
    if out is not None:
        save(args.out, rank, out)


if __name__ == "__main__":
    main()
