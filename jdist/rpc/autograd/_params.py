"""Parameters seen by distributed autograd: NNX modules and Variables, direct or in RRefs.

A *parameter* is an ``nnx.Param`` (any ``nnx.Variable`` given on its own) living on
some worker; like torch's ``nn.Parameter`` it is a mutable holder, so an optimizer can
update it in place and gradients can be keyed by it. A function differentiated by
distributed autograd sees as parameters:

- every NNX module or Variable among its arguments;
- the value of every RRef among its arguments that is *owned by the worker running
  it* (``rref.local_value()`` and ``rref.to_here()`` then return the traced copy).

:class:`Tracked` splits one such holder into its parameter arrays (differentiated)
and the rest, rebuilds a copy from traced arrays inside the trace, and routes the
resulting gradients to the original Variables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jdist.rpc._rref import RRef

__all__ = ["Tracked", "is_holder_leaf", "flatten_args", "find_params", "param_variables"]


def is_holder_leaf(x: Any) -> bool:
    """Leaves for flattening RPC arguments: modules, Variables and RRefs stay whole."""
    return isinstance(x, (nnx.Module, nnx.Variable, RRef))


def flatten_args(tree: Any) -> tuple[list, Any]:
    """``jax.tree_util.tree_flatten`` keeping modules, Variables and RRefs whole."""
    return jax.tree_util.tree_flatten(tree, is_leaf=is_holder_leaf)


def param_variables(value: Any) -> list:
    """The parameter Variables of a holder, in ``nnx.split`` state order.

    Raises:
      TypeError: ``value`` is neither an NNX module nor an ``nnx.Variable``.
    """
    if isinstance(value, nnx.Variable):
        return [value]
    if isinstance(value, nnx.Module):
        vs = nnx.variables(value, nnx.Param)
        return jax.tree.leaves(vs, is_leaf=lambda x: isinstance(x, nnx.Variable))
    raise TypeError(f"a distributed-autograd parameter must be an flax.nnx.Module or "
                    f"nnx.Variable (e.g. nnx.Param), got {type(value).__name__}; wrap arrays "
                    "in nnx.Param(array)")


class _TrackedRRef(RRef):
    """An owned RRef whose ``local_value()`` is the traced copy of its value.

    Pickles as the original RRef (it can be passed on to other workers).
    """

    def __init__(self, orig: RRef, traced: Any):  # noqa: D107 - no RRef.__init__
        self._orig = orig
        self._traced = traced
        self._agent, self._owner = orig._agent, orig._owner
        self._rref_id, self._fork = orig._rref_id, orig._fork
        self._confirmed, self._created, self._entry = True, None, orig._entry
        self._live = False  # never releases anything: the original does

    def __reduce_ex__(self, protocol: int):
        return _same, (self._orig,)

    def local_value(self, timeout: float = -1) -> Any:
        del timeout
        return self._traced

    def to_here(self, timeout: float = -1) -> Any:
        del timeout
        return self._traced


def _same(x: Any) -> Any:
    return x


class Tracked:
    """One parameter holder (module or Variable), split for differentiation.

    Attributes:
      holder: the original module or Variable (never modified).
      variables: its parameter Variables, one per array in :meth:`values`.
    """

    def __init__(self, holder: Any, rref: RRef | None = None):
        self.holder = holder
        self.rref = rref
        self.variables = param_variables(holder)
        if isinstance(holder, nnx.Module):
            self._gdef, pstate, rest = nnx.split(holder, nnx.Param, ...)
            self._leaves, self._tdef = jax.tree_util.tree_flatten(pstate)
            self._rest = rest
            if len(self._leaves) != len(self.variables):  # pragma: no cover - flax layout
                raise RuntimeError("nnx.split and nnx.variables disagree on parameters")
        else:
            self._leaves = [holder.get_value()]
        self._copy: Any = None  # the last rebuilt copy (its state after the call)

    def values(self) -> list:
        """The parameter arrays (the primal inputs of the differentiated function)."""
        return list(self._leaves)

    def rebuild(self, traced: Sequence[Any]) -> Any:
        """A copy of the holder (or of its RRef) whose parameters are ``traced``."""
        if isinstance(self.holder, nnx.Module):
            pstate = jax.tree_util.tree_unflatten(self._tdef, list(traced))
            rest = jax.tree.map(lambda x: x, self._rest)
            value = nnx.merge(self._gdef, pstate, rest)
        else:
            value = type(self.holder)(traced[0])
        self._copy = value
        return value if self.rref is None else _TrackedRRef(self.rref, value)

    def state_after(self) -> Any:
        """The non-parameter state of the copy as the function left it (inside the
        trace: returned as auxiliary output, so it comes out concrete), or None."""
        if not isinstance(self.holder, nnx.Module) or self._copy is None:
            return None
        return nnx.split(self._copy, nnx.Param, ...)[2]

    def write_back(self, state: Any) -> None:
        """Put that state into the original module: RNG counters advance (dropout masks
        differ per step, as with a plain call) and batch statistics update, as in torch."""
        if state is not None:
            nnx.update(self.holder, state)

    def accumulate(self, ctx: Any, grads: Sequence[Any]) -> None:
        """Add ``grads`` (one per Variable) to ``ctx``'s gradients."""
        for var, g in zip(self.variables, grads, strict=True):
            ctx.accumulate(var, g)


def find_params(leaves: list, me: int) -> list[tuple[int, Tracked]]:
    """``(position, Tracked)`` for every parameter holder among flattened arguments.

    Args:
      leaves: from :func:`flatten_args`.
      me: the id of the worker running the function (only its own RRefs count).
    """
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, RRef):
            if leaf.owner().id != me:
                continue
            value = leaf.local_value()
            if isinstance(value, (nnx.Module, nnx.Variable)):
                out.append((i, Tracked(value, rref=leaf)))
        elif isinstance(leaf, (nnx.Module, nnx.Variable)):
            out.append((i, Tracked(leaf)))
    return out
