"""Place process-local values on a group's mesh as global arrays, and read them back.

DDP inputs come in three layouts over the replica axis of a :class:`ProcessGroup`'s mesh:

- *replicated* (``P()``): parameters and optimizer state, one full copy per device;
- *batch* (``P(axis)``): a process-local batch whose leading dimension is split evenly
  over this process's devices;
- *per-replica* (``P(axis)`` with a new leading axis of size ``num_replicas``): values
  that may differ between replicas (buffers after ``no_sync``, accumulated gradients,
  comm-hook state).

Global arrays are assembled from single-device arrays
(``jax.make_array_from_single_device_arrays``), so the same code works with one process
or many, and for any dtype (typed PRNG keys included).

The batch is placed anew at every step. A numpy batch goes straight to the runtime's
batched transfer (``pxla.batched_device_put``, what ``jax.make_array_from_callback`` and
``jax.device_put`` end in), one call per leaf with this process's rows cut per device
from a plan cached per sharding and shape; the public entry points' own checks cost
several times the transfer for a small batch, on every step. Where that internal
function is missing or refuses the call (another JAX version), the public
``jax.make_array_from_process_local_data`` / ``jax.device_put`` are used instead.
Replicated values that are not placed yet (a parameter server's trainers place theirs
at every step) take the same transfer, with a copy of their own per device; a JAX array
that already lives on a process's one device is wrapped as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._placed import by_placement, one_program
from jdist.collectives.runtime import ProcessGroup

__all__ = [
    "local_value",
    "replicated",
    "with_specs",
    "shard_batch",
    "per_replica",
    "local_rows",
    "local_first",
    "is_placed",
    "placed_like",
]


try:  # JAX internals, with the public API as the fallback (see the module docstring)
    from jax._src import core as _jcore
    from jax._src.interpreters.pxla import batched_device_put as _batched_put
except ImportError:  # pragma: no cover - depends on the JAX version
    _batched_put = None


@functools.lru_cache(maxsize=64)
def _named(mesh: Any, spec: P) -> NamedSharding:
    """``NamedSharding(mesh, spec)``, built once per mesh and spec (placement runs per step)."""
    return NamedSharding(mesh, spec)


def _local_devices(group: ProcessGroup) -> list:
    mine = set(group.local_devices)
    return [d for d in group.mesh.devices.flat if d in mine]


def is_placed(x: Any, sharding: NamedSharding) -> bool:
    """Whether ``x`` already is a global array with exactly ``sharding``."""
    return isinstance(x, jax.Array) and x.sharding == sharding


def replicated(tree: Any, group: ProcessGroup) -> Any:
    """Every leaf as a global array replicated over the group's devices (``P()``)."""
    sharding = _named(group.mesh, P())
    if all(is_placed(x, sharding) for x in jax.tree.leaves(tree)):
        return tree  # the common case: the previous step's outputs
    devs = _local_devices(group)

    def one(x):
        if is_placed(x, sharding):
            return x
        if isinstance(x, jax.Array):
            if len(devs) == 1 and x.is_fully_addressable and x.sharding.device_set == {
                    devs[0]}:  # already on the one local device: wrap its buffer
                return jax.make_array_from_single_device_arrays(x.shape, sharding, [x])
        elif isinstance(x, (np.ndarray, np.generic)) and x.dtype != object:
            fast = _put_copies(np.asarray(x), sharding, devs)
            if fast is not None:
                return fast
        x = jnp.asarray(x)
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [jax.device_put(x, d) for d in devs]
        )

    return jax.tree.map(one, tree)


def _put_copies(x: np.ndarray, sharding: NamedSharding, devs: list) -> jax.Array | None:
    """A numpy value as the replicated global array, one batched transfer of a copy per
    local device, or ``None`` where the fast path does not apply (see ``_put_rows``).

    The copies are this function's own: on CPU the transfer may keep the numpy buffer
    itself, and the caller may write into its array after the step was dispatched."""
    global _batched_put
    if _batched_put is None:
        return None
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    try:
        aval = _jcore.update_aval_with_sharding(_jcore.ShapedArray(x.shape, dtype), sharding)
        copies = [np.array(x, dtype=dtype, copy=True) for _ in devs]
        return _batched_put(aval, sharding, copies, devs)
    except (TypeError, AttributeError):  # the internal signature changed: stop using it
        _batched_put = None
        return None


