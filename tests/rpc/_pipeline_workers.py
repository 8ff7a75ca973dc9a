"""Code run in real processes by ``test_pipeline_grad.py``: pytorch/examples'
``distributed/rpc/pipeline`` pattern with dropout, trained under distributed autograd.

The master wraps each micro-batch in ``RRef(x)``, calls ``p1.remote().forward(x_rref)``
and hands the resulting RRef to worker 2 (``p2.rpc_async().forward(y_rref)``), which
calls ``to_here()`` on it: shard 1's gradient has to travel back through that hand-off.
Shard 2 has a dropout layer, whose RNG state must advance on every forward.
"""

from __future__ import annotations

import os
import tempfile
import time

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
    rpc_async,
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
        out = train(remote("worker1", Shard1), remote("worker2", Shard2))
        pure = train(remote("worker1", PureShard1), remote("worker2", PureShard2))
        out["pure"] = {k: pure[k] for k in ("losses", "z", "p1", "p2")}
        out["pure_traces"] = [rpc_sync(w, traces) for w in ("worker1", "worker2")]
        out.update(started_calls_checks())
    shutdown()
    return out


class PureShard1(Shard1):
    @dist_autograd.pure  # one compiled program; the RRef's value fetched first
    def forward(self, x_rref):
        return jnp.tanh(self.lin(jnp.asarray(x_rref.to_here())))


class PureShard2(Shard2):
    @dist_autograd.pure
    def forward(self, y_rref):
        return self.lin(self.drop(y_rref.to_here()))


def traces():
    from jdist.rpc.autograd._compiled import TRACES

    return dict(TRACES)


def train(p1, p2) -> dict:
    """The pipeline's training on the master (shards ``p1``, ``p2``)."""
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
    return {"losses": losses, "z": zs, "p1": rpc_sync("worker1", params_np, (p1,)),
            "p2": rpc_sync("worker2", params_np, (p2,)), "grads_nonempty": grads}


# ---- differentiable calls started before any is waited on (master side)
def started_calls_checks() -> dict:
    """Calls started by a loss function run at once (two workers overlap), calls to one
    worker are recorded in the order made, gradients are right, and an error of a
    call the loss function never waited on is raised by the backward pass."""
    out: dict = {}
    w_rref = remote("worker1", Weight)
    marker = os.path.join(tempfile.mkdtemp(prefix="jdist_overlap_"), "worker2_started")
    xs = [np.full(3, k + 1.0, np.float32) for k in range(4)]

    def overlap_loss():
        a = rpc_async("worker1", wait_for_file, (w_rref, marker, xs[0]))
        b = rpc_async("worker2", touch_file, (marker, xs[1]))
        va, vb = a.wait(), b.wait()
        return jnp.sum(va[0]) + jnp.sum(vb), va[1]

    with dist_autograd.context() as cid:
        _, saw = dist_autograd.backward(cid, overlap_loss, has_aux=True)
        out["overlap_saw_marker"] = bool(saw)
        out["overlap_grad"] = rpc_sync("worker1", weight_grad, (w_rref, cid))

    def ordered_loss():
        futs = [rpc_async("worker1", scaled_in_order, (w_rref, k, xs[k])) for k in range(4)]
        return sum(jnp.sum(f.wait()) for f in futs)

    rpc_sync("worker1", reset_order)
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, ordered_loss)
        out["order_grad"] = rpc_sync("worker1", weight_grad, (w_rref, cid))
    out["order"] = rpc_sync("worker1", get_order)

    def unwaited_failure():
        rpc_async("worker2", fail_later, (xs[0],))  # never waited on
        return jnp.sum(rpc_sync("worker1", scaled_in_order, (w_rref, 9, xs[0])))

    try:
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, unwaited_failure)
        out["unwaited_error"] = None
    except Exception as e:  # noqa: BLE001 - what the test checks
        out["unwaited_error"] = f"{type(e).__name__}: {e}"
    return out


class Weight(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([1.0, 2.0, 3.0], jnp.float32))


ORDER: list = []


def wait_for_file(w_rref, path, x):
    """Waits (up to 20 s) until worker 2's call has started: only calls running at
    the same time see the file."""
    for _ in range(400):
        if os.path.exists(path):
            break
        time.sleep(0.05)
    return w_rref.local_value().w * x, jnp.asarray(os.path.exists(path))


def touch_file(path, x):
    with open(path, "w"):
        pass
    return jnp.asarray(x) * 2.0


def scaled_in_order(w_rref, k, x):
    time.sleep(0.05 * (3 - k) if k < 4 else 0)  # later calls would finish first
    ORDER.append(k)
    return w_rref.local_value().w * x


def reset_order():
    ORDER.clear()


def get_order():
    return list(ORDER)


def fail_later(x):
    time.sleep(0.2)
    raise ValueError("fail_later: this call fails after the loss function returned")


def weight_grad(w_rref, cid):
    g = dist_autograd.get_gradients(cid)
    return np.asarray(g[w_rref.local_value().w])


def grads_nonempty(cid):
    """On a worker: its gradients in context ``cid`` exist, and ``!= {}`` works."""
    g = dist_autograd.get_gradients(cid)
    return (g != {}, len(g))
