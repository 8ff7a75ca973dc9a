"""What an eager collective hands back: the input's kind, shape and placement.

The program's output is a block on this process's device of the group's process mesh.
The caller gets it in the kind it passed in:

- **numpy in, numpy ``ndarray`` out**, with the result's full shape, 0-d included (an
  element of a numpy array is a numpy *scalar*, not an array; torch returns a 0-d
  tensor for a 0-d tensor, and so do we);
- **jax.Array in, jax.Array out**, placed as the input was. An *uncommitted* input (the
  usual ``jnp`` result, on the default device) gives an uncommitted result, which JAX
  lets move anywhere: ``jax.device_put(result, NamedSharding(group.mesh, P()))`` works
  across processes (JAX then checks that every process holds the same value). A
  result left committed to the collective's device could not be placed on a mesh
  spanning other processes ("does not support cross-host device transfers"). A
  committed input gives a result committed where the input was: on its device, or with
  its sharding when the result has the input's shape.

Host values become jax.Arrays through JAX's own one-array placement
(:func:`uncommitted`: ``batched_device_put``, uncommitted), not ``jax.device_put``'s
Python dispatch: on CPU between two collectives of 2 processes, ``device_put`` of a
few KiB cost about 45 us itself and made the next collective some 300 us slower; the
placement costs 10 us and nothing after (``benchmarks/collectives.py``). Where this
JAX lacks those internals, one jitted identity does it (7 us, 45 us after).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

__all__ = ["as_result", "as_results", "uncommitted"]


@functools.cache
def _identity():
    return jax.jit(lambda v: v)


@functools.lru_cache(maxsize=8)
def _fast_put(device) -> tuple | None:
    """(device, sharding, put, ShapedArray, canonicalize_dtype, default-device option)
    for ``device`` (this process's first, asked on every call: a new JAX client after
    ``clear_backends`` has new devices), or None when this JAX has no such internals."""
    try:
        from jax._src import config, dtypes
        from jax._src.core import ShapedArray
        from jax._src.interpreters.pxla import batched_device_put

        return (device, jax.sharding.SingleDeviceSharding(device), batched_device_put,
                ShapedArray, dtypes.canonicalize_dtype, config.default_device)
    except Exception:  # another JAX layout
        return None


def uncommitted(host) -> jax.Array:
    """``host`` (a numpy array) as an uncommitted jax.Array on the default device, as
    ``jax.device_put(host)`` places it (dtype canonicalized under the x64 mode in
    force), without its Python dispatch (see the module doc). On CPU the array may
    share ``host``'s memory: pass memory nothing writes to afterwards."""
    fast = _fast_put(jax.local_devices()[0])
    if fast is not None and type(host) is np.ndarray:
        device, sharding, put, shaped, canonical, default_device = fast
        # jax.default_device(...) in effect: the public path honours it
        if default_device.value is None and canonical(host.dtype) == host.dtype:
            try:
                return put(shaped(host.shape, host.dtype), sharding, [host], [device],
                           committed=False)
            except Exception:  # a case it does not take: the public path decides
                pass
    return _identity()(host)


def _jax_like(value: jax.Array, like) -> jax.Array:
    if not isinstance(like, jax.Array) or not like.committed:
        # uncommitted: the value on the default device, free to be placed anywhere
        return value if not value.committed else uncommitted(np.asarray(value))
    sharding = like.sharding
    if like.is_fully_addressable and tuple(value.shape) == tuple(like.shape):
        if value.sharding == sharding and value.committed:
            return value
        return jax.device_put(value, sharding)
    devices = sharding.device_set
    if len(devices) == 1 and (value.sharding.device_set != devices or not value.committed):
        return jax.device_put(value, next(iter(devices)))
    return value


def as_result(value, like, as_jax: bool, shape: tuple | None = None):
    """``value`` as the caller's kind: a numpy ``ndarray`` of ``shape`` (default: its
    own), or a jax.Array placed like the input ``like`` (see the module doc)."""
    if as_jax:
        value = value if isinstance(value, jax.Array) else uncommitted(np.asarray(value))
        if shape is not None and tuple(value.shape) != tuple(shape):
            value = value.reshape(shape)
        return _jax_like(value, like)
    out = np.asarray(value)
    return out if shape is None else out.reshape(shape)


def as_results(stacked, like, as_jax: bool) -> list:
    """The rows of ``stacked`` (``[n, *shape]``), each as :func:`as_result` would give it;
    placed once for all rows."""
    stacked = as_result(stacked, like, as_jax)
    if as_jax:
        return [stacked[i] for i in range(stacked.shape[0])]
    return [np.asarray(stacked[i]) for i in range(stacked.shape[0])]
