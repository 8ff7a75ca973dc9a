"""Parity harness: train a torch model and its Flax NNX port side by side, report divergence.

:func:`run_parity` copies the torch weights into the NNX model
(:func:`~jdist.testing.torch_to_nnx`), then runs the same ``steps`` optimizer steps in
both frameworks on the same batches in the same order, and returns a
:class:`ParityReport`: the loss of every step in each framework and their difference,
and the largest absolute difference of every array (weights and BatchNorm running
statistics) of every layer pair (:func:`~jdist.testing.paired_layers`) after the run,
optionally after every step.

The loss and the optimizer are pairs that compute the same thing in both frameworks
(see :mod:`jdist.testing._parity_pairs`).

BatchNorm in training mode: torch updates ``running_var`` with the *unbiased* batch
variance, ``nnx.BatchNorm`` with the biased one, so their running variances drift apart by
about ``momentum * var / (n - 1)`` per step (the report shows it as a buffer difference).
Use :class:`~jdist.testing.TorchBatchNorm` in the NNX model for torch's rule.

Tolerances: both frameworks compute in float32 and sum in different orders, so losses
and weights differ by ~1e-7 per step. SGD keeps that size. Adam-type optimizers divide
by the gradient's own magnitude, so a parameter whose gradient is mostly cancellation
noise (a conv bias right before a BatchNorm) or that sits on a ReLU kink can jump by a
fraction of ``lr``. Drop such biases (``bias=False``, as the built-in CNN does) and keep
runs short (5-10 steps) when checking to 1e-5. :meth:`ParityReport.first_divergent_step`
with ``params_every_step=True`` shows where a run left the tolerance.

torch is imported inside the functions that use it, never at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.testing import _convert
from jdist.testing._parity_pairs import LOSSES as LOSSES
from jdist.testing._parity_pairs import OPTIMIZERS as OPTIMIZERS
from jdist.testing._parity_pairs import LossPair as LossPair
from jdist.testing._parity_pairs import OptimizerSpec as OptimizerSpec
from jdist.testing._parity_pairs import _spec_str
from jdist.testing._parity_pairs import loss_pair as loss_pair
from jdist.testing._parity_pairs import make_optax as make_optax
from jdist.testing._parity_pairs import make_torch_optimizer as make_torch_optimizer
from jdist.testing._parity_pairs import optimizer_spec as optimizer_spec
from jdist.testing._parity_report import ArrayDiff as ArrayDiff
from jdist.testing._parity_report import ParityReport as ParityReport
from jdist.testing._parity_report import StepResult as StepResult
from jdist.testing._parity_report import compare_models as compare_models

__all__ = [
    "LOSSES",
    "OPTIMIZERS",
    "ArrayDiff",
    "LossPair",
    "Case",
    "OptimizerSpec",
    "ParityReport",
    "StepResult",
    "batch_schedule",
    "compare_models",
    "loss_pair",
    "make_optax",
    "make_torch_optimizer",
    "optimizer_spec",
    "run_parity",
    "run_parity_cases",
]

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


def _input_transform(t) -> Callable[[np.ndarray], np.ndarray]:
    if t is None:
        return lambda a: a
    if t == "channels_last":
        return lambda a: np.moveaxis(a, 1, -1) if a.ndim >= 3 else a
    if callable(t):
        return t
    raise ValueError(f"jax_input must be None, 'channels_last' (NCHW -> NHWC for the NNX "
                     f"model) or a callable on numpy batches, got {t!r}")


def _as_jax(a: np.ndarray):
    if a.dtype.kind == "f":
        return jnp.asarray(a, jnp.float32)
    return jnp.asarray(a, jnp.int32) if a.dtype.kind in "iu" else jnp.asarray(a)


def _as_torch(a: np.ndarray):
    import torch

    if a.dtype.kind == "f":
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    if a.dtype.kind in "iu":
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return torch.from_numpy(np.ascontiguousarray(a))


# ----------------------------------------------------------------------- runners


class _TorchRunner:
    def __init__(self, model, loss: LossPair, spec: OptimizerSpec):
        self.model = model
        self.loss = loss
        self.opt = make_torch_optimizer(spec, model.parameters())

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        self.opt.zero_grad(set_to_none=True)
        value = self.loss.torch_fn(self.model(_as_torch(x)), _as_torch(y))
        value.backward()
        self.opt.step()
        return float(value.detach())


@functools.lru_cache(maxsize=64)
def _jax_step_fn(jax_loss: Callable):
    """One compiled step per loss function (and, inside ``nnx.jit``, per model/optimizer
    structure), so repeated runs of the same pair reuse the compilation."""

    @nnx.jit
    def step(model, opt, x, y):
        def loss_fn(m):
            return jax_loss(m(x), y)

        value, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return value

    return step


class _JaxRunner:
    def __init__(self, model, loss: LossPair, spec: OptimizerSpec, transform):
        self.model = model
        self.opt = nnx.Optimizer(model, make_optax(spec), wrt=nnx.Param)
        self.transform = transform
        self._step = _jax_step_fn(loss.jax_fn)

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        value = self._step(self.model, self.opt, _as_jax(self.transform(x)), _as_jax(y))
        return float(jax.block_until_ready(value))


def _set_train(torch_model, nnx_model, train: bool) -> None:
    if torch_model is not None:
        torch_model.train(train)
    for _, node in nnx.iter_graph(nnx_model):
        if isinstance(node, nnx.BatchNorm):
            node.use_running_average = not train


def _check_models(torch_model, nnx_model) -> None:
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
    _input_transform(jax_input)
    config = {"loss": lp.name, "optimizer": _spec_str(spec), "steps": steps,
              "batch_size": batch_size if batch_size is not None else "all",
              "nprocs": 1, "sampler": f"shuffle={shuffle}, seed={seed}"}
    sched = dict(shuffle=shuffle, seed=seed, drop_last=drop_last)
    return Case(torch_model, nnx_model, lp, (x, y), spec, steps, batch_size, sched,
                jax_input, bool(train), bool(copy_weights), bool(params_every_step),
                strict, check_config, config)


def run_parity(torch_model, nnx_model, loss, data, optimizer, *, steps: int = 5,
               batch_size: int | None = None, shuffle: bool = False, seed: int = 0,
               drop_last: bool = False, jax_input: Any = None, train: bool = True,
               copy_weights: bool = True, params_every_step: bool = False,
               nprocs: int = 1, timeout: float = 300.0, strict: bool = True,
               check_config: bool = True) -> ParityReport:
    """Train ``torch_model`` and ``nnx_model`` the same way and report how they diverge.

    Example::

      report = run_parity(torch_net, nnx_net, "cross_entropy", (x, y), ("adam", 1e-3),
                          steps=5, batch_size=16, jax_input="channels_last")
      print(report)                 # per-step losses, per-layer max |diff|
      assert report.ok(1e-5)

    Args:
      torch_model: a ``torch.nn.Module`` (with ``nprocs > 1``: a picklable zero-argument
        function that builds it in each process).
      nnx_model: its Flax NNX port with the same layers in the same order (with
        ``nprocs > 1``: a picklable function building it). It is changed in place.
      loss: a name in :data:`LOSSES` or a ``(torch_fn, jax_fn)`` pair of
        ``fn(model_output, targets) -> scalar`` (module-level functions with ``nprocs > 1``).
      data: ``(inputs, targets)`` numpy arrays with the samples on the first axis,
        in torch's layout. Floating arrays are used as float32, integer ones as int64
        (torch) and int32 (JAX).
      optimizer: an optimizer spec (:func:`optimizer_spec`), e.g. ``("sgd", 0.1)``.
      steps: optimizer steps to run.
      batch_size: samples per step and process (``None``: the whole share every step).
      shuffle, seed, drop_last: the ``DistributedSampler`` settings that order the data;
        the epoch is advanced with ``set_epoch`` when the data run out.
      jax_input: how the NNX model sees the inputs: ``None`` (as torch), ``"channels_last"``
        (axis 1 moved last: NCHW -> NHWC) or a function on numpy batches.
      train: training mode (BatchNorm uses and updates batch statistics) or eval mode.
      copy_weights: copy the torch weights into the NNX model first
        (:func:`~jdist.testing.torch_to_nnx`); ``False`` compares the models as given.
      params_every_step: also compare every array after every step.
      nprocs: processes per framework; above 1 both run data-parallel (torch DDP over
        gloo, :class:`jdist.ddp.DistributedDataParallel`) in ``nprocs`` processes each,
        every process taking its :class:`~jdist.sampler.DistributedSampler` share
        (see :mod:`jdist.testing._parity_ddp`).
      timeout: seconds for each framework's processes (``nprocs > 1``).
      strict, check_config: passed to :func:`~jdist.testing.torch_to_nnx`.

    Returns:
      A :class:`ParityReport`; ``report.ok(tol)`` says whether it stayed within ``tol``.

    Raises:
      WeightConversionError: the models do not pair (layer count, kind, shape or
        hyperparameters differ).
      ValueError, TypeError: bad data, loss or optimizer spec (the message names the fix).
      jdist.launch.SpawnError: a process failed or timed out (``nprocs > 1``).
    """
    case = make_case(torch_model, nnx_model, loss, data, optimizer, steps=steps,
                     batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                     jax_input=jax_input, train=train, copy_weights=copy_weights,
                     params_every_step=params_every_step, strict=strict,
                     check_config=check_config)
    return _run_cases([case], nprocs, timeout)[0]


def run_parity_cases(cases, *, nprocs: int = 1, timeout: float = 300.0
                     ) -> list[ParityReport]:
    """Several :func:`run_parity` runs; with ``nprocs > 1`` all in one launch per framework.

    Args:
      cases: dicts of :func:`run_parity` arguments (``torch_model``, ``nnx_model``,
        ``loss``, ``data``, ``optimizer`` and any keyword but ``nprocs``/``timeout``).
      nprocs: processes per framework, as in :func:`run_parity`.
      timeout: seconds for each framework's launch (all cases together).

    Returns:
      One :class:`ParityReport` per case, in order.
    """
    if isinstance(cases, dict) or not hasattr(cases, "__iter__"):
        raise TypeError(f"cases must be a list of dicts of run_parity arguments, got "
                        f"{type(cases).__name__}")
    prepared = []
    for i, c in enumerate(cases):
        if not isinstance(c, dict):
            raise TypeError(f"case #{i} must be a dict of run_parity arguments, got "
                            f"{type(c).__name__}")
        bad = {"nprocs", "timeout"} & set(c)
        if bad:
            raise ValueError(f"case #{i} sets {sorted(bad)}; pass them to "
                             f"run_parity_cases itself")
        try:
            prepared.append(make_case(**c))
        except TypeError as e:
            if "argument" in str(e) and "make_case" in str(e):
                raise TypeError(f"case #{i}: {e} (keys are run_parity's arguments)") from e
            raise
    return _run_cases(prepared, nprocs, timeout)


def _run_cases(cases: list[Case], nprocs, timeout) -> list[ParityReport]:
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if nprocs > 1:
        from jdist.testing._parity_ddp import run_ddp_parity

        return run_ddp_parity(cases, nprocs=nprocs, timeout=timeout)
    return [_run_single(c) for c in cases]


def _run_single(c: Case) -> ParityReport:
    _check_models(c.torch_model, c.nnx_model)
    if c.copy_weights:
        _convert.torch_to_nnx(c.torch_model, c.nnx_model, strict=c.strict,
                              check_config=c.check_config)
    else:
        compare_models(c.torch_model, c.nnx_model, strict=c.strict)  # pairing errors now
    x, y = c.data
    config = dict(c.config)
    torch_idx = batch_schedule(len(x), c.steps, c.batch_size, source="torch", **c.schedule)
    jax_idx = _jax_schedule(len(x), c.steps, c.batch_size, torch_idx, c.schedule, config)
    _set_train(c.torch_model, c.nnx_model, c.train)
    tr = _TorchRunner(c.torch_model, c.loss, c.spec)
    jr = _JaxRunner(c.nnx_model, c.loss, c.spec, _input_transform(c.jax_input))
    results, per_step = [], []
    for k in range(c.steps):
        tl = tr.step(x[torch_idx[k]], y[torch_idx[k]])
        jl = jr.step(x[jax_idx[k]], y[jax_idx[k]])
        results.append(StepResult(k, tl, jl))
        if c.every_step:
            per_step.append(compare_models(c.torch_model, c.nnx_model, strict=c.strict))
    arrays = per_step[-1] if per_step else compare_models(c.torch_model, c.nnx_model,
                                                           strict=c.strict)
    return ParityReport(tuple(results), arrays, tuple(per_step) if per_step else None, config)


def _jax_schedule(n, steps, batch_size, torch_idx, sched, config, num_replicas=1, rank=0):
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
