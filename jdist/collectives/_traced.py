"""In-graph collectives: torch's collective names as pure functions over ``lax`` collectives.

Every function here runs inside ``jax.shard_map`` (or anything else that binds a mesh
axis name) and works on pytrees leaf by leaf. ``group`` is an axis name, a tuple of axis
names, a :class:`~jdist.collectives.ProcessGroup` (its ``axis_name`` is used) or ``None``
(the default group's axis, ``"dp"`` without ``init_process_group``). A *replica* is one
index along that axis; ``src``/``dst`` count replicas along it (as ``lax.axis_index``
does), not processes.

Public through :mod:`jdist.collectives.functional`; DDP comm hooks call these directly.

Varying/invariant typing (``shard_map(check_vma=True)``): results that are equal on every
replica of the axis (``all_reduce``, ``broadcast``, ``all_gather``) are typed invariant
over it, so they may leave ``shard_map`` with ``out_specs=P()``; ``reduce``,
``reduce_scatter``, ``scatter``, ``all_to_all`` and ``permute`` results are varying.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdist.collectives._axis import axis_of as axis_of
from jdist.collectives._axis import bound_size
from jdist.collectives._types import ReduceOp, check_op_dtype

__all__ = [
    "axis_of",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "permute",
    "send_recv",
    "reduce_stacked",
]

AxisName = Any  # a str, a tuple of str, a ProcessGroup or None
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


# ----------------------------------------------------------------------------- axes


def _size(axes, api: str) -> int:
    """Size of the bound axis (product over a tuple); a clear error when it is unbound."""
    return bound_size(
        axes, f"jdist.collectives.functional.{api}",
        f"In-graph collectives must run inside jax.shard_map over a mesh with axis {axes!r}; "
        f"pass group=<your mesh's axis name>, or use the eager jdist.{api} on host arrays "
        f"instead")


def _varying(x) -> frozenset:
    """Axis names that ``x`` is typed as varying over (empty when vma is not tracked)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def _vma_checked(axes) -> bool:
    """True inside ``shard_map(check_vma=True)``: ``axis_index`` is then typed varying."""
    names = axes if isinstance(axes, tuple) else (axes,)
    return bool(set(names) & _varying(lax.axis_index(axes)))