def with_specs(tree: Any, specs: Any, group: ProcessGroup) -> Any:
    """Each leaf as a global array laid out by its ``PartitionSpec`` in ``specs``.

    Used for a sharded optimizer state (ZeRO). Leaves already placed are kept; ``P()``
    leaves are replicated; other leaves must hold the full global value on this process.
    """

    def one(x, spec):
        sharding = NamedSharding(group.mesh, spec)
        if is_placed(x, sharding):
            return x
        if spec == P():
            return replicated(x, group)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise ValueError(
                f"an optimizer state array is laid out as {x.sharding}, not as {sharding}; "
                "build the optimizer state on the DDP group's mesh (e.g. "
                "nnx.Optimizer(ddp.module, tx, wrt=nnx.Param) with the same process group)")
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(one, tree, specs)


def shard_batch(tree: Any, group: ProcessGroup, what: str = "batch") -> Any:
    """Split each leaf's leading dimension over this process's devices (``P(axis)``).

    Raises:
      ValueError: a leaf is a scalar, or its leading size does not divide evenly over
        this process's devices, or leaves disagree on the leading size.
    """
    sharding = _named(group.mesh, P(group.axis_name))
    n = len(group.local_devices)
    leaves, tdef = jax.tree.flatten(tree)
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else None for x in leaves}
    if None in sizes:
        bad = next(x for x in leaves if not np.ndim(x))
        kind = ("a scalar" if isinstance(bad, (int, float, complex, np.generic))
                or hasattr(bad, "shape") else
                f"a {type(bad).__name__} object, which is not a JAX pytree (register it "
                "with jax.tree_util.register_pytree_node or pass its arrays)")
        raise ValueError(
            f"every {what} leaf needs a leading batch dimension to split over this process's "
            f"{n} devices, got {kind}; pass scalars as extra arguments instead"
        )
    if len(sizes) > 1:
        raise ValueError(
            f"the {what} leaves have different leading sizes {sorted(sizes)}; every leaf "
            f"must have this process's batch size as its first dimension"
        )
    out = list(leaves)
    todo = [i for i, x in enumerate(leaves) if not is_placed(x, sharding)]
    if not todo:
        return tree
    b = int(np.shape(leaves[todo[0]])[0])
    if b % n:
        raise ValueError(
            f"this process's {what} has {b} samples, which does not split evenly over "
            f"its {n} devices ({b} % {n} = {b % n}); use a per-process batch size that is "
            f"a multiple of {n} (e.g. {max(n, b - b % n)}), or drop_last in the sampler"
        )
    if group.size() == 1 or len(group.devices_per_rank) == 1:
        # one process: numpy leaves by the fast transfer, the others by one device_put
        rest = []
        for i in todo:
            x = leaves[i]
            fast = (_put_rows(x, sharding, tuple(x.shape)) if isinstance(x, np.ndarray)
                    and x.dtype != object else None)
            if fast is None:
                rest.append(i)
            else:
                out[i] = fast
        if rest:
            for i, x in zip(rest, jax.device_put([leaves[i] for i in rest], sharding),
                            strict=True):
                out[i] = x
    else:
        for i in todo:
            x = leaves[i]
            gshape = (b * group.size(),) + tuple(np.shape(x)[1:])
            out[i] = _local_rows_array(x, sharding, gshape)
    return jax.tree.unflatten(tdef, out)


@functools.lru_cache(maxsize=256)
def _row_plan(sharding: NamedSharding, gshape: tuple, dtype: np.dtype) -> tuple | None:
    """``(aval, devices, local row slices)`` to build a ``P(axis)`` array of ``gshape``
    from this process's contiguous rows, or ``None`` (rows not contiguous, or no
    internal transfer: use the public API)."""
    if _batched_put is None:
        return None
    try:
        index = sharding.addressable_devices_indices_map(gshape)
        devices = list(index)
        starts = [index[d][0].start or 0 for d in devices]
        stops = [gshape[0] if index[d][0].stop is None else index[d][0].stop
                 for d in devices]
        first = min(starts)
        if sum(b - a for a, b in zip(starts, stops, strict=True)) != max(stops) - first:
            return None  # this process's rows are not one block of the global batch
        rows = tuple(slice(a - first, b - first) for a, b in zip(starts, stops, strict=True))
        aval = _jcore.update_aval_with_sharding(_jcore.ShapedArray(gshape, dtype), sharding)
    except Exception:  # noqa: BLE001 - internals changed: the public API is the fallback
        return None
    return aval, devices, rows


