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

=========================================  ===========================  =========================
torch                                      flax.nnx (or jdist.testing)  arrays
=========================================  ===========================  =========================
``Linear``                                 ``Linear``                   kernel = weight.T
``Conv1d`` / ``Conv2d`` / ``Conv3d``       ``Conv``                     OI[D]HW <-> [D]HWIO
``BatchNorm1d/2d/3d``, ``SyncBatchNorm``   ``BatchNorm``                scale, bias, mean, var
``LayerNorm``                              ``LayerNorm``                scale, bias
``Embedding``                              ``Embed``                    embedding = weight
``EmbeddingBag``                           ``EmbeddingBag``             embedding = weight
``MultiheadAttention``                     ``MultiHeadAttention``       q/k/v/out kernels by head
``TransformerEncoderLayer``                ``TransformerEncoderLayer``  its sub-layers, paired
``LSTM``, ``GRU``                          ``LSTM``, ``GRU``            kernel_ih = weight_ih.T
=========================================  ===========================  =========================

The NNX ``EmbeddingBag`` is jdist's (:class:`jdist.testing.EmbeddingBag`; Flax has none);
its ``mode``, ``include_last_offset`` and ``padding_idx`` must match torch's.

``MultiheadAttention``: ``in_proj_weight`` (packed, when kdim == vdim == embed_dim) or
``q/k/v_proj_weight`` (separate; nnx ``in_kv_features=kdim``) -> ``query``/``key``/
``value`` kernels (in, heads, head_dim); ``out_proj`` -> ``out`` (heads, head_dim, E).
kdim != vdim, ``add_bias_kv``, ``add_zero_attn`` have no Flax counterpart and raise.
``batch_first`` is a call matter (Flax attention is always batch first).

