"""Eager collectives across processes, with torch.distributed's names and semantics.

Every member process calls the same function with its own local array. The array goes
to the process's first device, all members' arrays form one global array, and one
cached jitted ``shard_map`` program over the group's process mesh does the work
(``_engine`` documents the device mapping). Bytes move through XLA's collectives (gloo
on CPU, NCCL on GPU).

Results are returned: numpy in -> numpy ``ndarray`` out (0-d stays 0-d), ``jax.Array``
in -> ``jax.Array`` out, placed as the input was (an uncommitted input gives an
uncommitted result, which ``jax.device_put`` can place on a mesh spanning processes;
``_result`` says why).
As in torch, a writable numpy input is also updated in place (``all_reduce``,
``broadcast``, the ``reduce`` destination) and list outputs are filled in place.
``async_op=True`` returns a :class:`~jdist.collectives._work.Work` whose ``wait()``
returns the same result.

Before each call the members compare fingerprints (``_fingerprint``), so a rank that
calls a different collective, shape or dtype raises ``CollectiveMismatchError`` on every
rank; ``JDIST_DEBUG=OFF`` skips that check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jdist.collectives import _engine as eng
from jdist.collectives import _fingerprint as fpr
from jdist.collectives import functional as F
from jdist.collectives._group import ProcessGroup, group_state
from jdist.collectives._inplace import check_kept
from jdist.collectives._result import as_result, as_results
from jdist.collectives._types import ReduceOp, check_op_dtype
from jdist.collectives._work import Queues, Work
from jdist.errors import GroupMismatchError, UnsupportedOpError

__all__ = [
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
    "all_gather_single", "reduce_scatter_single",
]


# --------------------------------------------------------------------------- helpers


def queues() -> Queues:
    """The process's worker queues (made on first use; dropped by destroy)."""
    q = group_state.runtime.get("queues")
    if q is None:
        q = group_state.runtime["queues"] = Queues()
    return q


def dispatch(group: ProcessGroup, what: str, fn: Callable[[], Any], async_op: bool):
    """Run ``fn`` in issue order on ``group``: now, or as a ``Work`` when async."""
    key = ("group", id(group))
    if async_op:
        return Work(queues().submit(key, fn), what)
    return queues().call(key, fn)


def _prep(tensor, what: str):
    if isinstance(tensor, jax.Array):
        return tensor, True
    x = np.asarray(tensor)
    if x.dtype == object:
        raise TypeError(f"jdist.{what} needs a numeric array, got {type(tensor).__name__}")
    return x, False


def _write_back(target, value) -> None:
    """Copy ``value`` into ``target`` when it is a writable numpy array of that shape."""
    if (isinstance(target, np.ndarray) and target.flags.writeable
            and target.shape == np.shape(value)):
        np.copyto(target, value, casting="unsafe")


def _fill_list(out_list, values, what: str):
    """Fill ``out_list`` in place with ``values`` (as torch); return it, or ``values``
    when there is no list."""
    if out_list is None:
        return values
    if len(out_list) != len(values):
        raise ValueError(
            f"jdist.{what}: the output list has {len(out_list)} entries but the group has "
            f"{len(values)} members; pass a list of {len(values)} arrays or None"
        )
    for i, v in enumerate(values):
        if isinstance(out_list[i], np.ndarray) and out_list[i].flags.writeable:
            _write_back(out_list[i], v)
            if out_list[i].shape != np.shape(v):
                out_list[i] = v
        else:
            out_list[i] = v
    return out_list


def _check_op(op: ReduceOp, dtype, what: str) -> None:
    check_op_dtype(op, dtype, what)
    if op is ReduceOp.AVG and np.issubdtype(np.dtype(dtype), np.integer):
        raise UnsupportedOpError(
            f"jdist.{what}: ReduceOp.AVG cannot reduce an integer array (dtype "
            f"{np.dtype(dtype).name}), as in torch; cast it to float first or use SUM"
        )


