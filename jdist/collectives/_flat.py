"""One all-reduce per dtype for a whole pytree, in the form the backend runs fastest.

A pytree all-reduce is one collective with one operand per leaf. XLA's all-reduce
combiner merges the leaves' all-reduces into one *variadic* all-reduce, which NCCL (GPU)
and XLA:CPU's in-process collectives run as one operation. Gloo, which XLA:CPU uses
across processes, runs a variadic all-reduce as one collective per operand: each a round
trip between the processes, so a model of 8 leaves paid 8 round trips (2.8-7.6 ms for
21,790 floats against 0.64-0.95 ms for one flat buffer in the same program).

:func:`all_reduce_flat` therefore picks the form by backend, as DDP picks its
``flat_buckets`` (``docs/design-ddp.md``):

- **flat** (the default on CPU across processes): the leaves of one dtype are copied
  into one 1-D buffer, reduced by one single-operand all-reduce and cut back into
  their shapes; one collective per dtype.
- **per leaf** (elsewhere): ``functional.all_reduce`` of the tree; XLA's combiner fuses it
  with no copy (copying into a buffer costs more than it saves there).

Every op of :func:`~jdist.collectives.functional.all_reduce` works element by element,
so both forms give the same bits for every op and dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jdist.collectives._traced import (
    _all_reduce_leaf,
    _check_dtype,
    _size,
    _varying,
    _vma_checked,
    axis_of,
)
from jdist.collectives._traced import all_reduce as _per_leaf
from jdist.collectives._types import ReduceOp

__all__ = ["all_reduce_flat", "invariant_leaves", "prefers_flat"]


def prefers_flat(platform: str | None = None, process_count: int | None = None) -> bool:
    """Whether the backend runs a multi-operand all-reduce as one collective per operand.

    True on CPU across processes (gloo), the case DDP's ``flat_buckets`` defaults for.

    Args:
      platform: ``"cpu"``, ``"gpu"``, ...; default ``jax.default_backend()``.
      process_count: processes in the job; default ``jax.process_count()``.
    """
    platform = jax.default_backend() if platform is None else platform
    process_count = jax.process_count() if process_count is None else process_count
    return platform == "cpu" and process_count > 1


def invariant_leaves(tree, group=None) -> list[str]:
    """Paths of the leaves of ``tree`` typed *invariant* over the axis, inside
    ``shard_map(check_vma=True)`` (none without vma checking, where nothing is typed).

    Under ``check_vma=True``, ``jax.grad`` with respect to replicated (``P()``) inputs
    returns gradients already summed over the replicas (the transpose of the implicit
    broadcast is a ``psum``) and typed invariant; a gradient reducer that reduced them
    again would count every replica ``N`` times. Reducers call this to refuse them.
    """
    axes = axis_of(group)
    if not _vma_checked(axes):
        return []
    names = set(axes if isinstance(axes, tuple) else (axes,))
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) for p, x in paths
            if not names <= _varying(jnp.asarray(x))]


def _pack(leaves):
    """The leaves raveled one after the other into one 1-D buffer.

    Written as in-place updates of one buffer: XLA:CPU emits a ``concatenate`` of many
    arrays as one partitioned loop fusion, slower than a copy per leaf.
    """
    total = sum(int(x.size) for x in leaves)
    buf = jnp.zeros((total,), leaves[0].dtype)
    pos = 0
    for x in leaves:
        buf = lax.dynamic_update_slice(buf, jnp.ravel(x), (pos,))
        pos += int(x.size)
    return buf


def _unpack(buf, leaves):
    out, pos = [], 0
    for x in leaves:
        out.append(lax.slice(buf, (pos,), (pos + int(x.size),)).reshape(x.shape))
        pos += int(x.size)
    return out


def all_reduce_flat(tree, op: ReduceOp = ReduceOp.SUM, group=None, *,
                    flat: bool | None = None):
    """``functional.all_reduce(tree, op, group)`` with one collective per dtype where
    the backend needs it (see the module doc); the same result, bit for bit.

    Args:
      tree: a pytree of arrays (this replica's values).
      op: a :class:`~jdist.ReduceOp` (all of them, with ``all_reduce``'s dtype rules).
      group: an axis name, tuple of axis names, ``ProcessGroup`` or ``None``.
      flat: copy each dtype's leaves into one buffer (True), reduce leaf by leaf and
        let XLA combine them (False), or choose by backend (None: :func:`prefers_flat`).

    Returns:
      The reduced pytree, same structure, shapes and dtypes.

    Raises:
      TypeError: ``op`` does not fit a leaf's dtype (as ``all_reduce``).
      UnboundAxisError: called outside ``shard_map`` over the axis.
    """
    axes = axis_of(group)
    _size(axes, "all_reduce_flat")
    if flat is None:
        flat = prefers_flat()
    if not flat:
        return _per_leaf(tree, op, axes)
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(x) for x in leaves]
    checked = _vma_checked(axes)
    groups: dict = {}
    for i, x in enumerate(leaves):
        if x.size:  # empty leaves need no bytes moved (all_reduce of nothing is nothing)
            groups.setdefault((x.dtype, _varying(x)), []).append(i)
    out = list(leaves)
    for idxs in groups.values():
        part = [leaves[i] for i in idxs]
        if len(part) == 1:
            out[idxs[0]] = _all_reduce_leaf(part[0], op, axes, checked)
            continue
        reduced = _all_reduce_leaf(_pack(part), op, axes, checked)
        for i, y in zip(idxs, _unpack(reduced, part), strict=True):
            out[i] = y
    for i, x in enumerate(leaves):
        if not x.size:  # nothing to move; op/dtype checked, vma typing kept as per leaf
            _check_dtype(op, x.dtype, "all_reduce_flat")
            out[i] = _all_reduce_leaf(x, op, axes, checked) if checked else x
    return jax.tree.unflatten(treedef, out)
