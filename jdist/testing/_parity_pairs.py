"""Losses and optimizers that compute the same thing in torch and in JAX/optax.

The loss is a named loss (:data:`LOSSES`) or a ``(torch_fn, jax_fn)`` pair of
``fn(output, target) -> scalar``; the optimizer is a spec such as ``("sgd", 0.1)`` or
``("adam", 1e-3, (0.9, 0.999), 1e-8)`` (:func:`optimizer_spec`), mapped to
``torch.optim`` and to an optax transformation with the same update rule:

=========  ==========================================  ===================================
name       torch                                       optax
=========  ==========================================  ===================================
``sgd``    ``SGD(lr, momentum, weight_decay=wd,        ``chain(add_decayed_weights(wd),
           nesterov=)``                                sgd(lr, momentum or None, nesterov))``
``adam``   ``Adam(lr, betas, eps, weight_decay=wd)``   ``chain(add_decayed_weights(wd),
                                                       adam(lr, b1, b2, eps, eps_root=0))``
``adamw``  ``AdamW(lr, betas, eps, weight_decay=wd)``  ``adamw(lr, b1, b2, eps,
                                                       weight_decay=wd)``
=========  ==========================================  ===================================

Why these are the same rule: torch's ``Adam`` divides by ``sqrt(v_hat) + eps`` (eps
*outside* the square root), which is optax's ``eps``; optax's ``eps_root`` (inside the
root) must stay 0. torch's ``Adam(weight_decay=wd)`` is an L2 term added to the gradient
before the moments, which is ``add_decayed_weights`` *before* ``adam``; ``AdamW`` decays
the weights by ``lr * wd`` outside the moments, which is ``optax.adamw`` (whose default
``weight_decay`` is 1e-4 where torch's is 1e-2, so always pass it). torch's SGD momentum
buffer starts at the first gradient and optax's trace starts at zero, which gives the
same first step; ``dampening`` other than 0 has no optax equivalent.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import optax

__all__ = ["LOSSES", "OPTIMIZERS", "LossPair", "OptimizerSpec", "loss_pair", "make_optax",
           "make_torch_optimizer", "optimizer_spec", "spec_str"]

#: Named losses (mean over the batch in both frameworks).
LOSSES = ("cross_entropy", "mse")
#: Named optimizers (see the module docstring for the mapping).
OPTIMIZERS = ("sgd", "adam", "adamw")


# ----------------------------------------------------------------------- losses


class LossPair(NamedTuple):
    """A loss in both frameworks: ``torch_fn(out, target)`` and ``jax_fn(out, target)``."""

    name: str
    torch_fn: Callable
    jax_fn: Callable


def _torch_cross_entropy(out, target):
    import torch.nn.functional as F

    return F.cross_entropy(out, target)


def _torch_mse(out, target):
    import torch.nn.functional as F

    return F.mse_loss(out, target)


def _jax_cross_entropy(out, target):
    return optax.softmax_cross_entropy_with_integer_labels(out, target).mean()


def _jax_mse(out, target):
    return jnp.mean((out - target) ** 2)


_NAMED_LOSSES = {
    "cross_entropy": (_torch_cross_entropy, _jax_cross_entropy),
    "mse": (_torch_mse, _jax_mse),
}


def loss_pair(loss: str | tuple | LossPair) -> LossPair:
    """A :class:`LossPair` from a name in :data:`LOSSES` or a ``(torch_fn, jax_fn)`` pair.

    ``"cross_entropy"``: ``F.cross_entropy(logits, int_labels)`` and the mean of
    ``optax.softmax_cross_entropy_with_integer_labels``; ``"mse"``: ``F.mse_loss`` and
    ``mean((out - target) ** 2)``.
    """
    if isinstance(loss, LossPair):
        return loss
    if isinstance(loss, str):
        if loss not in _NAMED_LOSSES:
            raise ValueError(f"unknown loss {loss!r}; use one of {LOSSES} or pass a "
                             f"(torch_fn, jax_fn) pair of fn(output, target) -> scalar")
        return LossPair(loss, *_NAMED_LOSSES[loss])
    if isinstance(loss, tuple) and len(loss) == 2 and all(callable(f) for f in loss):
        name = getattr(loss[1], "__name__", "custom")
        return LossPair(name, loss[0], loss[1])
    raise TypeError(f"loss must be a name in {LOSSES} or a (torch_fn, jax_fn) pair of "
                    f"callables, got {loss!r}")


# -------------------------------------------------------------------- optimizers


class OptimizerSpec(NamedTuple):
    """One optimizer's hyperparameters, meaning the same in torch and optax."""

    name: str
    lr: float
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    nesterov: bool = False


