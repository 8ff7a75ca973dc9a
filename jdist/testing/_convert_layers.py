"""Which layers of a torch model and an NNX model pair up (see :mod:`jdist.testing._convert`).

The tables of convertible kinds and their arrays, each side's layers in definition
order, and the pairing with its count and kind checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flax import nnx

from jdist.errors import WeightConversionError
from jdist.testing._convert_rnn import GRU, LSTM
from jdist.testing._convert_transformer import TransformerEncoderLayer
from jdist.testing._embedding_bag import EmbeddingBag

# kinds whose sub-layers are paired on their own (the container only checks settings)
CONTAINERS = frozenset({"transformer_encoder_layer"})
SUPPORTED = ("Linear, Conv1d/2d/3d, BatchNorm, LayerNorm, Embedding, EmbeddingBag, "
             "MultiheadAttention, TransformerEncoderLayer, LSTM, GRU")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One convertible (or unsupported, ``kind=None``) layer of a model."""

    path: str
    kind: str | None
    module: Any
    type_name: str
    note: str = ""  # why an unsupported layer cannot be converted, and the fix

    def describe(self) -> str:
        return f"{self.path or '<root>'!r} ({self.type_name})"


# ------------------------------------------------------------------------ traversal


def _kind_in(m, table) -> str | None:
    """The kind of the first ``(class, kind)`` entry of ``table`` that ``m`` is an
    instance of (``None``: not a convertible layer)."""
    return next((kind for cls, kind in table if isinstance(m, cls)), None)


_NNX_KINDS = ((nnx.Linear, "linear"), (nnx.BatchNorm, "batchnorm"),
              (nnx.LayerNorm, "layernorm"), (nnx.Embed, "embedding"),
              (EmbeddingBag, "embeddingbag"), (nnx.MultiHeadAttention, "mha"),
              (LSTM, "lstm"), (GRU, "gru"),
              (TransformerEncoderLayer, "transformer_encoder_layer"))


def _nnx_kind(m) -> str | None:
    if isinstance(m, nnx.Conv) and len(m.kernel_size) in (1, 2, 3):
        return f"conv{len(m.kernel_size)}d"
    return _kind_in(m, _NNX_KINDS)


def _flax_recurrent_note(m) -> str:
    """Why Flax's own recurrent modules cannot hold a torch LSTM/GRU exactly ("" if not one)."""
    if isinstance(m, (nnx.LSTMCell, nnx.OptimizedLSTMCell)):
        return ("Flax's LSTM cells have one bias per gate where torch's LSTM has two "
                "(b_ih, b_hh), so torch's weights cannot be stored and recovered; build "
                "the nnx side with jdist.testing.LSTM")
    if isinstance(m, nnx.GRUCell):
        return ("nnx.GRUCell has no hidden-side biases, so torch's GRU b_hn (inside "
                "r * (W_hn h + b_hn)) has no place and b_hr, b_hz cannot be recovered "
                "once folded into the input biases; build the nnx side with "
                "jdist.testing.GRU")
    if isinstance(m, (nnx.RNN, nnx.Bidirectional, nnx.SimpleCell)):
        return ("Flax's RNN/Bidirectional/cells do not hold torch's recurrent arrays "
                "exactly; build the nnx side with jdist.testing.LSTM or jdist.testing.GRU")
    return ""


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
        kind, note = _nnx_kind(node), _flax_recurrent_note(node)
        if kind is not None or note:
            out.append(Layer(path, kind, node, type(node).__name__, note))
            if kind not in CONTAINERS:
                return
        children = [(k, v) for k, v in _attributes_in_definition_order(node)
                    if not k.startswith("_pytree__")]
        if kind is None and any(isinstance(v, nnx.Variable) for _, v in children):
            out.append(Layer(path, None, node, type(node).__name__))
        for k, v in children:
            if not isinstance(v, nnx.Variable):
                visit(v, join(path, k))

    visit(module, "")
    return out


def _torch_kind(m) -> str | None:
    from torch import nn

    return _kind_in(m, (
        (nn.Linear, "linear"), (nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d"),
        (nn.Conv3d, "conv3d"), (nn.modules.batchnorm._BatchNorm, "batchnorm"),
        (nn.LayerNorm, "layernorm"), (nn.Embedding, "embedding"),
        (nn.EmbeddingBag, "embeddingbag"), (nn.MultiheadAttention, "mha"),
        (nn.LSTM, "lstm"), (nn.GRU, "gru"),
        (nn.TransformerEncoderLayer, "transformer_encoder_layer")))


def torch_layers(module) -> list[Layer]:
    """The convertible layers of a torch module in ``named_modules()`` order."""
    from torch import nn

    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}: {module!r}")
    out = []
    inside: list[str] = []  # prefixes of layers converted whole (MultiheadAttention)
    for path, m in module.named_modules():
        if any(path.startswith(p + ".") or not p for p in inside):
            continue
        kind = _torch_kind(m)
        if kind is not None:
            out.append(Layer(path, kind, m, type(m).__name__))
            if kind not in CONTAINERS:
                inside.append(path)
        elif any(True for _ in m.parameters(recurse=False)) or \
                any(True for _ in m.buffers(recurse=False)):
            out.append(Layer(path, None, m, type(m).__name__))
    return out


def _pair(src: list[Layer], dst: list[Layer], src_name: str, dst_name: str, strict: bool):
    """Pair the i-th supported layer of each side; raise on unsupported, count, kind."""
    for side, layers in ((src_name, src), (dst_name, dst)):
        bad = [lay.describe() + (f" [{lay.note}]" if lay.note else "")
               for lay in layers if lay.kind is None]
        if bad and strict:
            raise WeightConversionError(
                f"{side} model has layers holding parameters that cannot be converted: "
                f"{', '.join(bad)}. Supported: {SUPPORTED}. Pass strict=False to skip "
                f"them (their weights are not copied)"
            )
    skipped = [f"{side} {lay.describe()} [{lay.note}]" for side, layers in
               ((src_name, src), (dst_name, dst)) for lay in layers if lay.note]
    src = [lay for lay in src if lay.kind is not None]
    dst = [lay for lay in dst if lay.kind is not None]

    def listing(layers):
        return ", ".join(f"#{i} {lay.describe()}" for i, lay in enumerate(layers)) or "none"

    if len(src) != len(dst):
        raise WeightConversionError(
            f"{src_name} model has {len(src)} convertible layers but {dst_name} model has "
            f"{len(dst)}; layers are paired in definition order.\n  {src_name}: "
            f"{listing(src)}\n  {dst_name}: {listing(dst)}"
            + "".join(f"\n  skipped: {k}" for k in skipped)
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