def group_root(group: ProcessGroup, rank, group_rank, name: str, what: str) -> int:
    """The group rank meant by torch's ``src``/``dst`` (global) or ``group_src``/``group_dst``."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"jdist.{what}: give {name} or group_{name}, not both")
    if group_rank is not None:
        if not isinstance(group_rank, int) or not 0 <= group_rank < group.size():
            raise GroupMismatchError(
                f"jdist.{what}: group_{name}={group_rank!r} is not a rank of group "
                f"{group.name!r} (0..{group.size() - 1})"
            )
        return group_rank
    rank = 0 if rank is None else rank
    if rank not in group.ranks:
        raise GroupMismatchError(
            f"jdist.{what}: invalid root rank: {name}={rank!r} is not a member of group "
            f"{group.name!r} "
            f"(members: {list(group.ranks)}); pass a global rank of a member"
        )
    return group.ranks.index(rank)


def _fp(group, kind, op=None, shape=(), dtype=None, root=-1, count=-1):
    return fpr.encode(eng.next_seq(group), kind, op, shape, dtype, root, count)


def _stack(arrays, what: str, n: int, as_jax: bool):
    """Stack a list of ``n`` equal-shaped arrays (the per-destination inputs)."""
    if arrays is None or len(arrays) != n:
        got = None if arrays is None else len(arrays)
        raise ValueError(f"jdist.{what}: expected a list of {n} arrays (one per member), "
                         f"got {got}")
    shapes = {tuple(np.shape(a)) for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"jdist.{what}: every array in the list must have the same shape, "
                         f"got shapes {[tuple(np.shape(a)) for a in arrays]}")
    if as_jax:
        return jax.numpy.stack([jax.numpy.asarray(a) for a in arrays])
    return np.stack([np.asarray(a) for a in arrays])


def _split(stacked, as_jax: bool) -> list:
    """The rows of ``stacked`` in the caller's kind (numpy rows stay ``ndarray``, 0-d too);
    :func:`~jdist.collectives._result.as_results` also places jax rows like an input."""
    if as_jax:
        return [stacked[i] for i in range(stacked.shape[0])]
    return [np.asarray(stacked[i]) for i in range(stacked.shape[0])]


def _stack_padded(arrays, as_jax: bool):
    """``[n, m]``: each array flattened and zero-padded to the longest (m >= 1)."""
    xnp = jax.numpy if as_jax else np
    flat = [xnp.ravel(xnp.asarray(a)) for a in arrays]
    m = max(1, max(int(f.shape[0]) for f in flat))
    return xnp.stack([xnp.pad(f, (0, m - int(f.shape[0]))) for f in flat])




# ------------------------------------------------------------------------ reductions


def all_reduce(tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False):
    """Reduce ``tensor`` across the group's processes; every member gets the result.

    Args:
      tensor: this process's array (numpy, jax.Array, or array-like).
      op: a :class:`~jdist.ReduceOp`. Bool arrays: SUM/MAX/BOR are OR, PRODUCT/MIN/BAND
        are AND, BXOR is parity (as torch). Bitwise ops need int/bool arrays; AVG needs
        a float array.
      group: a process group (default WORLD); only members call.
      async_op: return a ``Work`` instead of waiting.

    Returns:
      The reduced array (a numpy input is also updated in place), or a ``Work``.

    Raises:
      TypeError: ``op`` does not fit the dtype (the message names it).
      CollectiveMismatchError: members called with different shapes/dtypes/ops.
      PeerFailedError: a member died; names it.
    """
    check_kept(tensor, "all_reduce", "tensor")
    g = eng.member_group(group, "all_reduce")
    if g is None:
        return None
    x, as_jax = _prep(tensor, "all_reduce")
    _check_op(op, x.dtype, "all_reduce")
    shape, dtype, axis = tuple(x.shape), x.dtype, g.axis_name

    def fn():
        out = eng.run(g, "all_reduce", ("all_reduce", op),
                      lambda: (lambda v: F.all_reduce(v, op, axis)), x, shape, dtype,
                      _fp(g, "all_reduce", op, shape, dtype), as_jax)
        out = as_result(out, tensor, as_jax, shape)
        _write_back(tensor, out)
        return out

    return dispatch(g, "all_reduce", fn, async_op)


def broadcast(tensor, src: int | None = None, group: ProcessGroup | None = None,
              async_op: bool = False, group_src: int | None = None):
    """Every member gets process ``src``'s ``tensor`` (bit for bit).

    ``src`` is a global rank, ``group_src`` a rank inside ``group``; give one (default
    global rank 0). Other members pass an array of the same shape and dtype.
    """
    check_kept(tensor, "broadcast", "tensor")
    g = eng.member_group(group, "broadcast")
    if g is None:
        return None
    root = group_root(g, src, group_src, "src", "broadcast")
    x, as_jax = _prep(tensor, "broadcast")
    shape, dtype, axis = tuple(x.shape), x.dtype, g.axis_name

    def fn():
        out = eng.run(g, "broadcast", ("broadcast", root),
                      lambda: (lambda v: F.broadcast(v, root, axis)), x, shape, dtype,
                      _fp(g, "broadcast", None, shape, dtype, root), as_jax)
        out = as_result(out, tensor, as_jax, shape)
        _write_back(tensor, out)
        return out

    return dispatch(g, "broadcast", fn, async_op)


def reduce(tensor, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False,
           group_dst: int | None = None):
    """Reduce ``tensor`` across members; only ``dst`` gets (and is updated with) the result.

    Returns the reduced array on ``dst``; other members get their input back unchanged.
    """
    check_kept(tensor, "reduce", "tensor")
    g = eng.member_group(group, "reduce")
    if g is None:
        return None
    root = group_root(g, dst, group_dst, "dst", "reduce")
    x, as_jax = _prep(tensor, "reduce")
    _check_op(op, x.dtype, "reduce")
    shape, dtype, axis = tuple(x.shape), x.dtype, g.axis_name

    def fn():
        out = eng.run(g, "reduce", ("all_reduce", op),
                      lambda: (lambda v: F.all_reduce(v, op, axis)), x, shape, dtype,
                      _fp(g, "reduce", op, shape, dtype, root), as_jax)
        if g.rank != root:
            return tensor if as_jax else x
        out = as_result(out, tensor, as_jax, shape)
        _write_back(tensor, out)
        return out

    return dispatch(g, "reduce", fn, async_op)


# ------------------------------------------------------------------------- gathering


def _gathered(g: ProcessGroup, what: str, x, as_jax: bool, fp):
    """``[n, *shape]``: every member's array, in group-rank order."""
    shape, dtype, axis = tuple(x.shape), x.dtype, g.axis_name

    def build():
        return lambda v: F.all_gather(v[0], axis, axis=0, tiled=False)[None]

    return eng.run(g, what, ("all_gather",), build, x, shape, dtype, fp, as_jax)


