"""Which arrays of a torch layer map to which arrays of its NNX pair, and how.

:func:`array_maps` gives, for one NNX layer of a known kind, a list of :class:`ArrayMap`
rows. The table is derived from the NNX layer alone (its sizes say how many LSTM
layers there are, whether attention projections are packed), so it also serves the
``state_dict`` functions, which have no torch module.

A row maps one torch array, or one equal slice of it along axis 0 (``chunk``), to one
NNX variable: torch ``MultiheadAttention.in_proj_weight`` is three rows, its q, k and
v thirds. Paths are dotted on both sides (``"out_proj.weight"``, ``"cells.0.kernel_ih"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jdist.errors import WeightConversionError


@dataclasses.dataclass(frozen=True)
class ArrayMap:
    """One torch array (or slice) <-> one NNX variable of a layer pair."""

    tname: str  # dotted path under the torch layer
    attr: str  # dotted path under the NNX layer
    to_nnx: Callable[[np.ndarray], np.ndarray]
    to_torch: Callable[[np.ndarray], np.ndarray]
    chunk: tuple[int, int] | None = None  # (i, n): the i-th of n equal slices, axis 0
    optional: bool = True  # may be absent on both sides (a bias, affine parameters)


def _same(a):
    return a


def _transpose(a):
    return np.ascontiguousarray(np.transpose(a))


def _conv_maps(nd: int):
    to_nnx = tuple(range(2, nd + 2)) + (1, 0)  # O I *S -> *S I O
    to_torch = tuple(int(i) for i in np.argsort(to_nnx))
    return (lambda a: np.ascontiguousarray(np.transpose(a, to_nnx)),
            lambda a: np.ascontiguousarray(np.transpose(a, to_torch)))


def _simple(*rows) -> list[ArrayMap]:
    return [ArrayMap(t, a, f, g, optional=opt) for t, a, f, g, opt in rows]


_CONV = {nd: _conv_maps(nd) for nd in (1, 2, 3)}
_FIXED = {
    "linear": _simple(("weight", "kernel", _transpose, _transpose, False),
                      ("bias", "bias", _same, _same, True)),
    "batchnorm": _simple(("weight", "scale", _same, _same, True),
                         ("bias", "bias", _same, _same, True),
                         ("running_mean", "mean", _same, _same, True),
                         ("running_var", "var", _same, _same, True)),
    "layernorm": _simple(("weight", "scale", _same, _same, True),
                         ("bias", "bias", _same, _same, True)),
    "embedding": _simple(("weight", "embedding", _same, _same, False)),
    "embeddingbag": _simple(("weight", "embedding", _same, _same, False)),
    "transformer_encoder_layer": [],  # a container: its sub-layers pair on their own
}
for _nd, (_to_nnx, _to_torch) in _CONV.items():
    _FIXED[f"conv{_nd}d"] = _simple(("weight", "kernel", _to_nnx, _to_torch, False),
                                    ("bias", "bias", _same, _same, True))

LAYOUT = {
    "linear": "torch (out, in) <-> nnx (in, out)",
    "conv1d": "torch (O, I, W) <-> nnx (W, I, O)",
    "conv2d": "torch (O, I, H, W) <-> nnx (H, W, I, O)",
    "conv3d": "torch (O, I, D, H, W) <-> nnx (D, H, W, I, O)",
    "mha": "torch in_proj_weight (3E, E) = [q; k; v] rows, out_proj.weight (E, E) <-> nnx "
           "query/key/value kernel (in, heads, head_dim), out kernel (heads, head_dim, E)",
    "lstm": "torch weight_ih_l{k} (4H, in), gates i, f, g, o <-> nnx cells.{k}.kernel_ih "
            "(in, 4H), same gate order",
    "gru": "torch weight_ih_l{k} (3H, in), gates r, z, n <-> nnx cells.{k}.kernel_ih "
           "(in, 3H), same gate order",
}


# --------------------------------------------------------------- multi-head attention


def _heads_in(heads: int):
    """torch (out, in) projection -> nnx (in, heads, head_dim) kernel, and back."""
    return (lambda a: np.ascontiguousarray(a.T.reshape(a.shape[1], heads, -1)),
            lambda k: np.ascontiguousarray(k.reshape(k.shape[0], -1).T))


def _heads_bias(heads: int):
    return (lambda a: np.ascontiguousarray(a.reshape(heads, -1)),
            lambda b: np.ascontiguousarray(b.reshape(-1)))


def _heads_out(heads: int):
    """torch out_proj (E, heads * head_dim) -> nnx (heads, head_dim, E), and back."""
    return (lambda a: np.ascontiguousarray(a.T.reshape(heads, -1, a.shape[0])),
            lambda k: np.ascontiguousarray(k.reshape(-1, k.shape[-1]).T))


def _mha_maps(n) -> list[ArrayMap]:
    """torch packs q/k/v in ``in_proj_weight`` iff kdim == vdim == embed_dim, which on
    the nnx side (one ``in_kv_features`` for keys and values) is in_kv == in."""
    h = int(n.num_heads)
    kin, kout = _heads_in(h)
    bin_, bout = _heads_bias(h)
    oin, oout = _heads_out(h)
    rows = []
    packed = int(n.in_kv_features) == int(n.in_features)
    for i, (sep, attr) in enumerate((("q", "query"), ("k", "key"), ("v", "value"))):
        if packed:
            rows.append(ArrayMap("in_proj_weight", f"{attr}.kernel", kin, kout, (i, 3), False))
        else:
            rows.append(ArrayMap(f"{sep}_proj_weight", f"{attr}.kernel", kin, kout,
                                 optional=False))
    rows += [ArrayMap("in_proj_bias", f"{attr}.bias", bin_, bout, (i, 3))
             for i, attr in enumerate(("query", "key", "value"))]
    rows += [ArrayMap("out_proj.weight", "out.kernel", oin, oout, optional=False),
             ArrayMap("out_proj.bias", "out.bias", _same, _same)]
    return rows


# ------------------------------------------------------------------------ LSTM / GRU


def rnn_suffix(layer: int, direction: int) -> str:
    """torch's parameter suffix for one layer and direction (``_l1_reverse``)."""
    return f"_l{layer}" + ("_reverse" if direction else "")


