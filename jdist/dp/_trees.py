"""The pytrees of replica inputs and outputs: arrays split from everything else.

Replicas receive their array leaves as program inputs and every other leaf (strings,
numbers, objects) as a compile-time constant; :func:`partition` / :func:`rebuild` do
that split (looking into plain dataclasses, as ``scatter`` does). A replica's output is
split the same way: :func:`split_output` returns the arrays a program returns and the
:class:`OutputMeta` that rebuilds the output around them. :func:`fold_keys` gives each
replica its own PRNG stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdist.dp._scatter_gather import gather, is_array, split_container

__all__ = ["OutputMeta", "partition", "rebuild", "split_output", "join_output",
           "check_same_output", "fold_keys"]


def _dynamic(x: Any) -> bool:
    return is_array(x) or isinstance(x, (jax.core.Tracer, np.generic))


class _Dataclass:
    """Pytree stand-in for a dataclass that is not a registered pytree (fields as children)."""

    __slots__ = ("cls", "names", "values")

    def __init__(self, cls: type, names: tuple, values: tuple) -> None:
        self.cls, self.names, self.values = cls, names, values


jax.tree_util.register_pytree_node(
    _Dataclass, lambda d: (d.values, (d.cls, d.names)),
    lambda aux, ch: _Dataclass(aux[0], aux[1], tuple(ch)))


def _plain_dataclass(x: Any) -> bool:
    return (dataclasses.is_dataclass(x) and not isinstance(x, type)
            and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x)))


def _encode(x: Any) -> Any:
    if _plain_dataclass(x):
        names = tuple(f.name for f in dataclasses.fields(x) if f.init)
        return _Dataclass(type(x), names, tuple(_encode(getattr(x, n)) for n in names))
    split = None if is_array(x) else split_container(x)
    return x if split is None else split[1]([_encode(c) for c in split[0]])


def _decode(x: Any) -> Any:
    if isinstance(x, _Dataclass):
        return x.cls(**{n: _decode(v) for n, v in zip(x.names, x.values, strict=True)})
    split = None if is_array(x) else split_container(x)
    return x if split is None else split[1]([_decode(c) for c in split[0]])


def partition(tree: Any) -> tuple[list, tuple]:
    """``(arrays, key)``: the array leaves of ``tree``, and a hashable rest to rebuild it.

    Dataclasses that are not registered pytrees are looked into (their fields), as
    ``scatter`` does.
    """
    encoded = any(_plain_dataclass(x) for x in jax.tree_util.tree_leaves(tree))
    if encoded:
        tree = _encode(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dyn = [x for x in leaves if _dynamic(x)]
    static = tuple((i, x) for i, x in enumerate(leaves) if not _dynamic(x))
    for _, x in static:
        try:
            hash(x)
        except TypeError:
            raise TypeError(
                f"non-array argument {x!r} of type {type(x).__name__} is not hashable; "
                f"replicas receive non-array arguments as compile-time constants, so make "
                f"it hashable (a tuple, a frozen dataclass) or an array") from None
    return dyn, (treedef, static, encoded)


def rebuild(dyn: Sequence, key: tuple) -> Any:
    """Inverse of :func:`partition`."""
    treedef, static = key[0], key[1]
    fixed = dict(static)
    it = iter(dyn)
    leaves = [fixed[i] if i in fixed else next(it) for i in range(treedef.num_leaves)]
    tree = jax.tree_util.tree_unflatten(treedef, leaves)
    return _decode(tree) if len(key) > 2 and key[2] else tree


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def fold_keys(leaves: Sequence, index: Any) -> list:
    """``leaves`` with ``index`` folded into every typed PRNG key array."""
    return [jax.random.fold_in(x, index) if _is_key(x) else x for x in leaves]


class OutputMeta(NamedTuple):
    """How to rebuild a replica's output from the arrays a program returned.

    Attributes:
      treedef: the output's tree structure.
      static: ``(leaf index, value)`` of each non-array leaf (strings, Python objects).
      scalar: per returned array, whether it was a 0-d output unsqueezed to shape (1,).
    """

    treedef: Any
    static: tuple
    scalar: tuple


def split_output(out: Any, expand: bool, dim: int) -> tuple[list, OutputMeta]:
    leaves, treedef = jax.tree_util.tree_flatten(out)
    arrays, static, scalar = [], [], []
    for i, x in enumerate(leaves):
        if not _dynamic(x):
            static.append((i, x))
            continue
        x = jnp.asarray(x)
        if expand and x.ndim == 0:
            if dim != 0:
                raise ValueError(
                    f"a replica returned a scalar, which cannot be gathered along dim {dim}; "
                    f"return arrays with a dimension {dim}, or use dim=0")
            x = jnp.reshape(x, (1,))
            scalar.append(True)
        elif expand and x.ndim <= dim:
            raise ValueError(
                f"a replica returned an array of shape {tuple(x.shape)}, which has no "
                f"dimension {dim} to gather along; return arrays with a dimension {dim}")
        else:
            scalar.append(False)
        arrays.append(x)
    return arrays, OutputMeta(treedef, tuple(static), tuple(scalar))


def join_output(arrays: Sequence, meta: OutputMeta) -> Any:
    """Rebuild an output from its arrays and :class:`OutputMeta`."""
    return rebuild(arrays, (meta.treedef, meta.static))


def check_same_output(meta_a: OutputMeta, meta_b: OutputMeta, m: int) -> None:
    """Raise unless replica ``m``'s output (``meta_b``) is structured like replicas
    0..m-1's (``meta_a``); dicts with other keys get torch's ``gather`` error."""
    if (meta_a.treedef != meta_b.treedef or meta_a.scalar != meta_b.scalar
            or [i for i, _ in meta_a.static] != [i for i, _ in meta_b.static]):
        if meta_a.treedef != meta_b.treedef:  # dicts with other keys: torch's error
            gather([jax.tree_util.tree_unflatten(t, [0] * t.num_leaves)
                    for t in (meta_a.treedef, meta_b.treedef)], "cpu")
        raise ValueError(
            f"replica {m} returned an output structured differently from replicas 0..{m - 1} "
            f"({meta_b.treedef} vs {meta_a.treedef}); every replica must return the same "
            f"structure (dicts with the same keys, arrays in the same places)")
