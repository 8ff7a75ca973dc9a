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
    return diffs


def _check_configs(pairs, check_config: bool) -> None:
    if not check_config:
        return
    for t, n in pairs:
        diffs = _config_diffs(t.kind, t.module, n.module)
        if diffs:
            raise WeightConversionError(
                f"torch {t.describe()} and nnx {n.describe()} compute different things: "
                f"{'; '.join(diffs)}. Pass check_config=False to copy the weights anyway")