def _to_varying(x, axes):
    """Type ``x`` as varying over ``axes`` (a no-op when it already is, or without vma)."""
    names = axes if isinstance(axes, tuple) else (axes,)
    missing = tuple(a for a in names if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _check_replica(value, n: int, what: str, api: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"functional.{api}: {what} must be a Python int replica index along the axis, "
            f"got {value!r}"
        )
    if not 0 <= int(value) < n:
        raise ValueError(
            f"functional.{api}: {what}={value} is out of range for an axis of {n} replicas; "
            f"use 0 <= {what} < {n}"
        )
    return int(value)


def _check_dtype(op: ReduceOp, dtype, api: str) -> None:
    check_op_dtype(op, dtype)
    dt = np.dtype(dtype)
    if op is ReduceOp.AVG and np.issubdtype(dt, np.integer):
        raise TypeError(
            f"functional.{api}: ReduceOp.AVG cannot keep integer dtype {dt.name} (torch "
            f"raises too); cast to a float dtype first, or use SUM and divide"
        )


def _is_float(dt) -> bool:
    return bool(jnp.issubdtype(dt, jnp.floating))


# ------------------------------------------------------------------ local reductions


def _all_ones(dtype):
    return ~np.zeros((), dtype)


def reduce_stacked(g, op: ReduceOp, axis: int = 0):
    """Reduce the replica axis ``axis`` of a stacked array with torch's ``op`` semantics.

    The result keeps ``g``'s dtype. On bool arrays SUM and MAX are OR, PRODUCT and MIN
    are AND, BXOR is parity (as torch does). Deterministic: every caller that reduces
    the same stack gets the same bits.
    """
    n = g.shape[axis]
    dt = g.dtype
    if dt == jnp.bool_:
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return jnp.any(g, axis=axis)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return jnp.all(g, axis=axis)
        if op is ReduceOp.BXOR:
            return (jnp.sum(g, axis=axis, dtype=jnp.int32) % 2).astype(jnp.bool_)
    if op is ReduceOp.SUM:
        return jnp.sum(g, axis=axis, dtype=dt)
    if op is ReduceOp.AVG:
        return (jnp.sum(g, axis=axis, dtype=dt) / n).astype(dt)
    if op is ReduceOp.PRODUCT:
        return jnp.prod(g, axis=axis, dtype=dt)
    if op is ReduceOp.MIN:
        return jnp.min(g, axis=axis)
    if op is ReduceOp.MAX:
        return jnp.max(g, axis=axis)
    fn, init = {
        ReduceOp.BAND: (lax.bitwise_and, _all_ones(dt)),
        ReduceOp.BOR: (lax.bitwise_or, np.zeros((), dt)),
        ReduceOp.BXOR: (lax.bitwise_xor, np.zeros((), dt)),
    }[op]
    return lax.reduce(g, jnp.asarray(init, dt), fn, (axis,))


def _gather_stacked(x, axes, checked: bool):
    """Every replica's ``x`` stacked on a new leading axis, the same on every replica."""
    if checked:
        return lax.all_gather(_to_varying(x, axes), axes, axis=0, tiled=False, to="invarying")
    return lax.all_gather(x, axes, axis=0, tiled=False)


# ------------------------------------------------------------------------ all_reduce


def _pmin_pmax(x, axes, is_max: bool):
    """``lax.pmax``/``pmin`` with a gradient (``lax`` has none): like ``jnp.max``, the
    tangent is shared equally among the replicas that hold the extreme value."""
    prim = lax.pmax if is_max else lax.pmin
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return prim(x, axes)

    @jax.custom_jvp
    def extreme(v):
        return prim(v, axes)

    @extreme.defjvp
    def _(primals, tangents):
        (v,), (t,) = primals, tangents
        y = extreme(v)
        hit = v == y
        count = lax.psum(hit.astype(t.dtype), axes)
        return y, lax.psum(jnp.where(hit, t, jnp.zeros_like(t)), axes) / count

    return extreme(x)


def _all_reduce_leaf(x, op: ReduceOp, axes, checked: bool):
    x = jnp.asarray(x)
    _check_dtype(op, x.dtype, "all_reduce")
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.int32)
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return lax.pmax(u, axes).astype(jnp.bool_)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return lax.pmin(u, axes).astype(jnp.bool_)
        return (lax.psum(u, axes) % 2).astype(jnp.bool_)  # BXOR: parity
    if op is ReduceOp.SUM:
        return lax.psum(x, axes)
    if op is ReduceOp.AVG:
        return lax.pmean(x, axes)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return _pmin_pmax(x, axes, op is ReduceOp.MAX)
    # PRODUCT and bitwise: exact, through every replica's value and one local reduction
    return reduce_stacked(_gather_stacked(x, axes, checked), op)


def all_reduce(x, op: ReduceOp = ReduceOp.SUM, group: AxisName = None):
    """Reduce ``x`` over the replicas of ``group``; every replica gets the result.

    SUM, AVG, MIN and MAX are ``lax.psum``/``pmean``/``pmin``/``pmax``. PRODUCT and the
    bitwise ops are exact: each replica gathers all values (``all_gather``, so ``N``
    times the memory) and reduces them locally in replica order. Bool arrays follow
    torch: SUM/MAX/BOR are OR, PRODUCT/MIN/BAND are AND, BXOR is parity. The dtype is
    kept. Differentiable for SUM, AVG, MIN, MAX (``lax`` rules) and PRODUCT.

    Args:
      x: a pytree of arrays (this replica's values).
      op: a :class:`~jdist.ReduceOp`.
      group: an axis name, tuple of axis names, ``ProcessGroup`` or ``None``.

    Returns:
      The reduced pytree, typed invariant over the axis under ``check_vma=True``.

    Raises:
      TypeError: bitwise ops on non-integer arrays, AVG on int or bool (naming the dtype).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jdist.collectives import functional as F
      >>> from jax.sharding import AxisType
      >>> mesh = jax.make_mesh((2,), ("dp",), axis_types=(AxisType.Auto,),
      ...                      devices=jax.devices()[:2])
      >>> f = jax.jit(jax.shard_map(lambda v: F.all_reduce(v, F.ReduceOp.PRODUCT, "dp"),
      ...                           mesh=mesh, in_specs=P("dp"), out_specs=P()))
      >>> f(jnp.array([3.0, 4.0]))
      Array([12.], dtype=float32)
    """
    axes = axis_of(group)
    _size(axes, "all_reduce")
    checked = _vma_checked(axes)
    return jax.tree_util.tree_map(lambda v: _all_reduce_leaf(v, op, axes, checked), x)


