"""Workers of test_plain_holder_mp: a parameter server that is a plain Python class
holding NNX modules (not an nnx.Module), and torch's gradient-map idioms on it.

Module-level functions only: the ranks unpickle them by name.
"""

from __future__ import annotations

import numpy as np

X = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
LR = 0.1


class PlainServer:
    """torch's ParameterServer pattern, but a plain class (torch's works either way)."""

    def __init__(self):
        from flax import nnx

        self.model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.layers = [nnx.Linear(2, 2, rngs=nnx.Rngs(1)), self.model]  # shared module
        self.scale = nnx.Param(np.float32(1.5))
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # rebinding an attribute: seen on the server afterwards
        return self.layers[0](self.layers[1](x)) * self.scale[...]


def weights(server):
    return (np.asarray(server.model.kernel[...]), np.asarray(server.model.bias[...]),
            np.asarray(server.layers[0].kernel[...]), np.asarray(server.layers[0].bias[...]),
            np.asarray(server.scale[...]))


def reference_grads(w):
    """jax.grad of the same loss in this process, from the server's weights ``w``."""
    import jax
    import jax.numpy as jnp

    def loss(k1, b1, k2, b2, s):
        return jnp.sum(((X @ k1 + b1) @ k2 + b2) * s) ** 2 / 10

    return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*w)]


def call_forward(server_rref, x):
    return server_rref.local_value().forward(x)


def get_weights(server_rref):
    return weights(server_rref.local_value())


def param_rrefs(server_rref):
    from jdist.rpc import RRef

    s = server_rref.local_value()
    return [RRef(s.model), RRef(s.layers[0]), RRef(s.scale)]


def gradient_idioms(server_rref, cid):
    """torch's ways with get_gradients' result, on the parameters' owner."""
    from jdist.rpc import dist_autograd

    s = server_rref.local_value()
    grads = dist_autograd.get_gradients(cid)
    copied = {k: np.asarray(v) for k, v in grads.items()}  # torch's get_dist_gradients
    plain = dict(grads)
    k = s.model.kernel
    return {
        "nonempty": grads != {},
        "count": len(grads),
        "copied_kernel": copied[dist_autograd.ParamKey(k)],
        "plain_kernel": np.asarray(plain[dist_autograd.ParamKey(k)]),
        "by_param": [np.asarray(grads[v]) for v in (s.model.kernel, s.model.bias,
                                                    s.layers[0].kernel, s.layers[0].bias,
                                                    s.scale)],
        "keys_equal_params": all(any(key == v for key in grads)
                                 for v in (s.model.kernel, s.scale)),
        "calls": s.calls,
    }


def run() -> dict | None:
    import os

    import jax.numpy as jnp
    import optax

    from jdist import rpc
    from jdist.rpc import DistributedOptimizer, dist_autograd

    rank = int(os.environ["RANK"])
    opts = rpc.RpcBackendOptions(rpc_timeout=120)
    if rank == 0:
        rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=opts)
        rpc.shutdown()
        return None
    rpc.init_rpc("trainer", rank=1, world_size=2, rpc_backend_options=opts)
    server = rpc.remote("ps", PlainServer)
    before = rpc.rpc_sync("ps", get_weights, (server,))
    opt = DistributedOptimizer(optax.sgd, rpc.rpc_sync("ps", param_rrefs, (server,)),
                               learning_rate=LR)

    def loss_fn(x):
        return jnp.sum(rpc.rpc_sync("ps", call_forward, (server, x))) ** 2 / 10

    with dist_autograd.context() as cid:
        loss = dist_autograd.backward(cid, loss_fn, X)
        idioms = rpc.rpc_sync("ps", gradient_idioms, (server, cid))
        opt.step(cid)
    after = rpc.rpc_sync("ps", get_weights, (server,))
    rpc.shutdown()
    return {"loss": float(loss), "before": before, "after": after, "idioms": idioms}