def all_gather(tensor_list, tensor, group: ProcessGroup | None = None,
               async_op: bool = False):
    """Every member gets every member's ``tensor``: ``result[i]`` is group rank i's.

    Args:
      tensor_list: a list of ``group size`` arrays, filled in place (numpy entries are
        written into; other entries are replaced), or None.
      tensor: this process's array; the same shape and dtype on every member.

    Returns:
      The list of arrays (the same list object when one was given), or a ``Work``.
    """
    g = eng.member_group(group, "all_gather")
    if g is None:
        return None
    x, as_jax = _prep(tensor, "all_gather")
    if tensor_list is not None and len(tensor_list) != g.size():
        _fill_list(tensor_list, [None] * g.size(), "all_gather")

    def fn():
        fp = _fp(g, "all_gather", None, x.shape, x.dtype)
        values = as_results(_gathered(g, "all_gather", x, as_jax, fp), tensor, as_jax)
        return _fill_list(tensor_list, values, "all_gather")

    return dispatch(g, "all_gather", fn, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group: ProcessGroup | None = None,
                           async_op: bool = False):
    """Members' ``input_tensor`` concatenated on dim 0 (``[n * d0, ...]``).

    ``output_tensor`` (or None) is filled in place when it is a numpy array of that size.
    """
    check_kept(output_tensor, "all_gather_into_tensor", "output_tensor")
    g = eng.member_group(group, "all_gather_into_tensor")
    if g is None:
        return None
    x, as_jax = _prep(input_tensor, "all_gather_into_tensor")
    n = g.size()
    out_shape = (n * x.shape[0], *x.shape[1:]) if x.ndim else (n,)
    if output_tensor is not None and int(np.prod(np.shape(output_tensor))) != int(
            np.prod(out_shape)):
        raise ValueError(
            f"jdist.all_gather_into_tensor: output has shape {np.shape(output_tensor)} but "
            f"{n} members x input {tuple(x.shape)} need {out_shape}"
        )

    def fn():
        fp = _fp(g, "all_gather_into_tensor", None, x.shape, x.dtype)
        out = as_result(_gathered(g, "all_gather_into_tensor", x, as_jax, fp), input_tensor,
                        as_jax, out_shape)
        if output_tensor is not None:
            _write_back(output_tensor, out.reshape(np.shape(output_tensor)))
        return out

    return dispatch(g, "all_gather_into_tensor", fn, async_op)


