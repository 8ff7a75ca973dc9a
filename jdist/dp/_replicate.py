"""Place parameters on several devices, reusing the copies while the parameters are unchanged.

``replicate`` is torch's ``replicate(network, devices)`` for JAX: it returns one copy of a
parameter pytree (or of a Flax NNX module) per device. All copies are made by one
``jax.device_put`` onto a replicated sharding of the devices' mesh, and each replica is a
zero-copy view of one of its shards. Copies are cached by placement and reused while the
source leaves are the same array objects (JAX arrays are immutable, so an unchanged
identity means unchanged values); an optimizer step makes new arrays and the next call
copies again. Under ``jit`` (or any trace without concrete values) nothing is cached and
the copies are ``jax.device_put``, which is differentiable: the cotangents of all replicas
are summed back onto the source, as torch's ``Broadcast`` backward (reduce-add) does. Under
an eager ``jax.grad`` the copies of the parameters' concrete values are cached as above,
with the same backward (``ReplicaCache.put``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.interpreters import ad as _ad
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jdist.dp._scatter_gather import mesh_for, resolve_devices

__all__ = ["ReplicaCache", "Replicas", "default_cache", "put_from", "replicate_params",
           "replicate"]


def _concrete(leaves: Sequence) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in leaves)


class ReplicaCache:
    """Copies of parameter pytrees, one entry per placement key.

    An entry is reused while the source pytree has the same structure and the very same
    leaf objects; otherwise it is replaced (so at most one stale copy per key is kept).
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple] = {}
        self.misses = 0

    def get(self, params: Any, key: Hashable, make: Callable[[Any], Any]) -> Any:
        """``make(params)``, or the cached result of an earlier call with the same leaves."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if not _concrete(leaves):
            return make(params)
        hit = self._entries.get(key)
        if (hit is not None and hit[1] == treedef and len(hit[0]) == len(leaves)
                and all(a is b for a, b in zip(hit[0], leaves, strict=True))):
            return hit[2]
        self.misses += 1
        value = make(params)
        self._entries[key] = (tuple(leaves), treedef, value)
        return value

    def put(self, params: Any, sharding: jax.sharding.Sharding, home: Any = None) -> Any:
        """``jax.device_put(params, sharding)``, cached; see :func:`put_from` for ``home``.

        Under an eager ``jax.grad`` / ``jax.vjp`` (the parameters are linearize tracers
        with concrete values) the copies of those values are cached too, behind a
        ``custom_vjp`` whose backward moves the cotangents back as ``put_from`` does.
        """
        make = lambda p: put_from(p, sharding, home)  # noqa: E731
        primals = _grad_primals(params)
        if primals is None:
            return self.get(params, ("put", sharding), make)
        return _cached_put(params, primals,
                           lambda: self.get(primals, ("put", sharding), make), home)

    def clear(self) -> None:
        self._entries.clear()


def _grad_primals(tree: Any) -> Any:
    """The concrete values of ``tree`` when every leaf is a float linearize tracer at the
    top level of an eager ``jax.grad``/``jax.vjp``; else None."""
    tracer_type = getattr(_ad, "LinearizeTracer", None)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if tracer_type is None or not leaves:
        return None
    values = []
    for x in leaves:
        if type(x) is not tracer_type or not jnp.issubdtype(x.dtype, jnp.floating):
            return None
        v = x.primal
        if not isinstance(v, jax.Array) or isinstance(v, jax.core.Tracer):
            return None
        values.append(v)
    return jax.tree_util.tree_unflatten(treedef, values)


def _cached_put(params: Any, primals: Any, copies: Callable[[], Any], home: Any) -> Any:
    """``copies()`` (cached copies of ``primals``, the values of ``params``) whose
    cotangents go back to each value's placement (or ``home``), as ``put_from``'s do."""
    home = None if home is None else SingleDeviceSharding(home)
    src = jax.tree_util.tree_map(lambda v: _source(v, home), primals)

    @jax.custom_vjp
    def put(p):
        return copies()

    def fwd(p):
        return copies(), None

    def bwd(_, ct):
        return (jax.device_put(ct, src),)

    put.defvjp(fwd, bwd)
    return put(params)


def _source(x: Any, home: Any) -> Any:
    value = x.to_concrete_value() if isinstance(x, jax.core.Tracer) else x
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        return value.sharding
    return home


def put_from(tree: Any, target: Any, home: Any = None) -> Any:
    """``jax.device_put(tree, target)`` whose cotangents go back to each leaf's placement.

    JAX sends a ``device_put`` cotangent back to the source array's sharding, but a leaf
    with no placement (a Python or numpy scalar under ``jax.grad``) would leave its
    cotangents on the target devices, where adding the replicas' cotangents fails; such
    leaves get ``home`` (a device) as their source.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    if home is None or not any(isinstance(x, jax.core.Tracer) for x in leaves):
        return jax.device_put(tree, target)
    home = SingleDeviceSharding(home)
    return jax.device_put(tree, target, src=jax.tree_util.tree_map(lambda x: _source(x, home),
                                                                     tree))


