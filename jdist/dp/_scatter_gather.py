"""Split a batch pytree over devices (``scatter``) and concatenate outputs (``gather``).

The pure core is :func:`chunk_sizes` (``torch.chunk`` arithmetic), :func:`batch_size`
(the common size, checked) and :func:`split_container` (one level of the container walk);
``scatter``/``scatter_kwargs``/``gather`` are thin shells that move arrays between devices
with ``jax.device_put`` (differentiable, so gradients flow back through both).

Differences from ``torch.nn.parallel``:
  * arrays whose sizes along ``dim`` differ raise ``ValueError`` quoting every size (torch
    ``zip``-truncates to the smallest chunk count and silently drops samples);
  * ``gather`` of strings or other non-array objects returns the per-replica values as a
    list (torch returns a ``map`` object, or raises ``TypeError`` for ints);
  * dicts whose keys differ raise torch's ``ValueError`` even when their counts agree.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jdist.collectives.runtime import DEFAULT_AXIS, make_mesh

__all__ = [
    "SCALAR_WARNING",
    "chunk_sizes",
    "batch_size",
    "resolve_devices",
    "resolve_target",
    "mesh_for",
    "dim_spec",
    "is_array",
    "split_container",
    "scatter",
    "scatter_kwargs",
    "gather",
]

SCALAR_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


def chunk_sizes(n: int, num_chunks: int) -> tuple[int, ...]:
    """Sizes of ``torch.chunk(t, num_chunks)`` for a dimension of size ``n``.

    Chunks are ``ceil(n / num_chunks)`` long (the last one shorter), so there can be fewer
    chunks than ``num_chunks``: 10 over 8 gives five chunks of 2.

    Examples:
      >>> chunk_sizes(10, 4)
      (3, 3, 3, 1)
      >>> chunk_sizes(10, 8)
      (2, 2, 2, 2, 2)
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if n < 0:
        raise ValueError(f"size must be >= 0, got {n}")
    if n == 0:
        return (0,) * num_chunks  # torch.chunk of an empty dim: num_chunks empty chunks
    size = -(-n // num_chunks)
    return tuple(min(size, n - start) for start in range(0, n, size))


def is_array(x: Any) -> bool:
    """Whether ``x`` is split by scatter / concatenated by gather (jax or numpy array)."""
    return isinstance(x, (jax.Array, np.ndarray))


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def split_container(obj: Any):
    """``(children, rebuild)`` for a container scatter/gather recurse into, else None.

    Containers: namedtuples, tuples, lists, dicts, dataclass instances (init fields) and
    registered pytree nodes; anything else (arrays, None, strings, objects) is a leaf.
    """
    if _is_namedtuple(obj):
        return list(obj), lambda ch: type(obj)(*ch)
    if isinstance(obj, (tuple, list)):
        return list(obj), lambda ch: type(obj)(ch)
    if isinstance(obj, dict):
        keys = list(obj)

        def rebuild_dict(ch):
            try:
                return type(obj)(zip(keys, ch, strict=True))
            except TypeError:  # e.g. defaultdict: copy (keeps its factory) and refill
                new = copy.copy(obj)
                new.clear()
                new.update(zip(keys, ch, strict=True))
                return new

        return [obj[k] for k in keys], rebuild_dict
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        return ([getattr(obj, n) for n in names],
                lambda ch: dataclasses.replace(obj, **dict(zip(names, ch, strict=True))))
    if obj is None or is_array(obj):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)
    if jax.tree_util.treedef_is_leaf(treedef):
        return None
    return leaves, lambda ch: jax.tree_util.tree_unflatten(treedef, ch)


def _walk_arrays(obj: Any, path: str, out: list) -> None:
    if is_array(obj):
        out.append((path, obj))
        return
    split = split_container(obj)
    if split is None:
        return
    children, _ = split
    keys = list(obj) if isinstance(obj, dict) else range(len(children))
    for key, child in zip(keys, children, strict=True):
        _walk_arrays(child, f"{path}[{key!r}]", out)


def batch_size(tree: Any, dim: int = 0, what: str = "inputs") -> int | None:
    """The common size along ``dim`` of every array in ``tree`` (None when it has none).

    Raises:
      ValueError: sizes differ (quoting each array's path and size), or an array has no
        dimension ``dim``.
    """
    found: list = []
    _walk_arrays(tree, what, found)
    sizes = {}
    for path, arr in found:
        if arr.ndim <= dim:
            raise ValueError(
                f"cannot scatter {path} with shape {tuple(arr.shape)} along dim {dim}: it "
                f"has no dimension {dim}; pass scalars as Python numbers or close over them")
        sizes[path] = int(arr.shape[dim])
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{p}: {s}" for p, s in sizes.items())
        raise ValueError(
            f"scatter got arrays with different sizes along dim {dim} ({listed}); torch "
            f"would silently drop samples here. Give every scattered array the same size "
            f"along dim {dim}, or close over arrays that should not be split")
    return next(iter(sizes.values()), None)


