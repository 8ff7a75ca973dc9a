"""The parity harness's report: per-step losses and per-array differences.

:class:`ParityReport` is what :func:`~jdist.testing.run_parity` returns;
:func:`compare_models` measures the largest ``|torch - nnx|`` of every array of every
layer pair (torch layout), BatchNorm running statistics included.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import numpy as np

from jdist.errors import WeightConversionError
from jdist.testing import _convert

__all__ = ["ArrayDiff", "ParityReport", "StepResult", "compare_models"]

_BUFFERS = ("running_mean", "running_var")


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