``TransformerEncoderLayer``, ``LSTM``, ``GRU``: Flax has no exact counterpart (its LSTM
cells hold one bias per gate where torch has two; ``nnx.GRUCell`` lacks ``b_hr``/
``b_hz``), so the NNX side is :class:`jdist.testing.TransformerEncoderLayer`,
:class:`jdist.testing.LSTM`, :class:`jdist.testing.GRU`, which keep every torch array
(gate order i, f, g, o and r, z, n; GRU's ``b_hn`` inside ``r * (...)``). Flax's
``nnx.LSTMCell``/``OptimizedLSTMCell``/``GRUCell``/``RNN`` are reported as unsupported
with that fix. The encoder layer is a container: its settings (``norm_first``,
``activation``, ``batch_first``, dropout) are checked, its sub-layers pair as usual.
Every array of a paired layer must have a counterpart (else an error lists them).

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
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.errors import WeightConversionError
from jdist.testing._convert_arrays import LAYOUT, ArrayMap, array_maps, get_path, take_chunk
from jdist.testing._convert_arrays import torch_names as _torch_names
from jdist.testing._convert_config import _check_configs
from jdist.testing._convert_config import flax_to_torch_momentum as flax_to_torch_momentum
from jdist.testing._convert_config import torch_to_flax_momentum as torch_to_flax_momentum
from jdist.testing._convert_layers import CONTAINERS, Layer, _pair
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


def _rows(layer: Layer) -> list[ArrayMap]:
    return array_maps(layer.kind, layer.module)


def _nnx_var(layer: Layer, attr: str):
    var = get_path(layer.module, attr)
    return var if isinstance(var, nnx.Variable) else None


def _nnx_get(layer: Layer, attr: str):
    var = _nnx_var(layer, attr)
    return None if var is None else np.asarray(var.get_value())


def _layout(kind) -> str:
    return LAYOUT.get(kind, "same layout")


def _nnx_prepare(layer: Layer, row: ArrayMap, value: np.ndarray, src_desc: str):
    """``(variable, new value)`` after the shape check (nothing is written yet)."""
    var = _nnx_var(layer, row.attr)
    old = var.get_value()
    part = "" if row.chunk is None else f" part {row.chunk[0] + 1} of {row.chunk[1]}"
    try:
        new = row.to_nnx(value)
    except ValueError:  # a reshape into heads that does not divide
        new = value
    if tuple(new.shape) != tuple(old.shape):
        raise WeightConversionError(
            f"shape mismatch: torch {src_desc} '{row.tname}'{part} gives "
            f"{tuple(new.shape)} after conversion ({_layout(layer.kind)}) but nnx "
            f"{layer.describe()} '{row.attr}' has {tuple(old.shape)}; build both layers "
            f"with the same sizes")
    return var, jnp.array(new, dtype=old.dtype, copy=True)


def _missing(strict, side, desc, name, other_side, other_desc, other_name, optional=True):
    if not optional:
        raise WeightConversionError(
            f"{side} {desc} has '{name}' but {other_side} {other_desc} has no "
            f"'{other_name}': the two layers are built differently (e.g. packed vs "
            f"separate q/k/v projections: torch kdim/vdim vs nnx in_kv_features); build "
            f"both alike")
    if strict:
        raise WeightConversionError(
            f"{side} {desc} has '{name}' but {other_side} {other_desc} has no "
            f"'{other_name}' (a bias or affine parameter is enabled on one side only); "
            f"construct both alike (e.g. use_bias=/bias=, use_scale=/affine=) or pass "
            f"strict=False to leave it alone")


def _nnx_writes(get: Callable[[str], Any], src_desc: str, layer: Layer, strict: bool):
    """Checked ``(variable, value)`` writes for one layer; ``get(torch name)`` reads the
    source (a torch module's array or a state_dict entry, ``None`` when absent)."""
    writes = []
    for row in _rows(layer):
        full = get(row.tname)
        tv = None if full is None else take_chunk(_to_numpy(full), row, f"torch {src_desc}")
        has_n = _nnx_var(layer, row.attr) is not None
        if tv is None and has_n:
            _missing(strict, "nnx", layer.describe(), row.attr, "torch", src_desc, row.tname,
                     row.optional)
        elif tv is not None and not has_n:
            _missing(strict, "torch", src_desc, row.tname, "nnx", layer.describe(), row.attr,
                     row.optional)
        elif tv is not None:
            writes.append(_nnx_prepare(layer, row, tv, src_desc))
    return writes


def _apply(writes) -> None:
    """Write only after every layer passed its checks, so a failed copy changes nothing."""
    for var, value in writes:
        var.set_value(value)


def _arrays_from_nnx(layer: Layer) -> dict[str, np.ndarray | None]:
    """Torch name -> array in torch's layout (q/k/v parts joined); ``None`` if absent."""
    parts: dict[str, list] = {}
    for row in _rows(layer):
        v = _nnx_get(layer, row.attr)
        parts.setdefault(row.tname, []).append(None if v is None else row.to_torch(v))
    return {name: None if any(p is None for p in ps) else
            (ps[0] if len(ps) == 1 else np.concatenate(ps, axis=0))
            for name, ps in parts.items()}


def _required(layer: Layer) -> set[str]:
    return {row.tname for row in _rows(layer) if not row.optional}


def _to_torch_tensor(value: np.ndarray, like):
    import torch

    if value.dtype.name == "bfloat16" or value.dtype.kind not in "fiub":
        value = value.astype(np.float32)
    t = torch.from_numpy(np.array(value, copy=True))
    return t.to(dtype=like.dtype, device=like.device) if like is not None else t


def _nnx_uncovered(n: Layer) -> list[str]:
    known = {row.attr for row in _rows(n)}
    flat = nnx.to_flat_state(nnx.state(n.module, (nnx.Param, nnx.BatchStat)))
    return [k for k in (".".join(map(str, p)) for p, _ in flat) if k not in known]


def _check_covered(t: Layer | None, n: Layer) -> None:
    """Every array of a paired layer must have a row: a torch LSTM with more layers, an
    attention with ``add_bias_kv``, a Flax attention with ``normalize_qk`` would
    otherwise lose arrays silently. ``t=None``: the nnx side only (a state_dict)."""
    if n.kind in CONTAINERS:
        return
    known_t = set(_torch_names(_rows(n))) | {"num_batches_tracked"}
    extra_t = [] if t is None else [
        k for k, _ in list(t.module.named_parameters()) + list(t.module.named_buffers())
        if k not in known_t]
    extra_n = _nnx_uncovered(n)
    if extra_t or extra_n:
        where = "torch state_dict" if t is None else f"torch {t.describe()}"
        raise WeightConversionError(
            f"{where} and nnx {n.describe()} are built differently: arrays with no "
            f"counterpart: torch {extra_t}, nnx {extra_n} ({_layout(n.kind)}); build both "
            f"alike (same num_layers/bidirectional, no add_bias_kv/proj_size/normalize_qk)")


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
    for t, n in pairs:
        _check_covered(t, n)
    writes = []
    for t, n in pairs:
        writes += _nnx_writes(lambda name, m=t.module: get_path(m, name), t.describe(), n,
                              strict)
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
    for n, t in pairs:
        _check_covered(t, n)
    writes = []  # checked first, written after, so a failed copy changes nothing
    for n, t in pairs:
        attrs = {row.tname: row.attr for row in _rows(n)}
        required = _required(n)
        for tname, value in _arrays_from_nnx(n).items():
            target, attr = get_path(t.module, tname), attrs[tname]
            opt = tname not in required
            if value is None and target is not None:
                _missing(strict, "torch", t.describe(), tname, "nnx", n.describe(), attr, opt)
            elif value is not None and target is None:
                _missing(strict, "nnx", n.describe(), attr, "torch", t.describe(), tname, opt)
            elif value is not None:
                if tuple(value.shape) != tuple(target.shape):
                    raise WeightConversionError(
                        f"shape mismatch: nnx {n.describe()} '{attr}' gives "
                        f"{tuple(value.shape)} after conversion ({_layout(n.kind)}) but "
                        f"torch {t.describe()} '{tname}' has {tuple(target.shape)}; build "
                        f"both layers with the same sizes")
                writes.append((target, _to_torch_tensor(value, target)))
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    return torch_module


def _state_dict_groups(state_dict: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Keys grouped by module prefix, in order; a group nested in the previous one joins
    it (``attn.out_proj.weight`` belongs to the attention ``attn``, key
    ``out_proj.weight``)."""
    groups: OrderedDict[str, dict[str, Any]] = OrderedDict()
    for key, value in state_dict.items():
        prefix, _, name = key.rpartition(".")
        last = next(reversed(groups), None)
        if last is not None and prefix != last and (last == "" or
                                                    prefix.startswith(last + ".")):
            prefix, name = last, key[len(last) + 1:] if last else key
        groups.setdefault(prefix, {})[name] = value
    return list(groups.items())


def _group_kind_ok(layer: Layer, arrays: Mapping[str, Any]) -> bool:
    kind, names = layer.kind, set(arrays)
    allowed = set(_torch_names(_rows(layer))) | ({"num_batches_tracked"}
                                                  if kind == "batchnorm" else set())
    if not names <= allowed or not _required(layer) <= names:
        return False
    if kind == "batchnorm":
        return {"running_mean", "running_var"} <= names
    ndim = {"linear": 2, "embedding": 2, "embeddingbag": 2, "layernorm": 1,
            "conv1d": 3, "conv2d": 4, "conv3d": 5}.get(kind)
    return ndim is None or np.ndim(_to_numpy(arrays["weight"])) == ndim


def _nnx_layers_with_arrays(nnx_module, strict: bool) -> list[Layer]:
    """Convertible NNX layers that hold arrays (a state_dict has no entry for the others)."""
    layers = nnx_layers(nnx_module)
    bad = [lay.describe() for lay in layers if lay.kind is None]
    if bad and strict:
        raise WeightConversionError(
            f"nnx model has layers holding parameters that cannot be converted: "
            f"{', '.join(bad)}; pass strict=False to skip them")
    out = [lay for lay in layers if lay.kind is not None
           and any(_nnx_get(lay, row.attr) is not None for row in _rows(lay))]
    for lay in out:
        _check_covered(None, lay)
    return out


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
        if not _group_kind_ok(layer, arrays):
            raise WeightConversionError(
                f"layer #{i}: state_dict entries {prefix!r} {sorted(arrays)} do not look like "
                f"a {layer.kind} as nnx {layer.describe()} expects (names or weight rank "
                f"differ); both models must define the same layers in the same order")
        writes += _nnx_writes(arrays.get, repr(prefix), layer, strict)
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
        if not _group_kind_ok(layer, arrays):
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
