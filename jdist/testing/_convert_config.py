"""Hyperparameters that make a torch layer and its NNX pair compute different things.

Checked by the converters in :mod:`jdist.testing._convert` (``check_config=True``), and
BatchNorm momentum between the two conventions.
"""

from __future__ import annotations

import math

from jdist.errors import WeightConversionError


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
    elif kind == "embeddingbag":
        cmp("mode", t.mode, n.mode, f"pass mode={t.mode!r} to the nnx EmbeddingBag")
        cmp("include_last_offset", bool(t.include_last_offset), bool(n.include_last_offset),
            "pass the same include_last_offset")
        cmp("padding_idx", t.padding_idx, n.padding_idx, "pass the same padding_idx")
        if t.max_norm is not None:
            diffs.append(f"max_norm: torch renormalises rows to max_norm={t.max_norm!r}; "
                         f"the nnx EmbeddingBag has no equivalent")
        if t.scale_grad_by_freq:
            diffs.append("scale_grad_by_freq=True: torch scales gradients by index "
                         "frequency; the nnx EmbeddingBag does not")
    elif kind == "embedding" and t.max_norm is not None:
        diffs.append(f"max_norm: torch renormalises rows to max_norm={t.max_norm!r}; Flax "
                     f"has no equivalent")
    elif kind in _COMPOSITE:
        diffs += _COMPOSITE[kind](t, n)
    return diffs


def _cmp(diffs, what, tv, nv, fix):
    if tv != nv:
        diffs.append(f"{what}: torch {tv!r} vs nnx {nv!r} ({fix})")


def _mha_diffs(t, n) -> list[str]:
    d: list[str] = []
    _cmp(d, "num_heads", int(t.num_heads), int(n.num_heads), "pass the same head count")
    _cmp(d, "embed_dim", int(t.embed_dim), int(n.in_features), "in_features=embed_dim")
    _cmp(d, "qkv_features", int(t.embed_dim), int(n.qkv_features),
         "torch projects q/k/v to embed_dim; leave qkv_features unset")
    _cmp(d, "out_features", int(t.embed_dim), int(n.out_features), "leave out_features unset")
    if t.kdim != t.vdim:
        d.append(f"kdim={t.kdim!r} vs vdim={t.vdim!r}: nnx.MultiHeadAttention projects keys "
                 f"and values from one in_kv_features; give torch kdim == vdim")
    else:
        _cmp(d, "kdim/vdim", int(t.kdim), int(n.in_kv_features), "pass in_kv_features=kdim")
    _cmp(d, "num_kv_heads", int(n.num_heads), int(n.num_kv_heads),
         "torch has no grouped-query attention; leave num_kv_heads unset")
    _cmp(d, "dropout", float(t.dropout), float(n.dropout_rate), "pass dropout_rate=")
    if t.add_zero_attn:
        d.append("add_zero_attn=True: nnx.MultiHeadAttention has no zero attention row; "
                 "use add_zero_attn=False")
    if n.normalize_qk:
        d.append("normalize_qk=True: torch has no q/k LayerNorm; use normalize_qk=False")
    return d


def _rnn_diffs(t, n) -> list[str]:
    d: list[str] = []
    for what in ("input_size", "hidden_size", "num_layers"):
        _cmp(d, what, int(getattr(t, what)), int(getattr(n, what)), f"pass the same {what}")
    for what in ("bidirectional", "batch_first", "bias"):
        _cmp(d, what, bool(getattr(t, what)), bool(getattr(n, what)), f"pass the same {what}")
    _cmp(d, "dropout", float(t.dropout), float(n.dropout), "pass the same dropout")
    if getattr(t, "proj_size", 0):
        d.append(f"proj_size={t.proj_size!r}: jdist.testing.LSTM has no projection; use "
                 f"proj_size=0")
    return d


def _torch_activation(a) -> str:
    """``"relu"``/``"gelu"`` for torch's encoder-layer activation, else its repr."""
    import torch.nn.functional as F
    from torch import nn

    if a is F.relu or isinstance(a, nn.ReLU):
        return "relu"
    if a is F.gelu or (isinstance(a, nn.GELU) and a.approximate == "none"):
        return "gelu"
    return repr(a)


def _encoder_diffs(t, n) -> list[str]:
    d: list[str] = []
    _cmp(d, "activation", _torch_activation(t.activation), n.activation,
         "jdist.testing.TransformerEncoderLayer takes activation='relu' or 'gelu'")
    _cmp(d, "norm_first", bool(t.norm_first), bool(n.norm_first), "pass the same norm_first")
    _cmp(d, "batch_first", bool(t.self_attn.batch_first), bool(n.batch_first),
         "pass the same batch_first")
    _cmp(d, "dropout", float(t.dropout.p), float(n.dropout.rate), "pass the same dropout")
    return d


_COMPOSITE = {"mha": _mha_diffs, "lstm": _rnn_diffs, "gru": _rnn_diffs,
              "transformer_encoder_layer": _encoder_diffs}


def _check_configs(pairs, check_config: bool) -> None:
    if not check_config:
        return
    for t, n in pairs:
        diffs = _config_diffs(t.kind, t.module, n.module)
        if diffs:
            raise WeightConversionError(
                f"torch {t.describe()} and nnx {n.describe()} compute different things: "
                f"{'; '.join(diffs)}. Pass check_config=False to copy the weights anyway")
