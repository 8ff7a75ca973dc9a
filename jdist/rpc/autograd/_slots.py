"""Slots: the differentiable arrays of a sent or returned structure, by position.

A structure crosses the wire as a skeleton (``_Slot(i)`` at each differentiable leaf) plus
the list of those arrays; the engine and the compiled forward path both build on this.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.rpc.autograd._params import flatten_args

__all__ = ["_Slot", "_fill", "_is_diff_value", "_is_slot", "_split_outputs", "to_array"]


class _Slot:
    """Stands for the ``index``-th differentiable array in a sent structure (a leaf)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return _Slot, (self.index,)

    def __repr__(self) -> str:
        return f"_Slot({self.index})"


def _is_slot(x: Any) -> bool:
    return isinstance(x, _Slot)


def _is_diff_value(x: Any) -> bool:
    """A result leaf that carries a gradient: a floating (or complex) array."""
    if isinstance(x, (jax.Array, np.ndarray)):
        return bool(jnp.issubdtype(x.dtype, jnp.inexact))
    return False


def _split_outputs(out: Any) -> tuple[Any, list]:
    """(structure with Slots at the differentiable leaves, those leaves)."""
    leaves, tdef = flatten_args(out)
    diff, skel = [], []
    for leaf in leaves:
        if _is_diff_value(leaf):
            skel.append(_Slot(len(diff)))
            diff.append(leaf)
        else:
            skel.append(leaf)
    return jax.tree_util.tree_unflatten(tdef, skel), diff


def _fill(skeleton: Any, values: list) -> Any:
    leaves, tdef = jax.tree_util.tree_flatten(skeleton, is_leaf=_is_slot)
    return jax.tree_util.tree_unflatten(
        tdef, [values[x.index] if _is_slot(x) else x for x in leaves])


def to_array(x: Any, dtype: Any = None) -> jax.Array:
    """``x`` (a received numpy array, or a jax array) as a jax array, by a transfer.

    ``jnp.asarray`` of a numpy array lifts it with JAX's ``stage`` primitive, which
    compiles one small program per shape and dtype: with variable-size batches that is
    a compilation per step."""
    if isinstance(x, jax.Array):
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)
    if isinstance(x, jax.core.Tracer):
        return jnp.asarray(x, dtype)
    return jax.device_put(np.asarray(x, dtype))
