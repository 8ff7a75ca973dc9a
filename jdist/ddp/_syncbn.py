"""SyncBatchNorm: BatchNorm statistics over all replicas, weighted by their row counts.

torch's ``SyncBatchNorm`` all-gathers each rank's count, mean and variance, so ranks
with fewer rows (or none: an empty batch) weigh less (or nothing). NNX's ``BatchNorm``
with ``axis_name`` averages each replica's mean with ``lax.pmean`` instead, which is
exact only for equal shares, and an empty share (or one fully masked) makes every
replica's statistics NaN. :class:`SyncBatchNorm` sums each replica's masked count, sum
and sum of squares over the replica axis and divides once, so its statistics are those
of the rows that count on every replica: equal shares (DDP's even split) give the plain
global-batch BatchNorm, and under ``train_step(pad_batch_to=...)`` the padding rows of
the step's row mask (:func:`jdist.ddp._padding.current_row_mask`) do not count. A step
in which no replica has a row keeps the running statistics. In eval mode
(``use_running_average=True``) nothing is communicated, as in torch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jdist.collectives.runtime import ProcessGroup, resolve_group
from jdist.ddp._padding import current_row_mask

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _axes(ndim: int, axis: Any) -> tuple[int, ...]:
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(sorted(a % ndim for a in axes))


def _abs_sq(x):
    return (x * jnp.conj(x)).real if jnp.iscomplexobj(x) else x * x


class SyncBatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` whose training statistics are count-weighted over ``axis_name``.

    Made by :func:`convert_sync_batchnorm` (or directly, with ``axis_name`` set); the
    arguments and Variables are ``nnx.BatchNorm``'s. ``mask`` (broadcastable to ``x``)
    marks the positions that count; without one, inside a padded DDP step the step's
    row mask is used (``x``'s leading axis must then be the step's rows).
    """

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        running = (use_running_average if use_running_average is not None
                   else self.use_running_average)
        if running or self.axis_name is None:
            return super().__call__(x, use_running_average, mask=mask)
        feature_axes = _axes(x.ndim, self.axis)
        red = tuple(i for i in range(x.ndim) if i not in feature_axes)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, ra_mean, ra_var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype)
        mean, var, count = self._stats(x, red, self._mask(x, mask))
        keep = count > 0  # no row anywhere: the running statistics stay
        m = self.momentum
        self.mean[...] = jax.lax.stop_gradient(
            jnp.where(keep, m * ra_mean + (1 - m) * mean, ra_mean))
        self.var[...] = jax.lax.stop_gradient(
            jnp.where(keep, m * ra_var + (1 - m) * var, ra_var))
        shape = [1 if i in red else x.shape[i] for i in range(x.ndim)]
        mul = jax.lax.rsqrt(var.reshape(shape) + self.epsilon)
        if scale is not None:
            mul = mul * scale.reshape(shape)
        y = (x - mean.reshape(shape)) * mul
        if bias is not None:
            y = y + bias.reshape(shape)
        args = [a for a in (x, scale, bias) if a is not None]
        return jnp.asarray(y, self.dtype or jnp.result_type(*args))

    def _mask(self, x, mask):
        if mask is None:
            rows = current_row_mask()
            if rows is None:
                return None
            if x.ndim == 0 or x.shape[0] != rows.shape[0]:
                raise ValueError(
                    f"SyncBatchNorm got an input of shape {tuple(x.shape)} inside a padded "
                    f"DDP step whose batch has {rows.shape[0]} rows per replica, so it "
                    "cannot tell the padding rows apart; pass mask=... (broadcastable to "
                    "the input, true where a position counts) to the layer")
            mask = rows.reshape((-1,) + (1,) * (x.ndim - 1)) > 0
        return jnp.broadcast_to(mask, x.shape)

    def _stats(self, x, red, mask):
        """Count-weighted mean and variance over ``red`` and every replica, and the
        count (per feature)."""
        dtype = jnp.promote_types(self.dtype or jnp.result_type(x), jnp.float32)
        x = jnp.asarray(x, dtype)
        w = jnp.ones(x.shape, dtype.type(0).real.dtype) if mask is None else mask.astype(
            jnp.float32)

        def psum(v):
            return jax.lax.psum(v, self.axis_name, axis_index_groups=self.axis_index_groups)

        count = jnp.sum(w, red)
        if self.use_fast_variance:
            count, s1, s2 = psum((count, jnp.sum(x * w, red), jnp.sum(_abs_sq(x) * w, red)))
            n = jnp.maximum(count, 1.0)
            mean = s1 / n
            return mean, jnp.maximum(0.0, s2 / n - _abs_sq(mean)), count
        count, s1 = psum((count, jnp.sum(x * w, red)))
        n = jnp.maximum(count, 1.0)
        mean = s1 / n
        shape = [1 if i in red else x.shape[i] for i in range(x.ndim)]
        s2 = psum(jnp.sum(_abs_sq(x - mean.reshape(shape)) * w, red))
        return mean, s2 / n, count


def convert_sync_batchnorm(module: nnx.Module, process_group: ProcessGroup | None = None
                           ) -> nnx.Module:
    """Make every ``nnx.BatchNorm`` in ``module`` a :class:`SyncBatchNorm` over the
    group's replicas.

    Unlike torch, which builds new ``SyncBatchNorm`` modules sharing the parameters, the
    NNX layers are converted in place (same Variables, their ``axis_name`` set to the
    group's axis) and ``module`` itself is returned. Use the module under DDP (or inside
    your own ``shard_map`` over that axis); called outside one, a synchronized BatchNorm
    raises JAX's unbound-axis error.

    Args:
      module: an NNX module (or a BatchNorm itself).
      process_group: the group whose replicas share statistics (default group).

    Returns:
      ``module``, converted.
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"convert_sync_batchnorm expects a flax.nnx.Module, got {type(module).__name__}; "
            "for Linen pass axis_name=... to nn.BatchNorm yourself")
    axis = resolve_group(process_group).axis_name
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.BatchNorm):
            if not isinstance(node, SyncBatchNorm):
                node.__class__ = SyncBatchNorm  # a subclass adding no state
            node.axis_name = axis
    return module
