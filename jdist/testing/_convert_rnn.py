"""NNX counterparts of ``torch.nn.LSTM`` and ``torch.nn.GRU`` with torch's exact structure.

Flax's cells cannot hold a torch recurrent layer exactly: ``nnx.LSTMCell`` and
``nnx.OptimizedLSTMCell`` have one bias per gate where torch has two (``b_ih`` and
``b_hh``); ``nnx.GRUCell`` has no hidden-side bias at all, so torch's ``b_hn`` (inside
``r * (W_hn h + b_hn)``) has no place in it. Summing two biases computes the same
function but cannot be split back, so a round trip would not give torch's weights.
These modules keep every torch array:

* ``cells[k]`` for layer ``l`` and direction ``d`` (``k = l * num_directions + d``)
  holds ``kernel_ih`` (in, G * H), ``kernel_hh`` (H, G * H) and, with ``bias=True``,
  ``bias_ih`` and ``bias_hh`` (G * H), where G = 4 for LSTM (gates i, f, g, o) and
  3 for GRU (gates r, z, n), in torch's gate order: ``kernel_ih`` is torch's
  ``weight_ih_l{l}[_reverse]`` transposed.
* LSTM: ``c' = f * c + i * g``, ``h' = o * tanh(c')``. GRU: ``n = tanh(x W_in + b_in +
  r * (h W_hn + b_hn))`` (the hidden bias of the n gate inside ``r * (...)``, as torch),
  ``h' = (1 - z) * n + z * h``.

Calls take torch's arguments and layouts: ``x`` of shape (T, B, in), (B, T, in) with
``batch_first=True``, or unbatched (T, in); ``h0`` (and ``c0`` for LSTM, passed as a
pair ``(h0, c0)``) of shape (num_layers * num_directions, B, H), zeros when omitted.
They return ``(output, h_n)`` (GRU) or ``(output, (h_n, c_n))`` (LSTM). ``dropout``
applies between layers, as torch, unless the module is deterministic (``nnx.Dropout``).
Parameters start from U(-1/sqrt(H), 1/sqrt(H)) as torch's do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["LSTM", "GRU"]


class RNNCellParams(nnx.Module):
    """The arrays of one layer and direction (see module doc); no call of its own."""

    def __init__(self, in_features: int, hidden: int, gates: int, bias: bool, *,
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        bound = 1.0 / math.sqrt(hidden)

        def init(shape):
            return nnx.Param(jax.random.uniform(rngs.params(), shape, param_dtype,
                                                -bound, bound))

        self.kernel_ih = init((in_features, gates * hidden))
        self.kernel_hh = init((hidden, gates * hidden))
        self.bias_ih = init((gates * hidden,)) if bias else None
        self.bias_hh = init((gates * hidden,)) if bias else None


def _affine(x, kernel, bias):
    y = x @ kernel[...]
    return y if bias is None else y + bias[...]


def _lstm_step(cell):
    def step(carry, xp):
        h, c = carry
        i, f, g, o = jnp.split(xp + _affine(h, cell.kernel_hh, cell.bias_hh), 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h
    return step


def _gru_step(cell):
    def step(h, xp):
        xr, xz, xn = jnp.split(xp, 3, axis=-1)
        hr, hz, hn = jnp.split(_affine(h, cell.kernel_hh, cell.bias_hh), 3, axis=-1)
        r = jax.nn.sigmoid(xr + hr)
        z = jax.nn.sigmoid(xz + hz)
        n = jnp.tanh(xn + r * hn)
        h = (1.0 - z) * n + z * h
        return h, h
    return step


class _TorchRNN(nnx.Module):
    """Shared by :class:`LSTM` and :class:`GRU` (``GATES``, ``_step``, carry layout)."""

    GATES = 0

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, *,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, rngs: nnx.Rngs, param_dtype=jnp.float32):
        if num_layers < 1 or hidden_size < 1 or input_size < 1:
            raise ValueError(f"input_size, hidden_size and num_layers must be >= 1, got "
                             f"{input_size}, {hidden_size}, {num_layers}")
        self.input_size, self.hidden_size = int(input_size), int(hidden_size)
        self.num_layers, self.bias = int(num_layers), bool(bias)
        self.batch_first, self.bidirectional = bool(batch_first), bool(bidirectional)
        self.dropout = float(dropout)
        dirs = 2 if bidirectional else 1
        self.cells = nnx.List([
            RNNCellParams(input_size if layer == 0 else hidden_size * dirs, hidden_size,
                          self.GATES, bias, rngs=rngs, param_dtype=param_dtype)
            for layer in range(num_layers) for _ in range(dirs)])
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def _zeros(self, x):
        dirs = 2 if self.bidirectional else 1
        return jnp.zeros((self.num_layers * dirs, x.shape[1], self.hidden_size), x.dtype)

    def _run(self, x, carries):
        """x (T, B, in); carries: one per cell. Returns (output, final carries)."""
        dirs = 2 if self.bidirectional else 1
        finals = []
        for layer in range(self.num_layers):
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                cell = self.cells[k]
                xp = _affine(x, cell.kernel_ih, cell.bias_ih)
                carry, ys = jax.lax.scan(self._step(cell), carries[k], xp, reverse=bool(d))
                finals.append(carry)
                outs.append(ys)
            x = jnp.concatenate(outs, axis=-1) if dirs == 2 else outs[0]
            if self.drop is not None and layer < self.num_layers - 1:
                x = self.drop(x)
        return x, finals

    def _layout_in(self, x):
        unbatched = x.ndim == 2
        if unbatched:
            x = x[:, None]
        elif self.batch_first:
            x = jnp.swapaxes(x, 0, 1)
        return x, unbatched

    def _layout_out(self, y, unbatched):
        if unbatched:
            return y[:, 0]
        return jnp.swapaxes(y, 0, 1) if self.batch_first else y


def _state_in(h, unbatched):
    return h[:, None] if unbatched else h


def _state_out(h, unbatched):
    return h[:, 0] if unbatched else h


class LSTM(_TorchRNN):
    """torch ``nn.LSTM`` in NNX, array for array (module doc). ``proj_size`` is not
    supported."""

    GATES = 4

    def _step(self, cell):
        return _lstm_step(cell)

    def __call__(self, x, hc=None):
        x, unbatched = self._layout_in(x)
        if hc is None:
            h0 = c0 = self._zeros(x)
        else:
            h0, c0 = (_state_in(a, unbatched) for a in hc)
        y, finals = self._run(x, [(h0[k], c0[k]) for k in range(h0.shape[0])])
        hn = jnp.stack([h for h, _ in finals])
        cn = jnp.stack([c for _, c in finals])
        return (self._layout_out(y, unbatched),
                (_state_out(hn, unbatched), _state_out(cn, unbatched)))


class GRU(_TorchRNN):
    """torch ``nn.GRU`` in NNX, array for array (module doc)."""

    GATES = 3

    def _step(self, cell):
        return _gru_step(cell)

    def __call__(self, x, h0=None):
        x, unbatched = self._layout_in(x)
        h0 = self._zeros(x) if h0 is None else _state_in(h0, unbatched)
        y, finals = self._run(x, [h0[k] for k in range(h0.shape[0])])
        return self._layout_out(y, unbatched), _state_out(jnp.stack(finals), unbatched)