# ------------------------------------------------------------------------- broadcast


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _masked_psum(x, mask, axes):
    return lax.psum(jnp.where(mask, x, jnp.zeros_like(x)), axes)


def _bits_broadcast(x, mask, axes):
    """Bit-exact broadcast: only ``src`` contributes non-zero bits to an integer psum."""
    if x.dtype == jnp.bool_:
        return _masked_psum(x.astype(jnp.int32), mask, axes).astype(jnp.bool_)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return _masked_psum(x, mask, axes)
    u = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return lax.bitcast_convert_type(_masked_psum(u, mask, axes), x.dtype)


def _broadcast_leaf(x, src: int, axes):
    x = jnp.asarray(x)
    mask = lax.axis_index(axes) == src
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return _bits_broadcast(x, mask, axes)
    if not _is_float(x.dtype) or x.dtype.itemsize not in _UINT:
        return _masked_psum(x, mask, axes)  # complex: exact except for the sign of zero

    @jax.custom_jvp
    def exact(v):
        return _bits_broadcast(v, lax.axis_index(axes) == src, axes)

    @exact.defjvp
    def _(primals, tangents):
        (v,), (t,) = primals, tangents
        return exact(v), _masked_psum(t, lax.axis_index(axes) == src, axes)

    return exact(x)


def broadcast(x, src: int = 0, group: AxisName = None):
    """Every replica gets replica ``src``'s ``x``, bit for bit (``-0.0`` and NaNs too).

    Implemented as a psum in which only ``src`` contributes non-zero bits (XLA's
    collective-broadcast is not lowered on every platform). Differentiable: the
    gradient flows to ``src`` only (others get zero).

    Args:
      x: a pytree of arrays.
      src: replica index along the axis (``0 <= src < axis size``), not a process rank.
      group: an axis name, tuple of axis names, ``ProcessGroup`` or ``None``.

    Returns:
      ``src``'s pytree, typed invariant over the axis under ``check_vma=True``.
    """
    axes = axis_of(group)
    src = _check_replica(src, _size(axes, "broadcast"), "src", "broadcast")
    return jax.tree_util.tree_map(lambda v: _broadcast_leaf(v, src, axes), x)


def reduce(x, dst: int = 0, op: ReduceOp = ReduceOp.SUM, group: AxisName = None):
    """Reduce ``x`` over the replicas; replica ``dst`` gets the result.

    Torch leaves non-``dst`` tensors unspecified; here every other replica holds its own
    input ``x`` unchanged (an in-graph value must exist everywhere). The cost is an
    ``all_reduce``. Differentiable as ``all_reduce``, for ``dst`` only.

    Args:
      x: a pytree of arrays.
      dst: replica index along the axis that receives the result.
      op: a :class:`~jdist.ReduceOp`.
      group: an axis name, tuple of axis names, ``ProcessGroup`` or ``None``.

    Returns:
      The reduction on ``dst``, ``x`` elsewhere (typed varying).
    """
    axes = axis_of(group)
    dst = _check_replica(dst, _size(axes, "reduce"), "dst", "reduce")
    checked = _vma_checked(axes)
    is_dst = lax.axis_index(axes) == dst

    def leaf(v):
        v = jnp.asarray(v)
        return jnp.where(is_dst, _all_reduce_leaf(v, op, axes, checked), v)

    return jax.tree_util.tree_map(leaf, x)


# ------------------------------------------------------------------------ all_gather


def _check_axis(axis: int, ndim: int, api: str, what: str = "axis") -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"functional.{api}: {what} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"functional.{api}: {what}={axis} is out of range for an array of rank {ndim}; "
            f"use {-ndim} <= {what} < {ndim}"
        )
    return int(axis) % ndim