def gather(tensor, gather_list=None, dst: int | None = None,
           group: ProcessGroup | None = None, async_op: bool = False,
           group_dst: int | None = None):
    """``dst`` gets every member's ``tensor`` (a list, filled in place if given).

    Returns the list on ``dst`` and None on the other members, which pass
    ``gather_list`` as None or ``[]`` (as in torch).
    """
    g = eng.member_group(group, "gather")
    if g is None:
        return None
    root = group_root(g, dst, group_dst, "dst", "gather")
    x, as_jax = _prep(tensor, "gather")
    if g.rank != root and gather_list:
        raise ValueError("jdist.gather: Argument gather_list must NOT be specified on "
                         "non-destination ranks: pass None or [] on ranks other than dst "
                         f"(this is group rank {g.rank}, dst is group rank {root})")

    def fn():
        fp = _fp(g, "gather", None, x.shape, x.dtype, root)
        values = as_results(_gathered(g, "gather", x, as_jax, fp), tensor, as_jax)
        if g.rank != root:
            return None
        return _fill_list(gather_list, values, "gather")

    return dispatch(g, "gather", fn, async_op)


# ------------------------------------------------------------------------ scattering


def _exchange(g: ProcessGroup, what: str, stacked, as_jax: bool, fp):
    """All-to-all of ``[n, *shape]`` stacks: row j of the result came from member j."""
    shape, dtype, axis = tuple(stacked.shape), stacked.dtype, g.axis_name

    def build():
        return lambda v: F.all_to_all(v[0], 0, 0, axis, tiled=True)[None]

    return eng.run(g, what, ("all_to_all",), build, stacked, shape, dtype, fp, as_jax)


def scatter(tensor, scatter_list=None, src: int | None = None,
            group: ProcessGroup | None = None, async_op: bool = False,
            group_src: int | None = None):
    """Member i gets ``scatter_list[i]`` from ``src``; ``tensor`` gives shape and dtype.

    ``scatter_list`` is passed on ``src`` only (None or ``[]`` elsewhere, as in torch).
    Returns this member's piece (a numpy ``tensor`` is also filled in place).
    """
    check_kept(tensor, "scatter", "tensor")
    g = eng.member_group(group, "scatter")
    if g is None:
        return None
    root = group_root(g, src, group_src, "src", "scatter")
    x, as_jax = _prep(tensor, "scatter")
    n = g.size()
    if g.rank == root:
        stacked = _stack(scatter_list, "scatter", n, as_jax)
        if tuple(stacked.shape[1:]) != tuple(x.shape):
            raise ValueError(f"jdist.scatter: scatter_list arrays have shape "
                             f"{tuple(stacked.shape[1:])} but tensor has {tuple(x.shape)}")
    else:
        if scatter_list:
            raise ValueError("jdist.scatter: Argument scatter_list must NOT be specified on "
                             "non-source ranks: pass None or [] on ranks other than src "
                             f"(this is group rank {g.rank}, src is group rank {root})")
        stacked = np.zeros((n, *x.shape), x.dtype)

    def fn():
        fp = _fp(g, "scatter", None, x.shape, x.dtype, root)
        out = as_result(_exchange(g, "scatter", stacked.astype(x.dtype), as_jax, fp)[root],
                        tensor, as_jax, tuple(x.shape))
        _write_back(tensor, out)
        return out

    return dispatch(g, "scatter", fn, async_op)