def _number(v, what, spec, lo=0.0, hi=math.inf, lo_open=False):
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    if ok:
        ok = (v > lo if lo_open else v >= lo) and v < hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi})"
        raise ValueError(f"optimizer {what} must be a finite number in {rng}, got {v!r} "
                         f"(in {spec!r})")
    return float(v)


def optimizer_spec(spec: str | tuple | dict | OptimizerSpec) -> OptimizerSpec:
    """Parse an optimizer spec.

    Accepted forms: an :class:`OptimizerSpec`; a tuple ``("sgd", lr[, momentum])``,
    ``("adam", lr[, betas[, eps[, weight_decay]]])`` (same for ``"adamw"``); or a dict
    ``{"name": "adam", "lr": 1e-3, ...}`` with :class:`OptimizerSpec` field names.
    """
    if isinstance(spec, OptimizerSpec):
        fields = spec._asdict()
    elif isinstance(spec, dict):
        unknown = set(spec) - set(OptimizerSpec._fields)
        if unknown or "name" not in spec or "lr" not in spec:
            raise ValueError(f"optimizer dict needs 'name' and 'lr' and only the keys "
                             f"{OptimizerSpec._fields}, got {spec!r}")
        fields = dict(spec)
    elif isinstance(spec, tuple) and spec and isinstance(spec[0], str):
        name, rest = spec[0], spec[1:]
        order = {"sgd": ("lr", "momentum", "weight_decay", "nesterov")}.get(
            name, ("lr", "betas", "eps", "weight_decay"))
        if not rest or len(rest) > len(order):
            raise ValueError(f"optimizer tuple {spec!r} must be (name, {', '.join(order)}) "
                             f"with at least lr; e.g. ('sgd', 0.1) or ('adam', 1e-3)")
        fields = {"name": name, **dict(zip(order, rest, strict=False))}
    else:
        raise TypeError(f"optimizer must be a tuple like ('sgd', 0.1), a dict or an "
                        f"OptimizerSpec, got {spec!r}")
    name = fields.get("name")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")
    out = OptimizerSpec(**fields)
    betas = tuple(out.betas) if isinstance(out.betas, (tuple, list)) else None
    if betas is None or len(betas) != 2:
        raise ValueError(f"optimizer betas must be a pair (b1, b2), got {out.betas!r}")
    return out._replace(
        lr=_number(out.lr, "lr", spec),
        momentum=_number(out.momentum, "momentum", spec, 0.0, 1.0),
        betas=tuple(_number(b, "beta", spec, 0.0, 1.0) for b in betas),
        eps=_number(out.eps, "eps", spec),
        weight_decay=_number(out.weight_decay, "weight_decay", spec),
        nesterov=bool(out.nesterov))


def make_optax(spec) -> optax.GradientTransformation:
    """The optax transformation with the update rule of :func:`make_torch_optimizer`.

    Equal specs give the same (stateless) transformation object, so an
    ``nnx.Optimizer`` built from it keeps a jitted step's cache warm.
    """
    return _make_optax(optimizer_spec(spec))


@functools.lru_cache(maxsize=64)
def _make_optax(s: OptimizerSpec) -> optax.GradientTransformation:
    if s.name == "sgd":
        if s.nesterov and s.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (torch's rule)")
        tx = optax.sgd(s.lr, momentum=s.momentum or None, nesterov=s.nesterov)
    elif s.name == "adam":
        tx = optax.adam(s.lr, b1=s.betas[0], b2=s.betas[1], eps=s.eps, eps_root=0.0)
    else:
        return optax.adamw(s.lr, b1=s.betas[0], b2=s.betas[1], eps=s.eps, eps_root=0.0,
                           weight_decay=s.weight_decay)
    if s.weight_decay:
        tx = optax.chain(optax.add_decayed_weights(s.weight_decay), tx)
    return tx


def make_torch_optimizer(spec, params):
    """The ``torch.optim`` optimizer for ``spec`` over ``params``."""
    import torch

    s = optimizer_spec(spec)
    if s.name == "sgd":
        return torch.optim.SGD(params, lr=s.lr, momentum=s.momentum,
                               weight_decay=s.weight_decay, nesterov=s.nesterov)
    cls = torch.optim.Adam if s.name == "adam" else torch.optim.AdamW
    return cls(params, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)


def spec_str(s: OptimizerSpec) -> str:
    extra = []
    if s.name == "sgd":
        if s.momentum:
            extra.append(f"momentum={s.momentum:g}")
        if s.nesterov:
            extra.append("nesterov")
    else:
        extra.append(f"betas=({s.betas[0]:g}, {s.betas[1]:g}), eps={s.eps:g}")
    if s.weight_decay:
        extra.append(f"wd={s.weight_decay:g}")
    return f"{s.name}(lr={s.lr:g}{', ' if extra else ''}{', '.join(extra)})"