def all_gather(x, group: AxisName = None, axis: int = 0, tiled: bool = False):
    """Every replica gets all replicas' ``x``, in replica order.

    ``tiled=False`` stacks them on a new axis ``axis`` (torch's ``all_gather`` list as
    one array); ``tiled=True`` concatenates along the existing axis ``axis``
    (``all_gather_into_tensor``). Differentiable.

    Args:
      x: a pytree of arrays, the same shape on every replica.
      group: an axis name, tuple of axis names, ``ProcessGroup`` or ``None``.
      axis: where to stack (``0..ndim``) or which axis to concatenate.
      tiled: concatenate instead of stacking.

    Returns:
      The gathered pytree, typed invariant over the axis under ``check_vma=True``.
    """
    axes = axis_of(group)
    _size(axes, "all_gather")
    checked = _vma_checked(axes)

    def leaf(v):
        v = jnp.asarray(v)
        ax = _check_axis(axis, v.ndim if tiled else v.ndim + 1, "all_gather")
        if checked:
            return lax.all_gather(_to_varying(v, axes), axes, axis=ax, tiled=tiled,
                                  to="invarying")
        return lax.all_gather(v, axes, axis=ax, tiled=tiled)

    return jax.tree_util.tree_map(leaf, x)


def all_gather_into_tensor(x, group: AxisName = None):
    """Torch's ``all_gather_into_tensor``: replicas' ``x`` concatenated on dim 0."""
    return all_gather(x, group, axis=0, tiled=True)


def gather(x, dst: int = 0, group: AxisName = None, axis: int = 0):
    """Torch's ``gather``: stacked values for ``dst``.

    XLA has no rooted gather, so every replica receives the stacked result (an
    ``all_gather``); ``dst`` is validated so torch call sites port unchanged.
    """
    axes = axis_of(group)
    _check_replica(dst, _size(axes, "gather"), "dst", "gather")
    return all_gather(x, axes, axis=axis, tiled=False)


def scatter(x, src: int = 0, group: AxisName = None, axis: int = 0):
    """Replica ``i`` gets chunk ``i`` of ``src``'s ``x`` split evenly along ``axis``.

    Torch's ``scatter`` with ``scatter_list`` given as one array. Implemented as
    :func:`broadcast` then a local slice. Differentiable (gradient to ``src``).
    """
    axes = axis_of(group)
    n = _size(axes, "scatter")
    src = _check_replica(src, n, "src", "scatter")
    idx = lax.axis_index(axes)

    def leaf(v):
        v = jnp.asarray(v)
        ax = _check_axis(axis, v.ndim, "scatter")
        if v.shape[ax] % n:
            raise ValueError(
                f"functional.scatter: dimension {ax} of shape {v.shape} is not divisible by "
                f"the {n} replicas; pad it to a multiple of {n}"
            )
        c = v.shape[ax] // n
        return lax.dynamic_slice_in_dim(_broadcast_leaf(v, src, axes), idx * c, c, ax)

    return jax.tree_util.tree_map(leaf, x)


# --------------------------------------------------------------- reduce_scatter etc.


