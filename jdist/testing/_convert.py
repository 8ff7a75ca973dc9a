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
=========================================  ==================  =========================

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

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.errors import WeightConversionError

__all__ = [
    "torch_to_nnx",
    "nnx_to_torch",
    "state_dict_to_nnx",
    "nnx_state_to_torch_state_dict",
    "paired_layers",
    "torch_to_flax_momentum",
    "flax_to_torch_momentum",
]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One convertible (or unsupported, ``kind=None``) layer of a model."""

    path: str
    kind: str | None
    module: Any
    type_name: str

    def describe(self) -> str:
        return f"{self.path or '<root>'!r} ({self.type_name})"


# (torch name, nnx attribute, transform to nnx, transform to torch)
def _same(a):
    return a


def _transpose(a):
    return np.ascontiguousarray(np.transpose(a))


def _conv_maps(nd: int):
    to_nnx = tuple(range(2, nd + 2)) + (1, 0)  # O I *S -> *S I O
    to_torch = tuple(int(i) for i in np.argsort(to_nnx))
    return (lambda a: np.ascontiguousarray(np.transpose(a, to_nnx)),
            lambda a: np.ascontiguousarray(np.transpose(a, to_torch)))


_CONV = {nd: _conv_maps(nd) for nd in (1, 2, 3)}
_ARRAYS = {
    "linear": [("weight", "kernel", _transpose, _transpose), ("bias", "bias", _same, _same)],
    "batchnorm": [("weight", "scale", _same, _same), ("bias", "bias", _same, _same),
                  ("running_mean", "mean", _same, _same), ("running_var", "var", _same, _same)],
    "layernorm": [("weight", "scale", _same, _same), ("bias", "bias", _same, _same)],
    "embedding": [("weight", "embedding", _same, _same)],
}
for _nd, (_to_nnx, _to_torch) in _CONV.items():
    _ARRAYS[f"conv{_nd}d"] = [("weight", "kernel", _to_nnx, _to_torch),
                              ("bias", "bias", _same, _same)]
_LAYOUT = {"linear": "torch (out, in) <-> nnx (in, out)",
           "conv1d": "torch (O, I, W) <-> nnx (W, I, O)",
           "conv2d": "torch (O, I, H, W) <-> nnx (H, W, I, O)",
           "conv3d": "torch (O, I, D, H, W) <-> nnx (D, H, W, I, O)"}


# ------------------------------------------------------------------------ traversal


def _nnx_kind(m) -> str | None:
    if isinstance(m, nnx.Linear):
        return "linear"
    if isinstance(m, nnx.Conv) and len(m.kernel_size) in _CONV:
        return f"conv{len(m.kernel_size)}d"
    if isinstance(m, nnx.BatchNorm):
        return "batchnorm"
    if isinstance(m, nnx.LayerNorm):
        return "layernorm"
    if isinstance(m, nnx.Embed):
        return "embedding"
    return None


def _attributes_in_definition_order(node) -> list[tuple[str, Any]]:
    """A module's attributes in assignment order.

    ``vars()`` order is not enough: ``nnx.jit``/``nnx.update`` rewrite ``__dict__`` in
    sorted order. Flax records the assignment order of a Pytree's attributes in
    ``_pytree__nodes`` (kept through split/merge and transforms); use it when present.
    """
    attrs = vars(node)
    order = list(getattr(node, "_pytree__nodes", None) or ())
    names = [k for k in order if k in attrs] + [k for k in attrs if k not in set(order)]
    return [(k, attrs[k]) for k in names]


def nnx_layers(module) -> list[Layer]:
    """The convertible layers of an NNX module in definition order (see module doc)."""
    if not isinstance(module, nnx.Module):
        raise TypeError(f"expected a flax.nnx.Module, got {type(module).__name__}: {module!r}")
    out: list[Layer] = []
    seen: set[int] = set()

    def join(path, name):
        return f"{path}.{name}" if path else str(name)

    def visit(node, path):
        if isinstance(node, (list, tuple)) or (isinstance(node, nnx.List)):
            for i, v in enumerate(node):
                visit(v, join(path, i))
            return
        if isinstance(node, Mapping):
            for k, v in node.items():
                visit(v, join(path, k))
            return
        if not isinstance(node, nnx.Module) or id(node) in seen:
            return
        seen.add(id(node))
        kind = _nnx_kind(node)
        if kind is not None:
            out.append(Layer(path, kind, node, type(node).__name__))
            return
        children = [(k, v) for k, v in _attributes_in_definition_order(node)
                    if not k.startswith("_pytree__")]
        if any(isinstance(v, nnx.Variable) for _, v in children):
            out.append(Layer(path, None, node, type(node).__name__))
        for k, v in children:
            if not isinstance(v, nnx.Variable):
                visit(v, join(path, k))

    visit(module, "")
    return out


def _torch_kind(m) -> str | None:
    from torch import nn

    if isinstance(m, nn.Linear):
        return "linear"
    for nd, cls in ((1, nn.Conv1d), (2, nn.Conv2d), (3, nn.Conv3d)):
        if isinstance(m, cls):
            return f"conv{nd}d"
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(m, nn.LayerNorm):
        return "layernorm"
    if isinstance(m, nn.Embedding):
        return "embedding"
    return None


def torch_layers(module) -> list[Layer]:
    """The convertible layers of a torch module in ``named_modules()`` order."""
    from torch import nn

    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}: {module!r}")
    out = []
    for path, m in module.named_modules():
        kind = _torch_kind(m)
        if kind is not None:
            out.append(Layer(path, kind, m, type(m).__name__))
        elif any(True for _ in m.parameters(recurse=False)) or \
                any(True for _ in m.buffers(recurse=False)):
            out.append(Layer(path, None, m, type(m).__name__))
    return out


def _pair(src: list[Layer], dst: list[Layer], src_name: str, dst_name: str, strict: bool):
    """Pair the i-th supported layer of each side; raise on unsupported, count, kind."""
    for side, layers in ((src_name, src), (dst_name, dst)):
        bad = [lay.describe() for lay in layers if lay.kind is None]
        if bad and strict:
            raise WeightConversionError(
                f"{side} model has layers holding parameters that cannot be converted: "
                f"{', '.join(bad)}. Supported: Linear, Conv1d/2d/3d, BatchNorm, LayerNorm, "
                f"Embedding. Pass strict=False to skip them (their weights are not copied)"
            )
    src = [lay for lay in src if lay.kind is not None]
    dst = [lay for lay in dst if lay.kind is not None]

    def listing(layers):
        return ", ".join(f"#{i} {lay.describe()}" for i, lay in enumerate(layers)) or "none"

    if len(src) != len(dst):
        raise WeightConversionError(
            f"{src_name} model has {len(src)} convertible layers but {dst_name} model has "
            f"{len(dst)}; layers are paired in definition order.\n  {src_name}: "
            f"{listing(src)}\n  {dst_name}: {listing(dst)}"
        )
    for i, (a, b) in enumerate(zip(src, dst, strict=True)):
        if a.kind != b.kind:
            raise WeightConversionError(
                f"layer #{i}: {src_name} {a.describe()} is a {a.kind} but {dst_name} "
                f"{b.describe()} is a {b.kind}; both models must define the same kinds of "
                f"layers in the same order.\n  {src_name}: {listing(src)}\n  {dst_name}: "
                f"{listing(dst)}"
            )
    return list(zip(src, dst, strict=True))


def paired_layers(torch_module, nnx_module, *, strict: bool = True) -> list[tuple[str, str, str]]:
    """``(torch path, nnx path, kind)`` for each layer pair the converters would use."""
    pairs = _pair(torch_layers(torch_module), nnx_layers(nnx_module), "torch", "nnx", strict)
    return [(t.path, n.path, t.kind) for t, n in pairs]


# ------------------------------------------------------------------ hyperparameters


def torch_to_flax_momentum(momentum: float) -> float:
    """torch BatchNorm ``momentum`` (weight of the new batch) -> Flax's (of the old mean).

    >>> torch_to_flax_momentum(0.1)
    0.9
    """
    return _one_minus(momentum)


def flax_to_torch_momentum(momentum: float) -> float:
    """Flax BatchNorm ``momentum`` -> torch's. ``flax_to_torch_momentum(0.99) == 0.01``."""
    return _one_minus(momentum)