def resolve_devices(devices: Sequence | None) -> tuple:
    """Jax devices from devices or ints (indices into ``jax.local_devices()``); None: all."""
    local = jax.local_devices()
    if devices is None:
        return tuple(local)
    if isinstance(devices, (int, jax.Device)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of jax devices or ints, got {devices!r}")
    out = []
    for d in devices:
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
            if not 0 <= d < len(local):
                raise ValueError(
                    f"device index {d} is out of range: this process has {len(local)} "
                    f"local devices (indices 0..{len(local) - 1})")
            out.append(local[int(d)])
        elif isinstance(d, jax.Device):
            if d.process_index != jax.process_index():
                raise ValueError(
                    f"device {d} belongs to process {d.process_index}, not this one "
                    f"({jax.process_index()}); DataParallel runs on this process's devices "
                    f"(jax.local_devices()); use jdist.ddp across processes")
            out.append(d)
        else:
            raise TypeError(f"devices must be jax devices or ints, got {d!r} in {devices!r}")
    if not out:
        raise ValueError("devices is empty; pass at least one device (or None for all)")
    if len(set(out)) != len(out):
        raise ValueError(f"devices must be distinct, got {out}")
    return tuple(out)


def resolve_target(target: Any) -> jax.Device:
    """A jax device from a device, an int index into ``jax.local_devices()``, ``"cpu"``
    or ``-1`` (torch's index for the CPU: the host's first CPU device)."""
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool) and target == -1:
        return jax.devices("cpu")[0]
    if isinstance(target, str):
        if target != "cpu":
            raise ValueError(f"target_device must be a device, an int, -1 or 'cpu', got {target!r}")
        return jax.devices("cpu")[0]
    if isinstance(target, jax.Device):
        return target
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        return resolve_devices([int(target)])[0]
    raise TypeError(f"target_device must be a jax device, an int or 'cpu', got {target!r}")


@functools.lru_cache(maxsize=64)
def mesh_for(devices: tuple) -> jax.sharding.Mesh:
    """The (cached) 1-D ``"dp"`` mesh over ``devices``."""
    return make_mesh(devices, DEFAULT_AXIS)


def dim_spec(dim: int) -> PartitionSpec:
    """PartitionSpec splitting dimension ``dim`` over the ``"dp"`` axis."""
    return PartitionSpec(*([None] * dim), DEFAULT_AXIS)


def _concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _split_array(x: Any, sizes: tuple, devices: tuple, dim: int) -> list:
    """Chunk ``x`` along ``dim`` with ``sizes`` and put chunk i on ``devices[i]``."""
    c, k = sizes[0], len(sizes)
    m = k if sizes[-1] == c else k - 1
    if _concrete(x) and c > 0:
        main = x if m == k else lax.slice_in_dim(x, 0, m * c, axis=dim)
        glob = jax.device_put(main, NamedSharding(mesh_for(devices[:m]), dim_spec(dim)))
        by_dev = {s.device: s.data for s in glob.addressable_shards}
        chunks = [by_dev[d] for d in devices[:m]]
        if m < k:
            tail = lax.slice_in_dim(x, m * c, x.shape[dim], axis=dim)
            chunks.append(jax.device_put(tail, devices[m]))
        return chunks
    starts = np.cumsum((0,) + sizes)
    return [jax.device_put(lax.slice_in_dim(x, int(starts[i]), int(starts[i + 1]), axis=dim),
                           devices[i]) for i in range(k)]


def _scatter_tree(obj: Any, sizes: tuple, devices: tuple, dim: int) -> list:
    """Per-replica copies of ``obj``: arrays chunked, containers rebuilt, others repeated."""
    k = len(sizes)
    if is_array(obj):
        return _split_array(obj, sizes, devices, dim)
    split = split_container(obj)
    if split is None or not split[0]:
        return [obj] * k
    children, rebuild = split
    per_child = [_scatter_tree(ch, sizes, devices, dim) for ch in children]
    return [rebuild([pc[i] for pc in per_child]) for i in range(k)]


def _plan(trees: Sequence, devices: tuple, dim: int) -> tuple:
    n = batch_size(tuple(trees), dim)
    return chunk_sizes(n, len(devices)) if n is not None else (1,) * len(devices)