def _rnn_maps(n) -> list[ArrayMap]:
    dirs = 2 if n.bidirectional else 1
    rows = []
    for layer in range(int(n.num_layers)):
        for d in range(dirs):
            sfx, cell = rnn_suffix(layer, d), f"cells.{layer * dirs + d}"
            rows += [ArrayMap(f"weight_ih{sfx}", f"{cell}.kernel_ih", _transpose, _transpose,
                              optional=False),
                     ArrayMap(f"weight_hh{sfx}", f"{cell}.kernel_hh", _transpose, _transpose,
                              optional=False),
                     ArrayMap(f"bias_ih{sfx}", f"{cell}.bias_ih", _same, _same),
                     ArrayMap(f"bias_hh{sfx}", f"{cell}.bias_hh", _same, _same)]
    return rows


_DERIVED = {"mha": _mha_maps, "lstm": _rnn_maps, "gru": _rnn_maps}


def array_maps(kind: str, nnx_module) -> list[ArrayMap]:
    """The rows for an NNX layer of ``kind`` (see module doc)."""
    if kind in _DERIVED:
        return _DERIVED[kind](nnx_module)
    return _FIXED[kind]


# --------------------------------------------------------------------- path access


def get_path(obj, path: str):
    """``obj.a.0.b`` by a dotted path (digits index lists); ``None`` when absent."""
    for part in path.split("."):
        if obj is None:
            return None
        if part.isdigit() and not hasattr(obj, part):
            try:
                obj = obj[int(part)]
            except (IndexError, KeyError, TypeError):
                return None
        else:
            obj = getattr(obj, part, None)
    return obj


def take_chunk(value: Any, row: ArrayMap, where: str):
    """The row's slice of a torch array (a view for tensors, so writes go through)."""
    if row.chunk is None or value is None:
        return value
    i, n = row.chunk
    rows = value.shape[0]
    if rows % n:
        raise WeightConversionError(
            f"{where} '{row.tname}' has {rows} rows along axis 0, not divisible into {n} "
            f"equal parts (q, k, v); build both layers with the same sizes")
    step = rows // n
    return value[i * step:(i + 1) * step]


def torch_names(rows: list[ArrayMap]) -> list[str]:
    """Distinct torch names of the rows, in order."""
    return list(dict.fromkeys(r.tname for r in rows))
