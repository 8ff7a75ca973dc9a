"""Small NNX models and reference (single-device, full-batch) training for DDP tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, sizes=(16, 32, 32, 4), *, rngs):
        pairs = zip(sizes, sizes[1:], strict=False)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in pairs])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jnp.tanh(x)
        return x


class Stack(nnx.Module):
    """n x Linear(d, d) in sequence (torch's bucket-layout example)."""

    def __init__(self, n=8, d=500, *, rngs):
        self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(n)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def data(n=64, din=16, dout=4, seed=0):
    rng = np.random.RandomState(seed)
    return {"x": rng.randn(n, din).astype(np.float32), "y": rng.randn(n, dout).astype(np.float32)}


def reference_train(model, tx, batches, loss_fn=mse):
    """Plain full-batch training on one device; returns the losses."""
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(m, o, b):
        loss, grads = nnx.value_and_grad(loss_fn)(m, b)
        o.update(m, grads)
        return loss

    return [float(step(model, opt, b)) for b in batches]


def max_diff(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(la, lb, strict=True))
