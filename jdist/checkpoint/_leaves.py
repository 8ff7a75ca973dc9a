"""One array leaf to host pieces and back: placement, PRNG keys, checksums, re-splitting.

A leaf is saved in one of three places:

- ``replicated``: the same value on every rank (parameters, a replicated optimizer
  state, the module's buffers as DDP leaves them): rank 0 writes it once;
- ``sharded``: a global array split over devices (ZeRO shards, per-replica comm-hook
  state): every rank writes the shards it holds, each with its index in the global
  array, and restore reassembles the global value from the parts that hold it;
- ``local``: a value of this rank only (:class:`PerRank`): every rank writes its own.

Typed PRNG keys are saved as their key data and wrapped again with the template's
implementation. The pieces go to host memory packed per dtype (:mod:`._pack`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.checkpoint._errors import CheckpointMismatchError

__all__ = [
    "PerRank", "describe", "host_pieces", "assemble", "place",
    "key_path",
]


class PerRank:
    """Marks a pytree as this rank's own (each rank saves and restores its value).

    ``state["aug_rng_keys"] = PerRank(keys)``; restore returns the bare pytree.
    """

    def __init__(self, tree: Any):
        self.tree = tree

    def __repr__(self) -> str:
        return f"PerRank({self.tree!r})"


def key_path(path) -> str:
    """``a/b/0`` from a JAX key path."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
        parts.append(str(name if name is not None else k))
    return "/".join(parts)


def _is_key(x) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def describe(x) -> dict:
    """Shape, dtype (of the key data for PRNG keys) and key implementation of a leaf."""
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, x)
        return {"shape": list(data.shape), "dtype": str(data.dtype),
                "key_impl": str(jax.random.key_impl(x))}
    return {"shape": list(np.shape(x)), "dtype": str(np.result_type(x)), "key_impl": None}


def _index(idx, shape) -> list:
    return [[s.start or 0, shape[d] if s.stop is None else s.stop]
            for d, s in enumerate(idx)]


def host_pieces(x, rank: int, local: bool = False) -> tuple[str, list]:
    """``(place, [(index, value), ...])``: what this rank writes for leaf ``x``.

    ``index`` is ``[[start, stop], ...]`` per dimension in the global array (None for a
    whole value); ``value`` is still on its device (the caller copies all pieces to
    host at once). Replicated leaves are written by rank 0 only (others get ``[]``),
    read from one device.
    """
    if _is_key(x):
        x = jax.random.key_data(x)
    if local:
        return "local", [(None, _addressable_value(x))]
    if isinstance(x, jax.Array) and not x.is_fully_replicated:
        pieces = [(_index(s.index, x.shape), s.data)
                  for s in x.addressable_shards if s.replica_id == 0]
        return "sharded", pieces
    if rank != 0:
        return "replicated", []
    return "replicated", [(None, _one_copy(_addressable_value(x)))]


def _one_copy(x):
    """A replicated jax array as one device's buffer (the others hold the same bytes)."""
    if isinstance(x, jax.Array) and len(x.addressable_shards) > 1:
        return x.addressable_data(0)
    return x


def _addressable_value(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise ValueError("a PerRank leaf is sharded over other processes' devices; "
                             "pass this rank's own (process-local) values")
        return x.addressable_data(0)
    return x


def assemble(shape, dtype, pieces, where: str) -> np.ndarray:
    """The global value of a sharded leaf from its saved ``(index, array)`` pieces."""
    out = np.zeros(shape, dtype)
    seen = np.zeros(shape, bool) if shape else np.zeros((), bool)
    for index, a in pieces:
        sl = tuple(slice(a0, b0) for a0, b0 in index)
        out[sl] = a
        seen[sl] = True
    if not seen.all():
        raise CheckpointMismatchError(
            f"{where}: the saved shards cover only {int(seen.sum())} of {seen.size} "
            "elements; a rank's part is missing from this step")
    return out


def place(host: np.ndarray, template: Any, info: dict) -> Any:
    """``host`` laid out like ``template`` (same sharding, PRNG keys wrapped again)."""
    if info.get("key_impl"):
        impl = jax.random.key_impl(template)
        keys = jax.random.wrap_key_data(jnp.asarray(host), impl=impl)
        if template.is_fully_addressable:
            return jax.device_put(keys, template.sharding)
        idx = template.sharding.addressable_devices_indices_map(template.shape)
        return jax.make_array_from_single_device_arrays(
            template.shape, template.sharding,
            [jax.device_put(keys[i], d) for d, i in idx.items()])
    if isinstance(template, jax.Array):
        host = np.asarray(host, dtype=template.dtype)
        return jax.make_array_from_callback(template.shape, template.sharding,
                                            lambda i: host[i])
    if isinstance(template, np.ndarray):
        return np.asarray(host, template.dtype).reshape(template.shape)
    if isinstance(template, (bool, int, float, complex)):
        return type(template)(host.item())
    if isinstance(template, np.generic):
        return template.dtype.type(host.item())
    return host
