"""Parity harness: train a torch model and its Flax NNX port side by side, report divergence.

:func:`run_parity` copies the torch weights into the NNX model
(:func:`~jdist.testing.torch_to_nnx`), then runs the same ``steps`` optimizer steps in
both frameworks on the same batches in the same order, and returns a
:class:`ParityReport`: the loss of every step in each framework and their difference,
and the largest absolute difference of every array (weights and BatchNorm running
statistics) of every layer pair (:func:`~jdist.testing.paired_layers`) after the run,
optionally after every step.

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

BatchNorm in training mode: torch updates ``running_var`` with the *unbiased* batch
variance, ``nnx.BatchNorm`` with the biased one, so their running variances drift apart by
about ``momentum * var / (n - 1)`` per step (the report shows it as a buffer difference).
Use :class:`~jdist.testing.TorchBatchNorm` in the NNX model for torch's rule.

torch is imported inside the functions that use it, never at import time.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdist.errors import WeightConversionError
from jdist.testing import _convert

__all__ = [
    "LOSSES",
    "OPTIMIZERS",
    "ArrayDiff",
    "LossPair",
    "OptimizerSpec",
    "ParityReport",
    "StepResult",
    "batch_schedule",
    "compare_models",
    "copy_torch_weights",
    "loss_pair",
    "make_optax",
    "make_torch_optimizer",
    "optimizer_spec",
    "run_parity",
]

#: Named losses (mean over the batch in both frameworks).
LOSSES = ("cross_entropy", "mse")
#: Named optimizers (see the module docstring for the mapping).
OPTIMIZERS = ("sgd", "adam", "adamw")

_BUFFERS = ("running_mean", "running_var")


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
    """The optax transformation with the update rule of :func:`make_torch_optimizer`."""
    s = optimizer_spec(spec)
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


# ------------------------------------------------------------------------ report


class StepResult(NamedTuple):
    """One step's loss in each framework (under DDP: the mean over processes)."""

    step: int
    torch_loss: float
    jax_loss: float

    @property
    def diff(self) -> float:
        return abs(self.torch_loss - self.jax_loss)


class ArrayDiff(NamedTuple):
    """The largest ``|torch - nnx|`` of one array of one layer pair (torch layout)."""

    torch_path: str
    nnx_path: str
    kind: str
    name: str  # torch name: weight, bias, running_mean, running_var
    shape: tuple[int, ...]
    max_abs_diff: float

    @property
    def is_buffer(self) -> bool:
        return self.name in _BUFFERS