def reduce_scatter(output, input_list, op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False):
    """Member i gets the reduction over members of their ``input_list[i]``.

    The arrays of ``input_list`` may differ in shape from one destination to the next
    (torch's uneven form, e.g. shapes ``(0,), (1,), (2,), (3,)``); each member passes the
    same shapes. Returns this member's array (``output`` is filled in place when it is
    a numpy array).
    """
    g = eng.member_group(group, "reduce_scatter")
    if g is None:
        return None
    n = g.size()
    as_jax = any(isinstance(a, jax.Array) for a in (input_list or []))
    if input_list is None or len(input_list) != n:
        got = None if input_list is None else len(input_list)
        raise ValueError(f"jdist.reduce_scatter: expected a list of {n} arrays (one per "
                         f"member), got {got}")
    shapes = [tuple(np.shape(a)) for a in input_list]
    mine = shapes[g.rank]
    if len(set(shapes)) == 1:
        stacked = _stack(input_list, "reduce_scatter", n, as_jax)
    else:  # uneven: flatten, pad to the longest, cut this member's part out afterwards
        stacked = _stack_padded(input_list, as_jax)
    _check_op(op, stacked.dtype, "reduce_scatter")
    axis = g.axis_name

    def fn():
        fp = _fp(g, "reduce_scatter", op, stacked.shape, stacked.dtype)
        out = eng.run(g, "reduce_scatter", ("reduce_scatter", op),
                      lambda: (lambda v: F.reduce_scatter(v[0], op, axis, 0, tiled=True)),
                      stacked, tuple(stacked.shape), stacked.dtype, fp, as_jax)
        if tuple(out.shape) != mine:
            out = out[:int(np.prod(mine, dtype=np.int64))]
        out = as_result(out, input_list[g.rank], as_jax, mine)
        _write_back(output, out)
        return out

    return dispatch(g, "reduce_scatter", fn, async_op)


def reduce_scatter_tensor(output, input, op: ReduceOp = ReduceOp.SUM,  # noqa: A002
                          group: ProcessGroup | None = None, async_op: bool = False):
    """``input`` reduced over members; member i gets its ``1/n`` part.

    The part follows torch: with an ``output`` array, ``input`` holds ``n`` times its
    elements, concatenated (``[n * k, ...]``) or stacked (``[n, *output.shape]``), and
    member i gets the i-th ``output``-sized block; without one, member i gets rows
    ``[i*k, (i+1)*k)`` of the ``[n * k, ...]`` input.
    """
    check_kept(output, "reduce_scatter_tensor", "output")
    g = eng.member_group(group, "reduce_scatter_tensor")
    if g is None:
        return None
    x, as_jax = _prep(input, "reduce_scatter_tensor")
    n = g.size()
    _check_op(op, x.dtype, "reduce_scatter_tensor")
    if output is not None:
        out_shape = tuple(np.shape(output))
        if int(np.prod(x.shape, dtype=np.int64)) != n * int(np.prod(out_shape, dtype=np.int64)):
            raise ValueError(
                f"jdist.reduce_scatter_tensor: input has shape {tuple(x.shape)} but the "
                f"output shape {out_shape} times the group size {n} needs "
                f"{n * int(np.prod(out_shape, dtype=np.int64))} elements; pass an input of "
                f"shape ({n} * {out_shape[0] if out_shape else 1}, ...) or ({n}, *output.shape)"
            )
        stacked = x.reshape((n, *out_shape))
    elif x.ndim == 0 or x.shape[0] % n:
        raise ValueError(
            f"jdist.reduce_scatter_tensor: input dim 0 must be divisible by the group size "
            f"{n}, got shape {tuple(x.shape)}"
        )
    else:
        stacked = x.reshape((n, x.shape[0] // n, *x.shape[1:]))

    def fn():
        fp = _fp(g, "reduce_scatter_tensor", op, x.shape, x.dtype)
        out = eng.run(g, "reduce_scatter_tensor", ("reduce_scatter", op),
                      lambda: (lambda v: F.reduce_scatter(v[0], op, g.axis_name, 0,
                                                          tiled=True)),
                      stacked, tuple(stacked.shape), stacked.dtype, fp, as_jax)
        out = as_result(out, input, as_jax, tuple(stacked.shape[1:]))
        _write_back(output, out)
        return out

    return dispatch(g, "reduce_scatter_tensor", fn, async_op)


# torch 2.13's new names for the tensor variants (the old ones warn there; not here)
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor
