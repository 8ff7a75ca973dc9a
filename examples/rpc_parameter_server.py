"""A parameter server and two trainers with RPC, distributed autograd and
DistributedOptimizer (torch's "Implementing a Parameter Server Using Distributed RPC
Framework" tutorial, in JAX)::

    jdist-run --nproc-per-node 3 examples/rpc_parameter_server.py [--steps 100] [--smoke]

Rank 0 (``ps``) holds the model: one :class:`ParameterServer` NNX module shared by
every trainer (made once, under a lock, like the tutorial's ``get_parameter_server``).
Ranks 1 and 2 train it on their own shards of a synthetic classification problem::

    ps = rpc.remote("ps", get_parameter_server)          # RRef to the shared server
    opt = DistributedOptimizer(optax.sgd, ps.rpc_sync().parameter_rrefs(), ...)
    with dist_autograd.context() as cid:
        loss = dist_autograd.backward(cid, batch_loss, ps, x, y)   # forward by RPC
        opt.step(cid)                                   # updates the model on ps

Inside ``batch_loss`` the call ``ps.rpc_sync().forward(x)`` is differentiable: the
server keeps the VJP of its forward pass in the context, the backward pass sends the
cotangent of the logits back to it, and the gradients of the model wait in the context
on the server until ``opt.step`` applies them. The two trainers update the same model
without coordination (asynchronous SGD, as in torch): their numbers depend on timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdist import rpc
from jdist.rpc import DistributedOptimizer, dist_autograd

IN, HIDDEN, CLASSES = 20, 32, 4
_LOCK = threading.Lock()
_SERVER: list = []


class ParameterServer(nnx.Module):
    """The model living on the parameter server (a two-layer MLP)."""

    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def forward(self, x):
        return self.l2(jnp.tanh(self.l1(jnp.asarray(x))))

    def parameter_rrefs(self) -> list:
        """One RRef per parameter (for the trainers' DistributedOptimizer)."""
        variables = nnx.variables(self, nnx.Param)
        leaves = jax.tree.leaves(variables, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return [rpc.RRef(v) for v in leaves]


def get_parameter_server(seed: int = 0) -> ParameterServer:
    """The one server of this process (made by the first trainer that asks)."""
    with _LOCK:
        if not _SERVER:
            _SERVER.append(ParameterServer(seed))
        return _SERVER[0]


def dataset(seed: int = 0, n: int = 4096):
    """A synthetic problem: labels from a fixed random linear teacher."""
    rs = np.random.RandomState(seed)
    teacher = rs.randn(IN, CLASSES).astype(np.float32)
    x = rs.randn(n, IN).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int32)


def batch_loss(ps, x, y):
    """Cross-entropy of the server's model on (x, y); the forward pass is an RPC."""
    logits = ps.rpc_sync().forward(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(ps, x, y) -> float:
    return float(np.mean(np.argmax(np.asarray(ps.rpc_sync().forward(x)), axis=1) == y))


def run_trainer(rank: int, cfg: dict) -> dict:
    """One trainer's loop; returns its losses and the accuracy before and after."""
    ps = rpc.remote("ps", get_parameter_server)
    opt = DistributedOptimizer(optax.sgd, ps.rpc_sync().parameter_rrefs(),
                               learning_rate=cfg["lr"])
    x, y = dataset()
    n_eval = 512
    x_eval, y_eval = x[:n_eval], y[:n_eval]
    shard = slice(n_eval + (rank - 1) * (len(x) - n_eval) // 2,
                  n_eval + rank * (len(x) - n_eval) // 2)
    xs, ys = x[shard], y[shard]
    before = accuracy(ps, x_eval, y_eval)
    rs = np.random.RandomState(rank)
    losses = []
    for _ in range(cfg["steps"]):
        i = rs.randint(0, len(xs), cfg["batch"])
        with dist_autograd.context() as cid:
            loss = dist_autograd.backward(cid, batch_loss, ps, xs[i], ys[i])
            opt.step(cid)
        losses.append(float(loss))
    return {"losses": losses, "acc_before": before, "acc_after": accuracy(ps, x_eval, y_eval)}


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--smoke", action="store_true", help="30 steps (used by the tests)")
    cfg = vars(p.parse_args(argv))
    if cfg.pop("smoke"):
        cfg["steps"] = 30
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 3:
        raise SystemExit(f"rpc_parameter_server needs 3 processes (a server and two trainers), "
                         f"got WORLD_SIZE={world}; run with --nproc-per-node 3")
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=120))
    out = None
    if rank == 0:
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer, (r, cfg), timeout=0) for r in (1, 2)]
        out = {f"trainer{r}": f.wait() for r, f in zip((1, 2), futs, strict=True)}
        for who, res in out.items():
            print(f"{who}: loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}, "
                  f"accuracy {res['acc_before']:.2f} -> {res['acc_after']:.2f}", flush=True)
    rpc.shutdown()
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
