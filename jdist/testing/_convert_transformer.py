"""An NNX counterpart of ``torch.nn.TransformerEncoderLayer`` (Flax has none).

Its sub-layers are defined in torch's order and of the kinds the converter pairs:
``self_attn`` (``nnx.MultiHeadAttention``), ``linear1``, ``linear2``, ``norm1``,
``norm2``, so :func:`jdist.testing.torch_to_nnx` copies a torch encoder layer into it
sub-layer by sub-layer, and checks the hyperparameters that are not weights
(``norm_first``, ``activation``, ``batch_first``, dropout rate, epsilons, heads).

Dropout is on until ``module.eval()`` (``nnx.Module.eval``), as in torch.
``activation`` is ``"relu"`` or ``"gelu"`` (the exact, erf form, as torch's
``"gelu"``). ``mask`` follows Flax: ``True`` where a query may attend to a key,
broadcastable to (batch, heads, query, key), e.g. ``nnx.make_causal_mask(ids)``. torch's
``src_mask`` is the opposite (``True`` = masked out); pass ``~torch_mask``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["TransformerEncoderLayer", "ACTIVATIONS"]

ACTIVATIONS = {"relu": jax.nn.relu, "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


class TransformerEncoderLayer(nnx.Module):
    """torch's encoder layer (post-norm by default, pre-norm with ``norm_first=True``)."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str = "relu", layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True, *,
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got "
                             f"{activation!r}")
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        drop_rngs = rngs if dropout else None  # no random state when there is no dropout
        # training mode by default, as torch and nnx.Dropout; .eval() turns dropout off
        self.self_attn = nnx.MultiHeadAttention(nhead, d_model, dropout_rate=dropout,
                                                use_bias=bias, decode=False,
                                                deterministic=False, **kw)
        self.linear1 = nnx.Linear(d_model, dim_feedforward, use_bias=bias, **kw)
        self.dropout = nnx.Dropout(dropout, rngs=drop_rngs)
        self.linear2 = nnx.Linear(dim_feedforward, d_model, use_bias=bias, **kw)
        self.norm1 = nnx.LayerNorm(d_model, epsilon=layer_norm_eps, use_bias=bias, **kw)
        self.norm2 = nnx.LayerNorm(d_model, epsilon=layer_norm_eps, use_bias=bias, **kw)
        self.dropout1 = nnx.Dropout(dropout, rngs=drop_rngs)
        self.dropout2 = nnx.Dropout(dropout, rngs=drop_rngs)
        self.activation = activation
        self.batch_first, self.norm_first = bool(batch_first), bool(norm_first)

    def _sa(self, x, mask):
        return self.dropout1(self.self_attn(x, mask=mask))

    def _ff(self, x):
        h = self.dropout(ACTIVATIONS[self.activation](self.linear1(x)))
        return self.dropout2(self.linear2(h))

    def __call__(self, src, mask=None):
        """``src`` (S, B, E), or (B, S, E) with ``batch_first=True``, or (S, E)."""
        x = src if self.batch_first or src.ndim == 2 else jnp.swapaxes(src, 0, 1)
        if self.norm_first:
            x = x + self._sa(self.norm1(x), mask)
            x = x + self._ff(self.norm2(x))
        else:
            x = self.norm1(x + self._sa(x, mask))
            x = self.norm2(x + self._ff(x))
        return x if self.batch_first or src.ndim == 2 else jnp.swapaxes(x, 0, 1)