def _reduce_scatter_leaf(v, op, axes, n, dim, tiled):
    v = jnp.asarray(v)
    _check_dtype(op, v.dtype, "reduce_scatter")
    dim = _check_axis(dim, v.ndim, "reduce_scatter", "scatter_dimension")
    size = v.shape[dim]
    if (tiled and size % n) or (not tiled and size != n):
        need = f"a multiple of {n}" if tiled else f"exactly {n}"
        raise ValueError(
            f"functional.reduce_scatter: scatter_dimension {dim} of shape {v.shape} has size "
            f"{size}, needs {need} (the number of replicas, tiled={tiled})"
        )
    if op in (ReduceOp.SUM, ReduceOp.AVG) and v.dtype != jnp.bool_:
        out = lax.psum_scatter(v, axes, scatter_dimension=dim, tiled=tiled)
        return out / n if op is ReduceOp.AVG else out
    # other ops: exchange the chunks (all_to_all), then reduce locally in replica order
    moved = jnp.moveaxis(v, dim, 0)
    stacked = moved.reshape((n, size // n) + moved.shape[1:])
    mine = lax.all_to_all(stacked, axes, 0, 0, tiled=False)
    red = reduce_stacked(mine, op)
    if not tiled:
        return red[0]  # the chunk had size 1: drop the dimension
    return jnp.moveaxis(red, 0, dim)


def reduce_scatter(x, op: ReduceOp = ReduceOp.SUM, group: AxisName = None,
                   scatter_dimension: int = 0, tiled: bool = True):
    """Reduce over the replicas; replica ``i`` keeps chunk ``i`` along ``scatter_dimension``.

    SUM is ``lax.psum_scatter``, AVG that divided by the number of replicas; the other
    ops exchange chunks with ``all_to_all`` and reduce locally (exact). ``tiled=True``
    (torch's ``reduce_scatter_tensor``) needs the dimension to be a multiple of the
    replica count and keeps it (shrunk); ``tiled=False`` needs it equal to the count
    and removes it. Differentiable for SUM and AVG.

    Args:
      x: a pytree of arrays.
      op: a :class:`~jdist.ReduceOp`.
      group: an axis name, tuple of axis names, ``ProcessGroup`` or ``None``.
      scatter_dimension: the dimension split among the replicas.
      tiled: keep the dimension (True) or remove it (False).

    Returns:
      This replica's reduced chunk (typed varying).
    """
    axes = axis_of(group)
    n = _size(axes, "reduce_scatter")
    return jax.tree_util.tree_map(
        lambda v: _reduce_scatter_leaf(v, op, axes, n, scatter_dimension, tiled), x)


def reduce_scatter_tensor(x, op: ReduceOp = ReduceOp.SUM, group: AxisName = None):
    """Torch's ``reduce_scatter_tensor``: ``reduce_scatter`` on dim 0, tiled."""
    return reduce_scatter(x, op, group, scatter_dimension=0, tiled=True)


def all_to_all(x, split_axis: int = 0, concat_axis: int = 0, group: AxisName = None,
               tiled: bool = True):
    """Replica ``i`` sends chunk ``j`` of ``x`` (split along ``split_axis``) to replica ``j``.

    With the defaults this is torch's ``all_to_all_single`` with equal splits: dim 0 is
    split in N chunks and the received chunks are concatenated on dim 0 in sender
    order. ``tiled=False`` is ``lax.all_to_all``'s stacking form (``split_axis`` must
    have size N). Differentiable.
    """
    axes = axis_of(group)
    n = _size(axes, "all_to_all")

    def leaf(v):
        v = jnp.asarray(v)
        sa = _check_axis(split_axis, v.ndim, "all_to_all", "split_axis")
        ca = _check_axis(concat_axis, v.ndim, "all_to_all", "concat_axis")
        if (tiled and v.shape[sa] % n) or (not tiled and v.shape[sa] != n):
            raise ValueError(
                f"functional.all_to_all: split_axis {sa} of shape {v.shape} must be "
                f"{'a multiple of' if tiled else 'equal to'} the {n} replicas"
            )
        return lax.all_to_all(v, axes, sa, ca, tiled=tiled)

    return jax.tree_util.tree_map(leaf, x)


# ------------------------------------------------------------------------ send/recv


def _check_perm(perm, n: int) -> list[tuple[int, int]]:
    try:
        pairs = [(int(s), int(d)) for s, d in perm]
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"functional.permute: perm must be (source, destination) int pairs, got {perm!r}"
        ) from e
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(
                f"functional.permute: pair {(s, d)} is out of range for {n} replicas; "
                f"indices must satisfy 0 <= i < {n}"
            )
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"functional.permute: perm {pairs} repeats a source or a destination; each "
            f"replica may send once and receive once"
        )
    return pairs


def permute(x, perm, group: AxisName = None):
    """Point-to-point sends, all at once: for each ``(src, dst)`` in ``perm``, ``dst``
    receives ``src``'s ``x``; replicas that receive nothing get zeros (``lax.ppermute``).

    This is how torch's ``send``/``recv`` pairs are written in-graph: a lone ``send``
    or ``recv`` has no meaning inside one SPMD program, so both ends are one call.
    Differentiable (the gradient is the inverse permutation).
    """
    axes = axis_of(group)
    pairs = _check_perm(perm, _size(axes, "permute"))
    return jax.tree_util.tree_map(lambda v: lax.ppermute(jnp.asarray(v), axes, pairs), x)


def send_recv(x, shift: int = 1, group: AxisName = None):
    """Ring exchange: replica ``i`` sends ``x`` to ``(i + shift) % N`` and returns what it
    received from ``(i - shift) % N`` (every replica sends and receives once)."""
    axes = axis_of(group)
    n = _size(axes, "send_recv")
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise TypeError(f"functional.send_recv: shift must be an int, got {shift!r}")
    pairs = [(i, (i + int(shift)) % n) for i in range(n)]
    return jax.tree_util.tree_map(lambda v: lax.ppermute(jnp.asarray(v), axes, pairs), x)
