"""One parity run's validated inputs and what both runners share (no runner here).

:class:`Case` is what :func:`~jdist.testing.run_parity` was given, normalised by
:func:`make_case`; :func:`batch_schedule` orders the data as a ``DistributedSampler`` does.
The single-process runner (:mod:`jdist.testing._parity`) and the multi-process one
(:mod:`jdist.testing._parity_ddp`) both build on this module and on nothing of each other.

torch is imported inside the functions that use it, never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.testing._parity_pairs import LossPair, OptimizerSpec, loss_pair, optimizer_spec, spec_str

__all__ = ["Case", "as_jax", "as_torch", "batch_schedule", "check_models", "input_transform",
           "jax_schedule", "make_case", "set_train"]

# ----------------------------------------------------------------------- batches


def batch_schedule(n: int, steps: int, batch_size: int | None, *, shuffle: bool = False,
                   seed: int = 0, num_replicas: int = 1, rank: int = 0,
                   drop_last: bool = False, source: str = "torch") -> list[np.ndarray]:
    """Each step's sample indices for one process, epoch after epoch.

    An epoch's indices come from a ``DistributedSampler(n, num_replicas, rank, shuffle,
    seed, drop_last)`` with ``set_epoch(epoch)`` (``source="torch"``: torch's,
    ``source="jdist"``: :class:`jdist.sampler.DistributedSampler`, index for index the
    same) and are cut into consecutive batches of ``batch_size`` (the last one may be
    smaller, as a ``DataLoader`` gives it); ``batch_size=None`` takes the whole share.
    """
    if source == "torch":
        from torch.utils.data import DistributedSampler
    elif source == "jdist":
        from jdist.sampler import DistributedSampler
    else:
        raise ValueError(f"source must be 'torch' or 'jdist', got {source!r}")
    dataset = range(n)
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        idx = np.fromiter((int(i) for i in sampler), dtype=np.int64)
        if idx.size == 0:
            raise ValueError(f"process {rank} of {num_replicas} gets no samples from a "
                             f"dataset of {n}; use more data or fewer processes")
        bs = idx.size if batch_size is None else batch_size
        out += [idx[i:i + bs] for i in range(0, idx.size, bs)]
        epoch += 1
    return out[:steps]


def _check_data(data) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise TypeError(f"data must be an (inputs, targets) pair of arrays, got "
                        f"{type(data).__name__}")
    x, y = (np.asarray(a) for a in data)
    if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
        raise ValueError(f"inputs and targets need the same leading (sample) dimension, got "
                         f"shapes {x.shape} and {y.shape}")
    if len(x) == 0:
        raise ValueError("data is empty")
    return x, y


def input_transform(t) -> Callable[[np.ndarray], np.ndarray]:
    if t is None:
        return lambda a: a
    if t == "channels_last":
        return lambda a: np.moveaxis(a, 1, -1) if a.ndim >= 3 else a
    if callable(t):
        return t
    raise ValueError(f"jax_input must be None, 'channels_last' (NCHW -> NHWC for the NNX "
                     f"model) or a callable on numpy batches, got {t!r}")


def as_jax(a: np.ndarray):
    if a.dtype.kind == "f":
        return jnp.asarray(a, jnp.float32)
    return jnp.asarray(a, jnp.int32) if a.dtype.kind in "iu" else jnp.asarray(a)


def as_torch(a: np.ndarray):
    import torch

    if a.dtype.kind == "f":
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    if a.dtype.kind in "iu":
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return torch.from_numpy(np.ascontiguousarray(a))


def set_train(torch_model, nnx_model, train: bool) -> None:
    if torch_model is not None:
        torch_model.train(train)
    for _, node in nnx.iter_graph(nnx_model):
        if isinstance(node, nnx.BatchNorm):
            node.use_running_average = not train


def check_models(torch_model, nnx_model) -> None:
    import torch

    if not isinstance(torch_model, torch.nn.Module):
        raise TypeError(f"torch_model must be a torch.nn.Module (or, with nprocs > 1, a "
                        f"function returning one), got {type(torch_model).__name__}")
    if not isinstance(nnx_model, nnx.Module):
        raise TypeError(f"nnx_model must be a flax.nnx.Module (or, with nprocs > 1, a "
                        f"function returning one), got {type(nnx_model).__name__}")


class Case(NamedTuple):
    """One validated parity run (what :func:`run_parity` was given, normalised)."""

    torch_model: Any
    nnx_model: Any
    loss: LossPair
    data: tuple[np.ndarray, np.ndarray]
    spec: OptimizerSpec
    steps: int
    batch_size: int | None
    schedule: dict
    jax_input: Any
    train: bool
    copy_weights: bool
    every_step: bool
    strict: bool
    check_config: bool
    config: dict


def make_case(torch_model, nnx_model, loss, data, optimizer, *, steps: int = 5,
              batch_size: int | None = None, shuffle: bool = False, seed: int = 0,
              drop_last: bool = False, jax_input: Any = None, train: bool = True,
              copy_weights: bool = True, params_every_step: bool = False,
              strict: bool = True, check_config: bool = True) -> Case:
    """Validate :func:`run_parity`'s arguments (same names) into a :class:`Case`."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    lp, spec = loss_pair(loss), optimizer_spec(optimizer)
    x, y = _check_data(data)
    input_transform(jax_input)
    config = {"loss": lp.name, "optimizer": spec_str(spec), "steps": steps,
              "batch_size": batch_size if batch_size is not None else "all",
              "nprocs": 1, "sampler": f"shuffle={shuffle}, seed={seed}"}
    sched = dict(shuffle=shuffle, seed=seed, drop_last=drop_last)
    return Case(torch_model, nnx_model, lp, (x, y), spec, steps, batch_size, sched,
                jax_input, bool(train), bool(copy_weights), bool(params_every_step),
                strict, check_config, config)


def jax_schedule(n, steps, batch_size, torch_idx, sched, config, num_replicas=1, rank=0):
    """The JAX side's batches from jdist's sampler, checked against torch's."""
    jax_idx = batch_schedule(n, steps, batch_size, source="jdist", num_replicas=num_replicas,
                             rank=rank, **sched)
    for k, (a, b) in enumerate(zip(torch_idx, jax_idx, strict=True)):
        if not np.array_equal(a, b):
            raise RuntimeError(
                f"jdist.sampler.DistributedSampler gave different indices than torch's at "
                f"step {k} (rank {rank} of {num_replicas}): {b.tolist()} vs {a.tolist()}; "
                f"this is a jdist bug, please report it")
    config["sampler"] += " (jdist == torch)"
    return jax_idx
