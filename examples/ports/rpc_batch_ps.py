"""pytorch/examples ``distributed/rpc/batch/parameter_server.py`` in jdist.

A batch-updating parameter server: each trainer computes gradients locally and sends
them with ``rpc_sync`` to ``update_and_fetch_model``, an ``@async_execution`` static
method that returns a future; once ``batch_update_size`` trainers reported, the server
averages the gradients, runs one SGD (momentum) step and completes the future with the
new model for all of them::

    python examples/ports/rpc_batch_ps.py [--batch-update-size 5] [--smoke]
    jdist-run --nproc-per-node 3 examples/ports/rpc_batch_ps.py [--smoke]

The first starts ``batch_update_size + 1`` processes with ``jdist.launch.spawn``, as
the original does with ``mp.spawn``; under ``jdist-run`` the processes are the
launcher's (``batch_update_size`` = processes - 1). A small CNN on 3 x 8 x 8 inputs stands in for
the original's ResNet-50 on 64 x 64. What a torch user changes: the model in NNX; the
gradients are a list of arrays from ``nnx.grad`` (no ``.grad`` fields, so the server
keeps its own accumulators); ``nnx.Optimizer`` applies the averaged gradients, in one
``nnx.jit`` program with the zeroing;
``jdist.rpc.Future`` for ``torch.futures.Future``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from datetime import datetime

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import load_init, save
from _data import batch_ps_trainer_data
from flax import nnx

import jdist
from jdist import rpc
from jdist.launch import spawn
from jdist.testing import state_dict_to_nnx

num_classes = 10
_ARGS: dict = {}


def timed_log(text):
    print(f"{datetime.now().strftime('%H:%M:%S')} {text}", flush=True)


class Model(nnx.Module):
    """Conv 3 -> 8 (3x3, padding 1), ReLU, Linear 512 -> num_classes (NCHW inputs)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), padding=1, rngs=rngs)
        self.fc = nnx.Linear(8 * 8 * 8, num_classes, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.conv(jnp.transpose(x, (0, 2, 3, 1))))
        return self.fc(jnp.transpose(h, (0, 3, 1, 2)).reshape(x.shape[0], -1))


def params_of(model) -> list:
    """The model's parameter arrays in a fixed order (torch's ``model.parameters()``)."""
    return jax.tree.leaves(nnx.state(model, nnx.Param))


@nnx.jit
def step_and_zero(optimizer, model, grads, n):
    """torch's ``p.grad /= n``, ``optimizer.step()`` and ``zero_grad()`` as one compiled
    program (eager, optax's update is a few dozen small ops); returns the zeroed
    accumulators."""
    state = nnx.state(model, nnx.Param)
    optimizer.update(model, jax.tree.unflatten(jax.tree.structure(state),
                                               [g / n for g in grads]))
    return [jnp.zeros_like(g) for g in grads]


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size, init=None):
        self.model = Model(nnx.Rngs(0))
        if init is not None:
            state_dict_to_nnx(init, self.model)
        self.lock = threading.Lock()
        self.future_model = rpc.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = nnx.Optimizer(self.model, optax.sgd(0.001, momentum=0.9),
                                       wrt=nnx.Param)
        self.grads = [jnp.zeros_like(p) for p in params_of(self.model)]

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        timed_log(f"PS got {self.curr_update_size}/{self.batch_update_size} updates")
        with self.lock:
            self.grads = [acc + g for acc, g in zip(self.grads, grads, strict=True)]
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                self.grads = step_and_zero(self.optimizer, self.model, self.grads,
                                           self.batch_update_size)
                self.curr_update_size = 0
                fut.set_result(self.model)
                timed_log("PS updated model")
                self.future_model = rpc.Future()
        return fut

    def get_weights(self):
        return {k: np.asarray(v) for k, v in nnx.state(self.model, nnx.Param).flat_state()}


def mse(model, inputs, labels):
    return jnp.mean((model(inputs) - labels) ** 2)


grad_fn = nnx.jit(nnx.value_and_grad(mse))


class Trainer:
    def __init__(self, ps_rref, num_batches):
        self.ps_rref = ps_rref
        self.rank = jdist.get_rank()
        self.num_batches = num_batches

    def get_next_batch(self):
        yield from batch_ps_trainer_data(self.rank, self.num_batches)

    def train(self):
        name = rpc.get_worker_info().name
        m = self.ps_rref.rpc_sync().get_model()
        losses, times = [], []
        for inputs, labels in self.get_next_batch():
            timed_log(f"{name} processing one batch")
            t0 = time.perf_counter()
            loss, grads = grad_fn(m, inputs, labels)
            timed_log(f"{name} reporting grads")
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, jax.tree.leaves(grads)),
            )
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
            timed_log(f"{name} got updated model")
        return {"losses": losses, "times": times}


def run_trainer(ps_rref, num_batches):
    return Trainer(ps_rref, num_batches).train()


def run_ps(trainers, args):
    timed_log("Start training")
    ps = BatchUpdateParameterServer(len(trainers), load_init(args.init))
    ps_rref = rpc.RRef(ps)
    futs = [rpc.rpc_async(trainer, run_trainer, args=(ps_rref, args.num_batches))
            for trainer in trainers]
    results = rpc.wait_all(futs)
    timed_log("Finish training")
    return {"trainers": results, "params": ps.get_weights()}


def run(rank, world_size, args):
    jdist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    out = None
    if rank != 0:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        out = run_ps([f"trainer{r}" for r in range(1, world_size)], args)
    rpc.shutdown()
    jdist.destroy_process_group()
    return out


def run_and_save(rank, world_size, args):
    out = run(rank, world_size, args)
    if out is not None:
        save(args.out, rank, out)


def main():
    p = argparse.ArgumentParser(description="batch-updating parameter server")
    p.add_argument("--num-batches", type=int, default=6)
    p.add_argument("--batch-update-size", type=int, default=5, help="trainers (spawn)")
    p.add_argument("--smoke", action="store_true", help="3 batches per trainer")
    p.add_argument("--init", help="initial weights: a torch state dict as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.num_batches = 3
    if "RANK" in os.environ:  # started by jdist-run
        run_and_save(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:  # as the original's mp.spawn(run, args=(world_size,), nprocs=world_size)
        world_size = args.batch_update_size + 1
        spawn(run_and_save, args=(world_size, args), nprocs=world_size, pass_rank=True)


if __name__ == "__main__":
    main()