def _fmt(v: float) -> str:
    return f"{v:.3e}" if v == v else "nan"


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """What :func:`run_parity` measured. ``str(report)`` is :meth:`table`.

    Attributes:
      steps: one :class:`StepResult` per step.
      arrays: one :class:`ArrayDiff` per array of every layer pair after the last step.
      per_step_arrays: with ``params_every_step=True``, the :class:`ArrayDiff` s after
        each step (``per_step_arrays[k]`` after step ``k``); otherwise ``None``.
      config: what was run (models, loss, optimizer, batch size, processes, sampler).
    """

    steps: tuple[StepResult, ...]
    arrays: tuple[ArrayDiff, ...]
    per_step_arrays: tuple[tuple[ArrayDiff, ...], ...] | None = None
    config: dict = dataclasses.field(default_factory=dict)

    @property
    def max_loss_diff(self) -> float:
        """The largest per-step ``|torch loss - jax loss|``."""
        return _max(s.diff for s in self.steps)

    @property
    def max_param_diff(self) -> float:
        """The largest ``|torch - nnx|`` over all parameters (not running stats)."""
        return _max(a.max_abs_diff for a in self.arrays if not a.is_buffer)

    @property
    def max_buffer_diff(self) -> float:
        """The largest difference of BatchNorm running statistics (0.0 without any)."""
        return _max(a.max_abs_diff for a in self.arrays if a.is_buffer)

    def layer_diffs(self, *, buffers: bool = True) -> dict[str, float]:
        """``{torch layer path: largest difference of its arrays}``, in layer order."""
        out: dict[str, float] = {}
        for a in self.arrays:
            if buffers or not a.is_buffer:
                out[a.torch_path] = _max((out.get(a.torch_path, 0.0), a.max_abs_diff))
        return out

    def first_divergent_step(self, tol: float) -> int | None:
        """The first step whose loss (or, if recorded, parameters) differ above ``tol``."""
        for k, s in enumerate(self.steps):
            arrays = self.per_step_arrays[k] if self.per_step_arrays else ()
            if not s.diff <= tol or any(not a.max_abs_diff <= tol for a in arrays):
                return s.step
        return None

    def ok(self, tol: float = 1e-5, *, buffers: bool = True) -> bool:
        """All loss and parameter (and, with ``buffers``, running-stat) diffs ``<= tol``.

        NaN anywhere is a failure.
        """
        if not isinstance(tol, numbers.Real) or isinstance(tol, bool) or not tol >= 0:
            raise ValueError(f"tol must be a non-negative number, got {tol!r}")
        worst = [self.max_loss_diff, self.max_param_diff]
        if buffers:
            worst.append(self.max_buffer_diff)
        return all(w <= tol for w in worst)

    def table(self, tol: float | None = None) -> str:
        """A plain-text table: per-step losses, then per-array differences."""
        rows = [("step", "torch loss", "jax loss", "|diff|")]
        rows += [(str(s.step), f"{s.torch_loss:.8g}", f"{s.jax_loss:.8g}", _fmt(s.diff))
                 for s in self.steps]
        lines = [_config_line(self.config), *_aligned(rows), ""]
        rows = [("torch layer", "nnx layer", "kind", "array", "shape", "max |diff|")]
        rows += [(a.torch_path or "<root>", a.nnx_path or "<root>", a.kind, a.name,
                  "x".join(map(str, a.shape)) or "()", _fmt(a.max_abs_diff))
                 for a in self.arrays]
        lines += _aligned(rows)
        lines.append("")
        lines.append(f"max loss diff {_fmt(self.max_loss_diff)}, max param diff "
                     f"{_fmt(self.max_param_diff)}, max running-stat diff "
                     f"{_fmt(self.max_buffer_diff)}")
        if tol is not None:
            verdict = "PASS" if self.ok(tol) else "FAIL"
            step = self.first_divergent_step(tol)
            extra = "" if step is None else f" (first divergent step: {step})"
            lines.append(f"{verdict} at tolerance {tol:g}{extra}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _max(values) -> float:
    out = 0.0
    for v in values:
        if v != v:  # NaN wins
            return float("nan")
        out = max(out, float(v))
    return out


def _aligned(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
           for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def _config_line(config: dict) -> str:
    keys = ("loss", "optimizer", "steps", "batch_size", "nprocs", "sampler")
    return "parity: " + ", ".join(f"{k}={config[k]}" for k in keys if k in config)


# ------------------------------------------------------------------- comparison


def compare_models(torch_model, nnx_model, *, strict: bool = True) -> tuple[ArrayDiff, ...]:
    """The largest ``|torch - nnx|`` of every array of every layer pair.

    Layers are paired as :func:`~jdist.testing.paired_layers` pairs them; NNX arrays are
    brought to torch's layout first (kernels transposed). Includes BatchNorm running
    statistics (``running_mean``, ``running_var``).

    Raises:
      WeightConversionError: the models do not pair, or a pair's shapes differ.
    """
    pairs = _convert._pair(_convert.torch_layers(torch_model),
                           _convert.nnx_layers(nnx_model), "torch", "nnx", strict)
    out = []
    for t, n in pairs:
        for name, nv in _convert._arrays_from_nnx(n).items():
            tv = getattr(t.module, name, None)
            if nv is None or tv is None:
                continue
            tv = _convert._to_numpy(tv).astype(np.float64)
            nv = np.asarray(nv, dtype=np.float64)
            if tv.shape != nv.shape:
                raise WeightConversionError(
                    f"shape mismatch: torch {t.describe()} {name!r} has shape {tv.shape} but "
                    f"nnx {n.describe()} gives {nv.shape} (in torch's layout); build both "
                    f"layers with the same sizes")
            diff = float(np.max(np.abs(tv - nv))) if tv.size else 0.0
            out.append(ArrayDiff(t.path, n.path, t.kind, name, tuple(tv.shape), diff))
    return tuple(out)


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


def _jax_step_fn(jax_loss: Callable):
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


def run_parity(torch_model, nnx_model, loss, data, optimizer, *, steps: int = 5,
               batch_size: int | None = None, shuffle: bool = False, seed: int = 0,
               drop_last: bool = False, jax_input: Any = None, train: bool = True,
               copy_weights: bool = True, params_every_step: bool = False,
               nprocs: int = 1, timeout: float = 300.0, strict: bool = True,
               check_config: bool = True) -> ParityReport:
    """Train ``torch_model`` and ``nnx_model`` the same way and report how they diverge.

    Args:
      torch_model: a ``torch.nn.Module`` (with ``nprocs > 1``: a picklable zero-argument
        function that builds it in each process).
      nnx_model: its Flax NNX port with the same layers in the same order (with
        ``nprocs > 1``: a picklable function building it). It is changed in place.
      loss: a name in :data:`LOSSES` or a ``(torch_fn, jax_fn)`` pair of
        ``fn(model_output, targets) -> scalar``.
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
        every process taking its :class:`~jdist.sampler.DistributedSampler` share.
      timeout: seconds for each framework's processes (``nprocs > 1``).
      strict, check_config: passed to :func:`~jdist.testing.torch_to_nnx`.

    Returns:
      A :class:`ParityReport`; ``report.ok(tol)`` says whether it stayed within ``tol``.

    Raises:
      WeightConversionError: the models do not pair (layer count, kind, shape or
        hyperparameters differ).
      ValueError, TypeError: bad data, loss or optimizer spec (the message names the fix).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    lp, spec = loss_pair(loss), optimizer_spec(optimizer)
    x, y = _check_data(data)
    transform = _input_transform(jax_input)
    config = {"loss": lp.name, "optimizer": _spec_str(spec), "steps": steps,
              "batch_size": batch_size if batch_size is not None else "all",
              "nprocs": nprocs, "sampler": f"shuffle={shuffle}, seed={seed}"}
    sched = dict(shuffle=shuffle, seed=seed, drop_last=drop_last)
    if nprocs > 1:
        from jdist.testing._parity_ddp import run_ddp_parity

        return run_ddp_parity(torch_model, nnx_model, lp, (x, y), spec, steps=steps,
                              batch_size=batch_size, schedule=sched, jax_input=transform,
                              train=train, copy_weights=copy_weights,
                              params_every_step=params_every_step, nprocs=nprocs,
                              timeout=timeout, strict=strict, check_config=check_config,
                              config=config)
    _check_models(torch_model, nnx_model)
    if copy_weights:
        copy_torch_weights(torch_model, nnx_model, strict=strict, check_config=check_config)
    else:
        compare_models(torch_model, nnx_model, strict=strict)  # pairing errors up front
    torch_idx = batch_schedule(len(x), steps, batch_size, source="torch", **sched)
    jax_idx = _jax_schedule(len(x), steps, batch_size, torch_idx, sched, config)
    _set_train(torch_model, nnx_model, train)
    tr, jr = _TorchRunner(torch_model, lp, spec), _JaxRunner(nnx_model, lp, spec, transform)
    results, per_step = [], []
    for k in range(steps):
        tl = tr.step(x[torch_idx[k]], y[torch_idx[k]])
        jl = jr.step(x[jax_idx[k]], y[jax_idx[k]])
        results.append(StepResult(k, tl, jl))
        if params_every_step:
            per_step.append(compare_models(torch_model, nnx_model, strict=strict))
    arrays = per_step[-1] if per_step else compare_models(torch_model, nnx_model,
                                                           strict=strict)
    return ParityReport(tuple(results), arrays, tuple(per_step) if per_step else None, config)


def copy_torch_weights(torch_model, nnx_model, **kwargs):
    """:func:`~jdist.testing.torch_to_nnx` from a private copy of ``torch_model``.

    On CPU, JAX may adopt a numpy array's memory without copying, and the numpy view of a
    torch parameter shares the parameter's memory, so NNX arrays copied straight from a
    model that keeps training would change with it. Copying from a deep copy (kept
    alive by those arrays, never trained) keeps the two models independent.
    """
    import copy

    return _convert.torch_to_nnx(copy.deepcopy(torch_model), nnx_model, **kwargs)


def _jax_schedule(n, steps, batch_size, torch_idx, sched, config, num_replicas=1, rank=0):
    """The JAX side's batches from jdist's sampler, checked against torch's."""
    try:
        import jdist.sampler as js

        has_sampler = hasattr(js, "DistributedSampler")
    except ImportError:  # pragma: no cover - the sampler is part of jdist
        has_sampler = False
    if not has_sampler:
        config["sampler"] += " (torch's indices for both)"
        return torch_idx
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


def _spec_str(s: OptimizerSpec) -> str:
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