def _put_rows(x: np.ndarray, sharding: NamedSharding, gshape: tuple) -> jax.Array | None:
    """This process's rows ``x`` as the global ``P(axis)`` array of ``gshape`` in one
    batched transfer, or ``None`` where the fast path does not apply."""
    global _batched_put
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype != dtype:
        x = x.astype(dtype)  # jax.device_put canonicalizes the same way (no x64: 32 bits)
    plan = _row_plan(sharding, gshape, np.dtype(dtype))
    if plan is None:
        return None
    aval, devices, rows = plan
    try:
        return _batched_put(aval, sharding, [x[r] for r in rows], devices)
    except (TypeError, AttributeError):  # the internal signature changed: stop using it
        _batched_put = None
        return None


def _local_rows_array(x: Any, sharding: NamedSharding, gshape: tuple) -> jax.Array:
    """This process's rows ``x`` as the global ``P(axis)`` array of ``gshape``."""
    if isinstance(x, np.ndarray) and x.dtype != object:
        out = _put_rows(x, sharding, gshape)
        if out is not None:
            return out
    return jax.make_array_from_process_local_data(sharding, np.asarray(x), gshape)


def local_value(x: Any) -> Any:
    """A leaf as a value this process can compute with: a global array replicated over
    other processes' devices too (a DDP step's output) becomes its copy on this process's
    first device; other leaves are returned as they are.

    Raises:
      ValueError: ``x`` is split over processes (no process holds all of it).
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    if not x.sharding.is_fully_replicated:
        raise ValueError(
            f"an array of shape {x.shape} is laid out as {x.sharding}, split over several "
            "processes, so this process does not hold its value; pass a replicated or a "
            "process-local array (e.g. the module's parameters after a DDP step)")
    return x.addressable_shards[0].data


def per_replica(tree: Any, group: ProcessGroup) -> Any:
    """Each leaf copied once per replica on a new leading axis (``P(axis)``)."""
    sharding = NamedSharding(group.mesh, P(group.axis_name))
    devs = _local_devices(group)

    def one(x):
        # host values get their axis in numpy (a view): no per-shape eager program
        x = np.asarray(x)[None] if not isinstance(x, jax.Array) else local_value(x)[None]
        parts = [jax.device_put(x, d) for d in devs]
        return jax.make_array_from_single_device_arrays(
            (group.num_replicas,) + tuple(x.shape[1:]), sharding, parts
        )

    return jax.tree.map(one, tree)


def local_rows(tree: Any) -> Any:
    """This process's rows of ``P(axis)`` global arrays, as one local array per leaf."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
        if len(shards) == 1:
            return shards[0].data  # one local device: its rows are this process's rows
        return jnp.concatenate([jax.device_put(s.data, shards[0].device) for s in shards])

    return jax.tree.map(one, tree)


def local_first(tree: Any) -> Any:
    """The first local replica's entry of per-replica arrays (leading axis dropped)."""

    leaves, tdef = jax.tree.flatten(tree)
    rows = [min(x.addressable_shards, key=lambda s: s.index[0].start or 0).data
            for x in leaves]
    return jax.tree.unflatten(tdef, by_placement(_first_rows, rows))


_first_rows = one_program(lambda x: x[0])  # (one program per device: jdist/_placed.py)


def placed_like(tree: Any, like: Any) -> Any:
    """Each replicated leaf of ``tree`` placed where the matching leaf of ``like`` lives.

    DDP's gradients come out of the step replicated over the group's devices, and stay
    so unless the parameter is committed to other devices: leaves of ``like`` laid out
    like ``tree``'s (after a ``train_step``), uncommitted ones and numpy ones (JAX moves
    them to the gradient's devices in ``p + g``, and a replicated array reads as numpy)
    keep the replicated gradient, on one process and across processes alike. So the
    gradients of every call are laid out alike whatever the parameters went through in
    between (before a ``train_step`` or after it, an eager update, a jitted one), and
    gradients of several calls can be summed (accumulation across optimizer steps:
    ``tests/ddp/test_accumulate_mp.py``). A parameter committed to one local device
    (the user's ``jax.device_put``) gets the replica on that device, so ``p + g``
    works; one committed elsewhere gets a copy there.
    """

    def one(g, p):
        if not isinstance(g, jax.Array) or (isinstance(p, jax.Array) and p.sharding == g.sharding):
            return g
        if not (isinstance(p, jax.Array) and p.committed):
            return g  # JAX moves an uncommitted p (or a numpy one) to g's devices itself
        shards = {s.device: s.data for s in g.addressable_shards}
        if not p.is_fully_addressable:
            return g
        devs = p.sharding.device_set
        if len(devs) == 1 and next(iter(devs)) in shards:
            return shards[next(iter(devs))]  # no copy: the replica on that device
        return jax.device_put(g.addressable_shards[0].data, p.sharding)

    return jax.tree.map(one, tree, like)
