"""Copy weights between PyTorch modules and Flax NNX modules, both directions.

torch is only a test oracle here: it is imported inside the functions that need it,
never when ``jdist.testing`` is imported.

**Pairing rule.** Each model is reduced to its sequence of *convertible layers*, in
definition order, depth first:

* torch: ``module.named_modules()`` order (registration order, pre-order; a module
  shared twice counts once);
* NNX: attributes in assignment order (kept through ``nnx.jit``, split/merge and
  clone), descending into sub-modules,
  ``nnx.List``/``nnx.Sequential`` (index order) and ``nnx.Dict``/dicts (insertion order);
  a module reached twice counts once. (``nnx.iter_graph`` sorts names alphabetically,
  so it is *not* used.)

The i-th torch layer is paired with the i-th NNX layer. Supported pairs:

=========================================  ==================  =========================
torch                                      flax.nnx            arrays
=========================================  ==================  =========================
``Linear``                                 ``Linear``          kernel = weight.T
``Conv1d`` / ``Conv2d`` / ``Conv3d``       ``Conv``            OI[D]HW <-> [D]HWIO
``BatchNorm1d/2d/3d``, ``SyncBatchNorm``   ``BatchNorm``       scale, bias, mean, var
``LayerNorm``                              ``LayerNorm``       scale, bias
``Embedding``                              ``Embed``           embedding = weight
``EmbeddingBag``                           ``EmbeddingBag``    embedding = weight
=========================================  ==================  =========================

The NNX ``EmbeddingBag`` is jdist's (:class:`jdist.testing.EmbeddingBag`; Flax has none);
its ``mode``, ``include_last_offset`` and ``padding_idx`` must match torch's.

The pairing lives in :mod:`jdist.testing._convert_layers`, the hyperparameter checks in
:mod:`jdist.testing._convert_config`; this module moves the arrays.

Other layers that hold parameters (or buffers) are *unsupported*: an error with
``strict=True``, skipped with ``strict=False``. Layers without parameters (activations,
pooling, dropout) are ignored. Counts or kinds that differ always raise
:class:`~jdist.errors.WeightConversionError` naming both paths (pairing would otherwise
silently shift weights); so do shape mismatches. A parameter present on one side only
(a bias, affine BatchNorm weights) raises with ``strict=True`` and is left alone with
``strict=False``. Values take the destination's dtype.

**What the user must keep consistent** (not weights, so not converted):

* Layout: torch convolutions and BatchNorm take channels first (NCHW), Flax channels
  last (NHWC). Transpose inputs (and flatten order before a Linear that follows a conv)
  in the model code; the kernels themselves are converted here.
* Hyperparameters: with ``check_config=True`` (default) the copy raises if they differ:
  conv stride, padding, dilation, groups; norm epsilon (torch ``LayerNorm`` uses 1e-5,
  ``nnx.LayerNorm`` 1e-6 by default); BatchNorm momentum, which is **inverted**: torch
  ``momentum=m`` (weight of the new batch) equals Flax ``momentum=1 - m`` (weight of the
  old average). Use :func:`torch_to_flax_momentum`. torch's ``momentum=None``
  (cumulative average) and ``Embedding(max_norm=...)`` have no Flax equivalent.
* Running variance: in training mode torch updates ``running_var`` with the *unbiased*
  batch variance (``n / (n - 1)`` times), Flax with the biased one, so after one
  training step the running variances differ by ``m * var_batch / (n - 1)``; running
  means and the normalised outputs agree.
* ``Embedding(padding_idx=i)`` only changes torch's gradient (row ``i`` gets none).
* ``num_batches_tracked`` is torch-only; :func:`nnx_to_torch` leaves it as it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jdist.errors import WeightConversionError
from jdist.testing._convert_config import _check_configs
from jdist.testing._convert_config import flax_to_torch_momentum as flax_to_torch_momentum
from jdist.testing._convert_config import torch_to_flax_momentum as torch_to_flax_momentum
from jdist.testing._convert_layers import _ARRAYS, _LAYOUT, Layer, _pair
from jdist.testing._convert_layers import nnx_layers as nnx_layers
from jdist.testing._convert_layers import paired_layers as paired_layers
from jdist.testing._convert_layers import torch_layers as torch_layers

__all__ = [
    "torch_to_nnx",
    "nnx_to_torch",
    "state_dict_to_nnx",
    "nnx_state_to_torch_state_dict",
    "paired_layers",
    "torch_to_flax_momentum",
    "flax_to_torch_momentum",
]


# ------------------------------------------------------------------- array movement


def _to_numpy(v) -> np.ndarray:
    if hasattr(v, "detach"):  # a torch tensor (duck-typed: torch is not imported here)
        import torch

        if isinstance(v, torch.nn.parameter.UninitializedParameter):
            raise WeightConversionError(
                "an uninitialized (lazy) torch parameter cannot be converted; run one "
                "forward pass on the torch model first")
        v = v.detach().cpu()
        if v.dtype == torch.bfloat16:
            v = v.float()
        # a copy: torch optimizers update parameters in place, and the converted
        # arrays must not follow them
        return v.numpy().copy()
    return np.array(v, copy=True)


def _nnx_get(layer: Layer, attr: str):
    var = getattr(layer.module, attr, None)
    return None if var is None else np.asarray(var.get_value())


def _nnx_prepare(layer: Layer, attr: str, value: np.ndarray, src_desc: str, tname: str):
    """``(variable, new value)`` after the shape check (nothing is written yet)."""
    var = getattr(layer.module, attr)
    old = var.get_value()
    if tuple(value.shape) != tuple(old.shape):
        raise WeightConversionError(
            f"shape mismatch: torch {src_desc} '{tname}' gives {tuple(value.shape)} after "
            f"conversion ({_LAYOUT.get(layer.kind, 'same layout')}) but nnx "
            f"{layer.describe()} '{attr}' has {tuple(old.shape)}; build both layers with the "
            f"same sizes")
    return var, jnp.array(value, dtype=old.dtype, copy=True)


def _missing(strict, side, desc, name, other_side, other_desc, other_name):
    if strict:
        raise WeightConversionError(
            f"{side} {desc} has '{name}' but {other_side} {other_desc} has no "
            f"'{other_name}' (a bias or affine parameter is enabled on one side only); "
            f"construct both alike (e.g. use_bias=/bias=, use_scale=/affine=) or pass "
            f"strict=False to leave it alone")


def _nnx_writes(arrays: Mapping[str, Any], src_desc: str, layer: Layer, strict: bool):
    """Checked ``(variable, value)`` writes for one layer."""
    writes = []
    for tname, attr, to_nnx, _ in _ARRAYS[layer.kind]:
        tv = arrays.get(tname)
        has_n = getattr(layer.module, attr, None) is not None
        if tv is None and has_n:
            _missing(strict, "nnx", layer.describe(), attr, "torch", src_desc, tname)
        elif tv is not None and not has_n:
            _missing(strict, "torch", src_desc, tname, "nnx", layer.describe(), attr)
        elif tv is not None:
            writes.append(_nnx_prepare(layer, attr, to_nnx(_to_numpy(tv)), src_desc, tname))
    return writes


def _apply(writes) -> None:
    """Write only after every layer passed its checks, so a failed copy changes nothing."""
    for var, value in writes:
        var.set_value(value)


def _arrays_from_nnx(layer: Layer) -> dict[str, np.ndarray | None]:
    out = {}
    for tname, attr, _, to_torch in _ARRAYS[layer.kind]:
        v = _nnx_get(layer, attr)
        out[tname] = None if v is None else to_torch(v)
    return out


def _to_torch_tensor(value: np.ndarray, like):
    import torch

    if value.dtype.name == "bfloat16" or value.dtype.kind not in "fiub":
        value = value.astype(np.float32)
    t = torch.from_numpy(np.array(value, copy=True))
    return t.to(dtype=like.dtype, device=like.device) if like is not None else t


# ------------------------------------------------------------------------ public API


def torch_to_nnx(torch_module, nnx_module, *, strict: bool = True,
                 check_config: bool = True):
    """Copy a torch module's weights (and BatchNorm running statistics) into an NNX module.

    Layers are paired in definition order (module docstring). The NNX module is changed
    in place and returned.

    Args:
      torch_module: a ``torch.nn.Module``.
      nnx_module: a ``flax.nnx.Module`` with the same convertible layers in the same order.
      strict: raise on unsupported layers holding parameters and on a parameter present
        on one side only (``False``: skip them).
      check_config: raise when hyperparameters differ (epsilon, momentum, stride,
        padding, dilation, groups).

    Returns:
      ``nnx_module``.

    Raises:
      WeightConversionError: naming both layer paths, for count, kind, shape or
        hyperparameter mismatches.
    """
    pairs = _pair(torch_layers(torch_module), nnx_layers(nnx_module), "torch", "nnx", strict)
    _check_configs(pairs, check_config)
    writes = []
    for t, n in pairs:
        arrays = {name: getattr(t.module, name, None) for name, *_ in _ARRAYS[t.kind]}
        writes += _nnx_writes(arrays, t.describe(), n, strict)
    _apply(writes)
    return nnx_module


def nnx_to_torch(nnx_module, torch_module, *, strict: bool = True, check_config: bool = True):
    """Copy an NNX module's weights (and BatchNorm statistics) into a torch module in place.

    The mirror of :func:`torch_to_nnx` (same pairing, checks and errors). torch tensors
    keep their dtype and device; ``num_batches_tracked`` is left unchanged.

    Returns:
      ``torch_module``.
    """
    import torch

    pairs = _pair(nnx_layers(nnx_module), torch_layers(torch_module), "nnx", "torch", strict)
    _check_configs([(t, n) for n, t in pairs], check_config)
    writes = []  # checked first, written after, so a failed copy changes nothing
    for n, t in pairs:
        attrs = {tname: attr for tname, attr, *_ in _ARRAYS[n.kind]}
        for tname, value in _arrays_from_nnx(n).items():
            target, attr = getattr(t.module, tname, None), attrs[tname]
            if value is None and target is not None:
                _missing(strict, "torch", t.describe(), tname, "nnx", n.describe(), attr)
            elif value is not None and target is None:
                _missing(strict, "nnx", n.describe(), attr, "torch", t.describe(), tname)
            elif value is not None:
                if tuple(value.shape) != tuple(target.shape):
                    raise WeightConversionError(
                        f"shape mismatch: nnx {n.describe()} '{attr}' gives "
                        f"{tuple(value.shape)} after conversion "
                        f"({_LAYOUT.get(n.kind, 'same layout')}) but torch {t.describe()} "
                        f"'{tname}' has {tuple(target.shape)}; build both layers with the "
                        f"same sizes")
                writes.append((target, _to_torch_tensor(value, target)))
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    return torch_module


def _state_dict_groups(state_dict: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    groups: OrderedDict[str, dict[str, Any]] = OrderedDict()
    for key, value in state_dict.items():
        prefix, _, name = key.rpartition(".")
        groups.setdefault(prefix, {})[name] = value
    return list(groups.items())


def _group_kind_ok(kind: str, arrays: Mapping[str, Any]) -> bool:
    names = set(arrays)
    allowed = {t for t, *_ in _ARRAYS[kind]} | ({"num_batches_tracked"}
                                                  if kind == "batchnorm" else set())
    if not names <= allowed or ("weight" not in names and kind != "batchnorm"):
        return False
    if kind == "batchnorm":
        return {"running_mean", "running_var"} <= names
    ndim = ({"linear": 2, "embedding": 2, "embeddingbag": 2, "layernorm": 1}.get(kind)
            or int(kind[4]) + 2)
    return np.ndim(_to_numpy(arrays["weight"])) == ndim


def _nnx_layers_with_arrays(nnx_module, strict: bool) -> list[Layer]:
    """Convertible NNX layers that hold arrays (a state_dict has no entry for the others)."""
    layers = nnx_layers(nnx_module)
    bad = [lay.describe() for lay in layers if lay.kind is None]
    if bad and strict:
        raise WeightConversionError(
            f"nnx model has layers holding parameters that cannot be converted: "
            f"{', '.join(bad)}; pass strict=False to skip them")
    return [lay for lay in layers if lay.kind is not None
            and any(_nnx_get(lay, attr) is not None for _, attr, *_ in _ARRAYS[lay.kind])]


def state_dict_to_nnx(state_dict: Mapping[str, Any], nnx_module, *, strict: bool = True):
    """Copy a torch ``state_dict`` (tensors or numpy arrays) into an NNX module in place.

    Keys are grouped by module prefix (``"fc1.weight"`` -> ``"fc1"``) in the dict's order
    (torch's registration order) and paired with the NNX module's convertible layers.
    Only names and shapes are available, so no hyperparameter checks are made, and each
    group must carry the arrays of the paired layer's kind. Works without torch
    installed when the values are numpy arrays.

    Returns:
      ``nnx_module``.
    """
    groups = _state_dict_groups(state_dict)
    convertible = _nnx_layers_with_arrays(nnx_module, strict)
    if len(groups) != len(convertible):
        raise WeightConversionError(
            f"state_dict has {len(groups)} modules with tensors ({[p for p, _ in groups]}) "
            f"but the nnx model has {len(convertible)} convertible layers "
            f"({[lay.path for lay in convertible]}); they are paired in order")
    writes = []
    for i, ((prefix, arrays), layer) in enumerate(zip(groups, convertible, strict=True)):
        if not _group_kind_ok(layer.kind, arrays):
            raise WeightConversionError(
                f"layer #{i}: state_dict entries {prefix!r} {sorted(arrays)} do not look like "
                f"a {layer.kind} as nnx {layer.describe()} expects (names or weight rank "
                f"differ); both models must define the same layers in the same order")
        writes += _nnx_writes(arrays, repr(prefix), layer, strict)
    _apply(writes)
    return nnx_module


def nnx_state_to_torch_state_dict(nnx_module, template: Mapping[str, Any] | None = None, *,
                                  strict: bool = True) -> OrderedDict:
    """A torch ``state_dict`` (``OrderedDict`` of CPU tensors) holding an NNX module's weights.

    With ``template`` (a torch model's ``state_dict()``), the result has its keys, dtypes
    and ``num_batches_tracked`` values, ready for ``load_state_dict``; groups pair with
    the NNX layers in order and shapes are checked. Without it, keys are
    ``"<nnx path>.<torch name>"`` (e.g. ``"layers.0.weight"``) in float32/NNX dtypes.
    """
    import torch

    convertible = _nnx_layers_with_arrays(nnx_module, strict)
    out: OrderedDict[str, Any] = OrderedDict()
    if template is None:
        for layer in convertible:
            for name, value in _arrays_from_nnx(layer).items():
                if value is not None:
                    out[f"{layer.path}.{name}" if layer.path else name] = \
                        _to_torch_tensor(value, None)
            if layer.kind == "batchnorm":
                out[f"{layer.path}.num_batches_tracked"] = torch.tensor(0, dtype=torch.long)
        return out
    groups = _state_dict_groups(template)
    if len(groups) != len(convertible):
        raise WeightConversionError(
            f"template has {len(groups)} modules with tensors ({[p for p, _ in groups]}) but "
            f"the nnx model has {len(convertible)} convertible layers "
            f"({[lay.path for lay in convertible]}); they are paired in order")
    for i, ((prefix, arrays), layer) in enumerate(zip(groups, convertible, strict=True)):
        if not _group_kind_ok(layer.kind, arrays):
            raise WeightConversionError(
                f"layer #{i}: template entries {prefix!r} {sorted(arrays)} do not look like a "
                f"{layer.kind} as nnx {layer.describe()} expects")
        values = _arrays_from_nnx(layer)
        for name, like in arrays.items():
            key = f"{prefix}.{name}" if prefix else name
            value = values.get(name)
            if value is None:
                if name != "num_batches_tracked":
                    _missing(strict, "template", repr(prefix), name, "nnx", layer.describe(),
                             name)
                out[key] = like.detach().clone() if hasattr(like, "detach") else like
                continue
            if tuple(value.shape) != tuple(like.shape):
                raise WeightConversionError(
                    f"shape mismatch: nnx {layer.describe()} gives {tuple(value.shape)} for "
                    f"{key!r} but the template has {tuple(like.shape)}")
            out[key] = _to_torch_tensor(value, like if isinstance(like, torch.Tensor) else None)
    return out
