"""Slots: the differentiable arrays of a sent or returned structure, by position.

A structure crosses the wire as a skeleton (``_Slot(i)`` at each differentiable leaf) plus
the list of those arrays; the engine and the compiled forward path both build on this,
and on :class:`_Link`, where the cotangents of a differentiable RRef's value gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.rpc._serialize import rebuild_jax
from jdist.rpc.autograd._params import flatten_args

if TYPE_CHECKING:
    from jdist.rpc._futures import Future

__all__ = ["_Link", "_Slot", "_fill", "_is_diff_value", "_is_slot", "_split_outputs", "to_array"]


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
    return rebuild_jax(np.asarray(x, dtype))  # jax.device_put's placement, faster


class _Link:
    """A differentiable ``remote()``'s state on the caller: cotangents from its
    ``to_here()`` calls, summed until the remote call's own backward rule sends them.

    Cotangents that come back with the backward of a call the RRef was passed to
    arrive later: that call's backward message is in flight (``pending``).
    """

    def __init__(self) -> None:
        self.cts: list | None = None
        self._pending: list[tuple[Future, int]] = []

    def add(self, cts: list) -> None:
        self.cts = cts if self.cts is None else [a + b for a, b in zip(self.cts, cts,
                                                                           strict=True)]

    def add_pending(self, fut: Future, k: int) -> None:
        """Entry ``k`` of the RRef cotangents in ``fut``'s ``(ct_xs, rref_cts)``."""
        self._pending.append((fut, k))

    def collect(self) -> list | None:
        """All the cotangents (waiting for those in flight); None if none came."""
        pending, self._pending = self._pending, []
        for fut, k in pending:
            self._add_from(fut.wait(), k)
        cts, self.cts = self.cts, None
        return cts

    def _add_from(self, answer: tuple, k: int) -> None:
        c = answer[1][k]
        if c is not None:
            self.add(c)

    def collect_then(self, send: Callable[[list | None], Future]) -> Future:
        """``send(all the cotangents)`` (None if none came) once those in flight are in,
        without waiting for them here: a future of the value of the future ``send``
        returns. The backward pass goes on meanwhile, so the backward message of one
        micro-batch's RRef to its owner does not hold up the next micro-batch's."""
        from jdist.rpc._futures import Future, collect_all, copy_into

        pending, self._pending = self._pending, []
        if not pending:
            cts, self.cts = self.cts, None
            return send(cts)
        out: Future = Future(_desc="the backward message of a differentiable remote()")

        def all_in(_: Future) -> None:
            try:
                for fut, k in pending:
                    self._add_from(fut.value(), k)
                cts, self.cts = self.cts, None
                inner = send(cts)
            except BaseException as e:  # noqa: BLE001 - the backward pass's error
                out.set_exception(e)
                return
            inner.add_done_callback(lambda f: copy_into(f, out))

        collect_all(fut for fut, _ in pending).add_done_callback(all_in)
        return out
