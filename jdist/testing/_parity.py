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
from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.testing import _convert
from jdist.testing._parity_case import (
    Case,
    as_jax,
    as_torch,
    batch_schedule,
    check_models,
    input_transform,
    jax_schedule,
    make_case,
    set_train,
)
from jdist.testing._parity_pairs import LossPair, OptimizerSpec, make_optax, make_torch_optimizer
from jdist.testing._parity_report import ParityReport, StepResult, compare_models

__all__ = ["run_parity", "run_parity_cases"]


# ----------------------------------------------------------------------- runners


class _TorchRunner:
    def __init__(self, model, loss: LossPair, spec: OptimizerSpec):
        self.model = model
        self.loss = loss
        self.opt = make_torch_optimizer(spec, model.parameters())

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        self.opt.zero_grad(set_to_none=True)
        value = self.loss.torch_fn(self.model(as_torch(x)), as_torch(y))
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
        value = self._step(self.model, self.opt, as_jax(self.transform(x)), as_jax(y))
        return float(jax.block_until_ready(value))


def run_parity(torch_model, nnx_model, loss, data, optimizer, *, steps: int = 5,
               batch_size: int | None = None, shuffle: bool = False, seed: int = 0,
               drop_last: bool = False, jax_input: Any = None, train: bool = True,
               copy_weights: bool = True, params_every_step: bool = False,
               nprocs: int = 1, timeout: float = 300.0, start_method: str = "spawn",
               strict: bool = True, check_config: bool = True) -> ParityReport:
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
      start_method: how those processes start, as in :func:`jdist.launch.spawn`
        (``"forkserver"``: forked from a server that imported
        :func:`jdist.launch.set_forkserver_preload`'s modules once).
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
    return _run_cases([case], nprocs, timeout, start_method)[0]


def run_parity_cases(cases, *, nprocs: int = 1, timeout: float = 300.0,
                     start_method: str = "spawn") -> list[ParityReport]:
    """Several :func:`run_parity` runs; with ``nprocs > 1`` all in one launch per framework.

    Args:
      cases: dicts of :func:`run_parity` arguments (``torch_model``, ``nnx_model``,
        ``loss``, ``data``, ``optimizer`` and any keyword but ``nprocs``, ``timeout``
        and ``start_method``).
      nprocs: processes per framework, as in :func:`run_parity`.
      timeout: seconds for each framework's launch (all cases together).
      start_method: as in :func:`run_parity`.

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
        bad = {"nprocs", "timeout", "start_method"} & set(c)
        if bad:
            raise ValueError(f"case #{i} sets {sorted(bad)}; pass them to "
                             f"run_parity_cases itself")
        try:
            prepared.append(make_case(**c))
        except TypeError as e:
            if "argument" in str(e) and "make_case" in str(e):
                raise TypeError(f"case #{i}: {e} (keys are run_parity's arguments)") from e
            raise
    return _run_cases(prepared, nprocs, timeout, start_method)


def _run_cases(cases: list[Case], nprocs, timeout, start_method) -> list[ParityReport]:
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if nprocs > 1:
        from jdist.testing._parity_ddp import run_ddp_parity

        return run_ddp_parity(cases, nprocs=nprocs, timeout=timeout,
                              start_method=start_method)
    return [_run_single(c) for c in cases]


def _run_single(c: Case) -> ParityReport:
    check_models(c.torch_model, c.nnx_model)
    if c.copy_weights:
        _convert.torch_to_nnx(c.torch_model, c.nnx_model, strict=c.strict,
                              check_config=c.check_config)
    else:
        compare_models(c.torch_model, c.nnx_model, strict=c.strict)  # pairing errors now
    x, y = c.data
    config = dict(c.config)
    torch_idx = batch_schedule(len(x), c.steps, c.batch_size, source="torch", **c.schedule)
    jax_idx = jax_schedule(len(x), c.steps, c.batch_size, torch_idx, c.schedule, config)
    set_train(c.torch_model, c.nnx_model, c.train)
    tr = _TorchRunner(c.torch_model, c.loss, c.spec)
    jr = _JaxRunner(c.nnx_model, c.loss, c.spec, input_transform(c.jax_input))
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
