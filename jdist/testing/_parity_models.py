"""A torch-compatible BatchNorm for NNX and the parity harness's built-in model pairs.

Each example is a torch model and its NNX port with the same layers in the same order
(torch's ``nn.Sequential``, so nothing torch-specific is defined at import time), plus
synthetic data and the matching loss. ``python -m jdist.testing.parity`` runs them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["EXAMPLES", "Example", "TorchBatchNorm", "build_nnx_model", "build_torch_model",
           "example", "example_data"]

#: Names of the built-in model pairs.
EXAMPLES = ("mlp", "cnn", "embedding")


class TorchBatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` that updates its running variance as torch does.

    In training mode torch folds the *unbiased* batch variance (times ``n / (n - 1)``,
    ``n`` = elements per feature over the whole group when synchronized) into
    ``running_var``; ``nnx.BatchNorm`` folds the biased one. The output is normalised with
    the biased variance in both. Everything else (arguments, eval mode, ``axis_name`` for
    synchronized statistics) is ``nnx.BatchNorm``'s. Remember torch's momentum is the
    weight of the new batch: ``TorchBatchNorm(c, momentum=0.9)`` matches torch's 0.1.

    Example::

      bn = TorchBatchNorm(8, momentum=0.9, epsilon=1e-5, rngs=nnx.Rngs(0))
      y = bn(x_nhwc)          # running var updated with the unbiased variance
    """

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        use_ra = self.use_running_average if use_running_average is None \
            else use_running_average
        if use_ra:
            return super().__call__(x, True, mask=mask)
        if mask is not None:
            raise ValueError("TorchBatchNorm does not take mask= (torch has no masked "
                             "BatchNorm); use nnx.BatchNorm for masked statistics")
        if not isinstance(self.axis, int):
            raise ValueError(f"TorchBatchNorm normalises over one feature axis, got "
                             f"axis={self.axis!r}")
        feat = self.axis % x.ndim
        red = tuple(i for i in range(x.ndim) if i != feat)
        shape = tuple(x.shape[i] if i == feat else 1 for i in range(x.ndim))
        xf = x.astype(jnp.promote_types(self.dtype or x.dtype, jnp.float32))
        n = math.prod(x.shape[i] for i in red)
        mean = xf.mean(red)
        if self.axis_name is not None:
            mean = jax.lax.pmean(mean, self.axis_name)
            n = n * jax.lax.psum(1, self.axis_name)
        dev = xf - mean.reshape(shape)
        var = (dev * dev).mean(red)
        if self.axis_name is not None:
            var = jax.lax.pmean(var, self.axis_name)
        m = self.momentum
        unbiased = var * (n / jnp.maximum(n - 1, 1))
        self.mean[...] = jax.lax.stop_gradient(m * self.mean[...] + (1 - m) * mean)
        self.var[...] = jax.lax.stop_gradient(m * self.var[...] + (1 - m) * unbiased)
        y = dev * jax.lax.rsqrt(var + self.epsilon).reshape(shape)
        if self.scale is not None:
            y = y * self.scale[...].reshape(shape)
        if self.bias is not None:
            y = y + self.bias[...].reshape(shape)
        return y.astype(self.dtype or x.dtype)


# ------------------------------------------------------------------- NNX models


class MLP(nnx.Module):
    """Linear(10, 16) - tanh - Linear(16, 16) - tanh - Linear(16, 3)."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(10, 16, rngs=rngs)
        self.fc2 = nnx.Linear(16, 16, rngs=rngs)
        self.fc3 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc3(jnp.tanh(self.fc2(jnp.tanh(self.fc1(x)))))


class CNN(nnx.Module):
    """Conv - BatchNorm (torch's running variance) - ReLU - strided Conv - ReLU - mean
    over space - Linear. Channels last (NHWC); torch's twin takes NCHW.

    The first conv has no bias, as usual before a BatchNorm: that bias gets a gradient
    of (numerically) zero, which Adam would blow up into rounding noise of size ``lr``.
    """

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), padding=1, use_bias=False, rngs=rngs)
        self.bn = TorchBatchNorm(8, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), strides=2, padding=1, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x_nhwc):
        h = nnx.relu(self.bn(self.conv1(x_nhwc)))
        h = nnx.relu(self.conv2(h))
        return self.head(h.mean(axis=(1, 2)))


class EmbeddingModel(nnx.Module):
    """Embed(20, 8) - LayerNorm - flatten (6 tokens) - Linear(48, 5)."""

    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(20, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Linear(6 * 8, 5, rngs=rngs)

    def __call__(self, ids):
        h = self.norm(self.emb(ids))
        return self.head(h.reshape(h.shape[0], -1))


_NNX = {"mlp": MLP, "cnn": CNN, "embedding": EmbeddingModel}


def _check_name(name: str) -> str:
    if name not in EXAMPLES:
        raise ValueError(f"unknown example model {name!r}; use one of {EXAMPLES}")
    return name


def build_nnx_model(name: str, seed: int = 0) -> nnx.Module:
    """The NNX model of example ``name`` (weights are overwritten by the harness)."""
    return _NNX[_check_name(name)](nnx.Rngs(seed))


def build_torch_model(name: str, seed: int = 0):
    """The torch model of example ``name``, initialised from ``torch.manual_seed(seed)``."""
    import torch
    from torch import nn

    _check_name(name)
    torch.manual_seed(seed)
    if name == "mlp":
        return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 3))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False),
                             nn.BatchNorm2d(8, momentum=0.1), nn.ReLU(),
                             nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    return nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Flatten(),
                         nn.Linear(6 * 8, 5))


def example_data(name: str, n: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic ``(inputs, targets)`` for example ``name`` (inputs in torch's layout)."""
    rng = np.random.default_rng(seed)
    if _check_name(name) == "mlp":
        return (rng.standard_normal((n, 10)).astype(np.float32),
                rng.standard_normal((n, 3)).astype(np.float32))
    if name == "cnn":
        return (rng.standard_normal((n, 3, 8, 8)).astype(np.float32),
                rng.integers(0, 10, n))
    return rng.integers(0, 20, (n, 6)), rng.integers(0, 5, n)


class Example(NamedTuple):
    """Everything :func:`~jdist.testing.run_parity` needs for one built-in pair."""

    name: str
    torch_model: Any
    nnx_model: nnx.Module
    loss: str
    data: tuple[np.ndarray, np.ndarray]
    jax_input: str | None


_LOSS = {"mlp": "mse", "cnn": "cross_entropy", "embedding": "cross_entropy"}


def example(name: str, seed: int = 0, n: int = 64) -> Example:
    """Build example ``name``: ``run_parity(*example(...)[1:4], optimizer,
    jax_input=ex.jax_input)``."""
    return Example(name, build_torch_model(name, seed), build_nnx_model(name, seed),
                   _LOSS[_check_name(name)], example_data(name, n, seed),
                   "channels_last" if name == "cnn" else None)