def _one_minus(m) -> float:
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0:
        raise ValueError(f"momentum must be a number in [0, 1], got {m!r}")
    return round(1.0 - float(m), 12)  # 0.99 -> 0.01, not 0.010000000000000009


def _tuple(v, nd):
    return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * nd


def _torch_padding(m, nd):
    p = m.padding
    if isinstance(p, str):
        return "SAME" if p == "same" else ((0, 0),) * nd
    return tuple((int(x), int(x)) for x in _tuple(p, nd))


def _nnx_padding(m, nd):
    p = m.padding
    if isinstance(p, str):
        return "SAME" if p.upper() == "SAME" else (((0, 0),) * nd if p.upper() == "VALID"
                                                  else p.upper())
    if isinstance(p, int):
        return ((p, p),) * nd
    return tuple((int(x), int(x)) if isinstance(x, int) else (int(x[0]), int(x[1])) for x in p)


def _config_diffs(kind: str, t, n) -> list[str]:
    """Hyperparameters that make the two layers compute different things."""
    diffs = []

    def cmp(what, tv, nv, fix):
        if tv != nv:
            diffs.append(f"{what}: torch {tv!r} vs nnx {nv!r} ({fix})")

    if kind.startswith("conv"):
        nd = int(kind[4])
        cmp("stride", _tuple(t.stride, nd), _tuple(n.strides or 1, nd), "pass strides=")
        cmp("padding", _torch_padding(t, nd), _nnx_padding(n, nd),
            "pass padding= as an int or ((lo, hi), ...) pairs; torch's default is 0")
        cmp("dilation", _tuple(t.dilation, nd), _tuple(n.kernel_dilation or 1, nd),
            "pass kernel_dilation=")
        cmp("groups", int(t.groups), int(n.feature_group_count), "pass feature_group_count=")
        cmp("padding_mode", t.padding_mode, "zeros", "only zero padding converts")
        cmp("input_dilation", 1, max(_tuple(n.input_dilation or 1, nd)), "use 1")
    elif kind in ("batchnorm", "layernorm"):
        if not math.isclose(float(t.eps), float(n.epsilon), rel_tol=1e-9):
            diffs.append(f"epsilon: torch eps={t.eps!r} vs nnx epsilon={n.epsilon!r} "
                         f"(pass epsilon={t.eps!r} to the nnx layer)")
        if kind == "batchnorm":
            if t.momentum is None:
                diffs.append("momentum: torch momentum=None (cumulative average) has no "
                             "Flax equivalent; give torch a float momentum")
            elif not math.isclose(1.0 - float(t.momentum), float(n.momentum), abs_tol=1e-9):
                diffs.append(
                    f"momentum: torch momentum={t.momentum!r} means nnx momentum="
                    f"{torch_to_flax_momentum(t.momentum)!r}, got {n.momentum!r} (see "
                    f"jdist.testing.torch_to_flax_momentum)")
            if not t.track_running_stats:
                diffs.append("track_running_stats=False: torch then normalises with batch "
                             "statistics even in eval mode; Flax has no such mode")
    elif kind == "embedding" and t.max_norm is not None:
        diffs.append(f"max_norm: torch renormalises rows to max_norm={t.max_norm!r}; Flax "
                     f"has no equivalent")
    return diffs


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


def _check_configs(pairs, check_config: bool) -> None:
    if not check_config:
        return
    for t, n in pairs:
        diffs = _config_diffs(t.kind, t.module, n.module)
        if diffs:
            raise WeightConversionError(
                f"torch {t.describe()} and nnx {n.describe()} compute different things: "
                f"{'; '.join(diffs)}. Pass check_config=False to copy the weights anyway")


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
    ndim = {"linear": 2, "embedding": 2, "layernorm": 1}.get(kind) or int(kind[4]) + 2
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