default_cache = ReplicaCache()
"""The cache behind the functional ``replicate``/``data_parallel`` (DataParallel has its own)."""


class Replicas(list):
    """The list ``replicate`` returns for a pytree: copies of ONE pytree, one per device.

    ``parallel_apply`` runs the replicas whose inputs have equal shapes as one SPMD
    program when it gets such a list unmodified (it checks every item's identity).
    """

    def __init__(self, items: Sequence, devices: tuple) -> None:
        super().__init__(items)
        self.devices = tuple(devices)
        self._items = tuple(items)

    def unchanged(self) -> bool:
        """Whether the items are still the copies ``replicate`` made."""
        return len(self) == len(self._items) and all(
            a is b for a, b in zip(self, self._items, strict=True))


def _shards_by_device(tree: Any, devices: tuple) -> list:
    """Per-device views of a pytree of replicated global arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    per_leaf = [{s.device: s.data for s in leaf.addressable_shards} for leaf in leaves]
    return [jax.tree_util.tree_unflatten(treedef, [pl[d] for pl in per_leaf])
            for d in devices]


def replicate_params(params: Any, devices: tuple, cache: ReplicaCache) -> list:
    """One copy of the pytree ``params`` on each of ``devices`` (cached, differentiable)."""
    leaves = jax.tree_util.tree_leaves(params)
    if not _concrete(leaves):
        return [put_from(params, d, devices[0]) for d in devices]

    def make(p):
        glob = jax.device_put(p, NamedSharding(mesh_for(devices), PartitionSpec()))
        return tuple(_shards_by_device(glob, devices))

    return Replicas(cache.get(params, ("replicas", devices), make), devices)


def replicate(module_or_params: Any, devices: Sequence | None,
              cache: ReplicaCache | None = None) -> list:
    """Copies of a Flax NNX module or a parameter pytree, one per device.

    Args:
      module_or_params: an ``nnx.Module`` (its whole state is copied: params, batch
        statistics, RNG state) or any pytree of arrays.
      devices: jax devices, or ints indexing ``jax.local_devices()``; None: all.
      cache: where copies are kept for reuse (default: a module-level cache).

    Returns:
      A list with one replica per device: modules (``nnx.merge`` of the copied state,
      independent of each other and of the original) or pytrees (a :class:`Replicas`
      list, which ``parallel_apply`` can run as one program).

    Examples:
      >>> import jax.numpy as jnp
      >>> reps = replicate({"w": jnp.ones(3)}, [0, 1])
      >>> [r["w"].devices() == {d} for r, d in zip(reps, jax.local_devices()[:2])]
      [True, True]
    """
    devices = resolve_devices(devices)
    cache = default_cache if cache is None else cache
    if isinstance(module_or_params, nnx.Module):
        graphdef, state = nnx.split(module_or_params)
        return [nnx.merge(graphdef, s) for s in replicate_params(state, devices, cache)]
    return replicate_params(module_or_params, devices, cache)
