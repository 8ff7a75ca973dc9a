"""Eager collectives of many arrays at once: one collective, not one per array.

Each eager collective is a round trip between the processes, so reducing a model's
arrays one by one costs a round trip per array. These functions pack a list (or any
pytree) of arrays first:

- :func:`broadcast_coalesced` moves every array's *bytes* in one ``uint8`` buffer: one
  broadcast for any mix of dtypes, bit for bit;
- :func:`all_reduce_coalesced` copies each dtype's arrays into one flat buffer and
  reduces it with one ``all_reduce``: one collective per dtype (torch's deprecated
  ``all_reduce_coalesced``, Horovod's ``grouped_allreduce``); every op works element by
  element, so the result is the per-array result.

Results keep each input's kind, shape and placement (``_result``). Leaves may also be
Python scalars (returned as the same Python type) and typed PRNG keys.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from jdist.collectives import _engine as eng
from jdist.collectives._eager import all_reduce, broadcast
from jdist.collectives._group import ProcessGroup
from jdist.collectives._result import as_result
from jdist.collectives._types import ReduceOp

__all__ = ["all_reduce_coalesced", "broadcast_coalesced"]

_SCALARS = (bool, int, float, complex)
_DIGEST = 8  # bytes of the structure digest that travels with a broadcast


def _host(leaf, what: str, path: str) -> np.ndarray:
    """One leaf as a host array (typed keys as their raw key data)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if not leaf.is_fully_replicated:
            raise ValueError(f"jdist.{what}: leaf {path} is a global array sharded across "
                             f"processes ({leaf.sharding}); pass replicated values or this "
                             f"process's copy")
        leaf = leaf.addressable_data(0)  # this process's copy of a replicated array
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype,
                                                             jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, *_SCALARS)):
        x = np.asarray(leaf)
        if x.dtype != object:
            return x
    raise TypeError(f"jdist.{what}: leaf {path} is a {type(leaf).__name__}, not an array or "
                    f"a number; remove it from the tree (or send it with "
                    f"jdist.broadcast_object_list)")


def _back(value: np.ndarray, leaf):
    """``value`` in the kind of the input ``leaf``."""
    if isinstance(leaf, _SCALARS):
        return type(leaf)(value.item())
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = as_result(value, jax.random.key_data(leaf), True)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        return as_result(value, leaf, True)
    return as_result(value, leaf, False, np.shape(leaf))


def _flatten(tree, what: str):
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in paths]
    host = [_host(leaf, what, jax.tree_util.keystr(p)) for p, leaf in paths]
    return leaves, host, treedef


def _digest(host: list, treedef) -> np.ndarray:
    sig = repr((str(treedef), [(x.shape, x.dtype.str) for x in host])).encode()
    return np.frombuffer(hashlib.blake2b(sig, digest_size=_DIGEST).digest(), np.uint8)


def broadcast_coalesced(tensors: Any, src: int | None = None,
                        group: ProcessGroup | None = None, group_src: int | None = None):
    """Every member gets ``src``'s arrays, bit for bit, in one collective.

    Args:
      tensors: a list (or any pytree) of arrays and numbers; every member passes the
        same structure, shapes and dtypes.
      src: the global rank to copy from (default 0); or ``group_src``, a group rank.
      group: a process group (default WORLD).

    Returns:
      The same structure holding ``src``'s values, each leaf in its input's kind (numpy
      ``ndarray``, ``jax.Array`` placed like the input, Python scalar).

    Raises:
      ValueError: this member's structure, shapes or dtypes differ from ``src``'s.
    """
    g = eng.member_group(group, "broadcast_coalesced")
    if g is None:
        return None
    leaves, host, treedef = _flatten(tensors, "broadcast_coalesced")
    digest = _digest(host, treedef)
    parts = [digest] + [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in host]
    buf = broadcast(np.concatenate(parts), src, g, group_src=group_src)
    if not np.array_equal(buf[:_DIGEST], digest):
        raise ValueError(
            f"jdist.broadcast_coalesced: this rank's tree (structure {treedef}, shapes "
            f"{[x.shape for x in host]}) differs from the source's, which has the same "
            f"number of bytes; pass the same structure, shapes and dtypes on every rank")
    out, pos = [], _DIGEST
    for x, leaf in zip(host, leaves, strict=True):
        raw = buf[pos:pos + x.nbytes].copy()
        pos += x.nbytes
        out.append(_back(raw.view(x.dtype).reshape(x.shape), leaf))
    return jax.tree.unflatten(treedef, out)


def all_reduce_coalesced(tensors: Any, op: ReduceOp = ReduceOp.SUM,
                         group: ProcessGroup | None = None):
    """Reduce many arrays across the group with one collective per dtype.

    Args:
      tensors: a list (or any pytree) of arrays and numbers (the same on every member).
      op: a :class:`~jdist.ReduceOp`, with ``all_reduce``'s dtype rules.
      group: a process group (default WORLD).

    Returns:
      The same structure holding the reductions, each in its input's kind.
    """
    g = eng.member_group(group, "all_reduce_coalesced")
    if g is None:
        return None
    leaves, host, treedef = _flatten(tensors, "all_reduce_coalesced")
    by_dtype: dict = {}
    for i, x in enumerate(host):
        by_dtype.setdefault(x.dtype, []).append(i)
    out: list = [None] * len(host)
    for dtype, idxs in by_dtype.items():
        buf = np.concatenate([host[i].reshape(-1) for i in idxs]).astype(dtype, copy=False)
        red = np.asarray(all_reduce(buf, op, g)) if buf.size else buf  # nothing to move
        pos = 0
        for i in idxs:
            n = host[i].size
            out[i] = _back(red[pos:pos + n].reshape(host[i].shape).copy(), leaves[i])
            pos += n
    return jax.tree.unflatten(treedef, out)