def scatter(inputs: Any, devices: Sequence | None, dim: int = 0) -> list:
    """Split ``inputs`` into one piece per replica, chunk i placed on ``devices[i]``.

    Arrays (jax or numpy) are chunked along ``dim`` with ``torch.chunk`` sizes, so there
    are ``len(chunk_sizes(n, len(devices)))`` replicas, possibly fewer than devices.
    Tuples, lists, dicts, namedtuples, dataclasses and registered pytree nodes are rebuilt
    per replica; other objects are repeated by reference. With no arrays at all, every
    device gets a replica.

    Args:
      inputs: a pytree of arrays and other objects.
      devices: jax devices, or ints indexing ``jax.local_devices()``; None: all (torch's
        ``target_gpus``).
      dim: the dimension to split.

    Returns:
      A list with one copy of ``inputs``' structure per replica.

    Raises:
      ValueError: arrays' sizes along ``dim`` differ (torch silently drops samples).

    Examples:
      >>> import jax.numpy as jnp
      >>> parts = scatter(jnp.arange(10), [0, 1, 2, 3])
      >>> [p.shape[0] for p in parts]
      [3, 3, 3, 1]
    """
    devices = resolve_devices(devices)
    sizes = _plan([inputs], devices, dim)
    return _scatter_tree(inputs, sizes, devices, dim)


def scatter_kwargs(inputs: Any, kwargs: dict | None, devices: Sequence | None,
                   dim: int = 0) -> tuple[tuple, tuple]:
    """Scatter positional and keyword inputs together (one batch size for both).

    Returns:
      ``(inputs_per_replica, kwargs_per_replica)``, tuples of the same length: each item
      of the first is a tuple of positional arguments, of the second a dict.
    """
    devices = resolve_devices(devices)
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    kwargs = dict(kwargs or {})
    sizes = _plan([tuple(inputs), kwargs], devices, dim)
    k = len(sizes)
    ins = [tuple(x) for x in _scatter_tree(tuple(inputs), sizes, devices, dim)] if inputs \
        else [() for _ in range(k)]
    kws = _scatter_tree(kwargs, sizes, devices, dim) if kwargs else [{} for _ in range(k)]
    return tuple(ins), tuple(kws)


def _gather_arrays(arrs: list, target: jax.Device, dim: int):
    if all(a.ndim == 0 for a in arrs):
        if dim != 0:
            raise ValueError(
                f"cannot gather scalar outputs along dim {dim}; gather scalars with dim=0 "
                f"(they become a vector) or return arrays with a dimension {dim}")
        warnings.warn(SCALAR_WARNING, UserWarning, stacklevel=3)
        arrs = [jnp.reshape(a, (1,)) for a in arrs]
    moved = [jax.device_put(a, target) for a in arrs]
    return moved[0] if len(moved) == 1 else jnp.concatenate(moved, axis=dim)


def _gather_tree(outs: list, target: jax.Device, dim: int):
    first = outs[0]
    if is_array(first):
        bad = [i for i, o in enumerate(outs) if not is_array(o)]
        if bad:
            raise TypeError(
                f"replica 0 returned an array but replica {bad[0]} returned "
                f"{type(outs[bad[0]]).__name__}; every replica must return the same structure")
        return _gather_arrays(list(outs), target, dim)
    if first is None:
        return None
    if isinstance(first, dict):
        if not all(len(first) == len(o) for o in outs):
            raise ValueError("All dicts must have the same number of keys")
        for i, o in enumerate(outs):
            if set(o) != set(first):
                raise ValueError(
                    f"All dicts must have the same number of keys (and the same keys): "
                    f"replica 0 has {sorted(map(str, first))}, replica {i} has "
                    f"{sorted(map(str, o))}")
    split = split_container(first)
    if split is None or isinstance(first, str):
        return list(outs)
    children, rebuild = split
    keys = list(first) if isinstance(first, dict) else None
    per_replica = [[o[k] for k in keys] if keys is not None else split_container(o)[0]
                   for o in outs]
    if any(len(ch) != len(children) for ch in per_replica):
        raise ValueError(
            f"replicas returned {type(first).__name__}s of different lengths "
            f"{[len(ch) for ch in per_replica]}; every replica must return the same structure")
    return rebuild([_gather_tree([ch[j] for ch in per_replica], target, dim)
                    for j in range(len(children))])


def gather(outputs: Sequence, target_device: Any, dim: int = 0):
    """Concatenate per-replica outputs along ``dim`` on ``target_device``.

    Dicts (same keys), namedtuples, tuples, lists, dataclasses and pytree nodes are
    gathered recursively; ``None`` stays ``None``; replicas' scalars become a vector (with
    torch's warning); strings and other objects become a list of the replicas' values.

    Args:
      outputs: one output per replica (same structure).
      target_device: a jax device, an int index into ``jax.local_devices()``, or ``"cpu"``
        (also ``-1``, as in torch).
      dim: the dimension to concatenate along.

    Returns:
      The gathered output on ``target_device``.

    Raises:
      ValueError: dicts with different keys (torch's message), scalars with ``dim != 0``.

    Examples:
      >>> import jax.numpy as jnp
      >>> gather([jnp.ones((2, 3)), jnp.zeros((1, 3))], 0).shape
      (3, 3)
    """
    if not isinstance(outputs, Sequence) or isinstance(outputs, str) or not outputs:
        raise ValueError(f"outputs must be a non-empty list of replica outputs, got {outputs!r}")
    return _gather_tree(list(outputs), resolve_target(target_device), dim)
