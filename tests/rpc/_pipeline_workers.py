"""Code run in real processes by ``test_pipeline_grad.py``: pytorch/examples'
``distributed/rpc/pipeline`` pattern with dropout, trained under distributed autograd.

The master wraps each micro-batch in ``RRef(x)``, calls ``p1.remote().forward(x_rref)``
and hands the resulting RRef to worker 2 (``p2.rpc_async().forward(y_rref)``), which
calls ``to_here()`` on it: shard 1's gradient has to travel back through that hand-off.
Shard 2 has a dropout layer, whose RNG state must advance on every forward.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdist.rpc import (
    DistributedOptimizer,
    RRef,
    dist_autograd,
    init_rpc,
    remote,
    rpc_sync,
    shutdown,
    wait_all,
)
from jdist.rpc.autograd._params import param_variables

IN, HID, OUT, BATCH, SPLITS, STEPS, LR = 4, 6, 3, 6, 2, 3, 0.1
X = np.linspace(-1.0, 1.0, BATCH * IN, dtype=np.float32).reshape(BATCH, IN)
Y = np.cos(np.arange(BATCH * OUT, dtype=np.float32)).reshape(BATCH, OUT)


class Shard1(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(IN, HID, rngs=nnx.Rngs(0))

    def forward(self, x_rref):
        return jnp.tanh(self.lin(jnp.asarray(x_rref.to_here())))


class Shard2(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(HID, OUT, rngs=nnx.Rngs(1))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))

    def forward(self, y_rref):
        return self.lin(self.drop(y_rref.to_here()))


def param_rrefs(module_rref):
    """Owner side: one RRef per parameter (what torch's ``module.parameters()`` gives)."""
    return [RRef(v) for v in param_variables(module_rref.local_value())]


def params_np(module_rref):
    return [np.asarray(v.get_value()) for v in param_variables(module_rref.local_value())]


def reference(frozen_masks: bool = False) -> dict:
    """The same training, in one process with plain nnx/jax (same seeds and keys);
    ``frozen_masks``: the dropout RNG reset before every step (the old bug's result)."""
    s1, s2 = Shard1(), Shard2()

    def loss_fn(s1, s2):
        outs = [s2.lin(s2.drop(jnp.tanh(s1.lin(jnp.asarray(xc)))))
                for xc in np.split(X, SPLITS)]
        z = jnp.concatenate(outs)
        return jnp.sum((z - Y) ** 2), z

    @nnx.jit  # one compiled step (eager ops would each compile on first use)
    def step(s1, s2):
        (loss, z), (g1, g2) = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(s1, s2)
        for m, g in ((s1, g1), (s2, g2)):
            nnx.update(m, jax.tree.map(lambda p, d: p - LR * d, nnx.state(m, nnx.Param), g))
        return loss, z

    losses, zs = [], []
    for _ in range(STEPS):
        if frozen_masks:  # a fresh dropout RNG (count 0) with the current parameters
            params, s2 = nnx.state(s2, nnx.Param), Shard2()
            nnx.update(s2, params)
        loss, z = step(s1, s2)
        losses.append(float(loss))
        zs.append(np.asarray(z))
    return {"losses": losses, "z": zs,
            "p1": [np.asarray(v.get_value()) for v in param_variables(s1)],
            "p2": [np.asarray(v.get_value()) for v in param_variables(s2)]}


def run() -> dict:
    rank = int(os.environ["RANK"])
    init_rpc(["master", "worker1", "worker2"][rank], rank=rank, world_size=3)
    out: dict = {}
    if rank == 0:
        p1 = remote("worker1", Shard1)
        p2 = remote("worker2", Shard2)
        opt = DistributedOptimizer(
            optax.sgd, rpc_sync("worker1", param_rrefs, (p1,))
            + rpc_sync("worker2", param_rrefs, (p2,)), learning_rate=LR)

        def loss_fn():
            futs = []
            for xc in np.split(X, SPLITS):
                x_rref = RRef(xc)
                y_rref = p1.remote().forward(x_rref)
                futs.append(p2.rpc_async().forward(y_rref))
            z = jnp.concatenate(wait_all(futs))
            return jnp.sum((z - Y) ** 2), z

        losses, zs = [], []
        for _ in range(STEPS):
            with dist_autograd.context() as cid:
                loss, z = dist_autograd.backward(cid, loss_fn, has_aux=True)
                grads = rpc_sync("worker1", grads_nonempty, (cid,))
                opt.step(cid)
            losses.append(float(loss))
            zs.append(np.asarray(z))
        out = {"losses": losses, "z": zs, "p1": rpc_sync("worker1", params_np, (p1,)),
               "p2": rpc_sync("worker2", params_np, (p2,)), "grads_nonempty": grads}
    shutdown()
    return out


def grads_nonempty(cid):
    """On a worker: its gradients in context ``cid`` exist, and ``!= {}`` works."""
    g = dist_autograd.get_gradients(cid)
    return (g != {}, len(g))
