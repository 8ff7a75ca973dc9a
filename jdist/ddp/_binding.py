"""A DDP step's binding to an NNX module (and optimizer): read the arrays, write the outputs.

``nnx.split`` / ``nnx.update`` walk the whole object graph on every call, per call and
per object. A step function instead binds once, at its
first call: it finds the module's (and the optimizer's) Variables, then reads their
arrays as flat lists in the split states' leaf order and writes the step's outputs back
into the same Variables. Like ``nnx.cached_partial`` (and torch's DDP, whose hooks are
bound to the parameters at construction) this assumes the graph keeps its Variables:
values may change between steps, a replaced Variable or submodule is not seen.

This is the only file of ``jdist.ddp`` that uses flax internals, checked against
flax 0.12.x (0.12.0 - 0.12.8):

- ``flax.nnx.graphlib.flatten(node, with_paths=True)`` finds the Variable objects by
  path. If it is missing or behaves differently, :class:`Binding` reports
  ``fast = False`` and every call falls back to ``nnx.split`` / ``nnx.update``;
- ``Variable.set_raw_value(x, _unsafe_bypass_check=True)`` skips flax's per-Variable
  "may this trace level mutate it" check for all but the first Variable of a write (the
  first one is checked, and all of them belong to the same module at the same trace
  level); those checks were two thirds of a small model's per-step host time. Without
  the keyword every Variable is set through the checked ``set_raw_value``.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import numpy as np
from flax import nnx

__all__ = ["Binder", "Binding", "split", "merge"]

FLAX_CHECKED = "0.12"


def split(module: Any) -> tuple:
    """``(graphdef, params, buffers)``: ``nnx.Param`` s and everything else."""
    return nnx.split(module, nnx.Param, ...)


def merge(gdef: Any, *states: Any) -> Any:
    """``nnx.merge`` with fresh Variables created at the current trace level."""
    return nnx.merge(gdef, *(jax.tree.map(lambda x: x, s) for s in states))


def _can_bypass() -> bool:
    try:
        return "_unsafe_bypass_check" in inspect.signature(
            nnx.Variable.set_raw_value).parameters
    except (AttributeError, TypeError, ValueError):
        return False


_BYPASS = _can_bypass()


def _find_variables(node: Any, state: Any) -> list:
    """The Variable objects of ``node`` behind ``state``'s leaves, in leaf order."""
    from flax.nnx import graphlib

    _, flat = graphlib.flatten(node, with_paths=True)
    by_path = dict(zip(flat.paths, flat.leaves, strict=True))
    return [by_path[p] for p in nnx.to_flat_state(state).paths]


def _plain(state: Any) -> bool:
    """Whether every Variable holds one plain array (not a ref, tuple or lazy value)."""
    values = [v.get_raw_value() for _, v in nnx.to_flat_state(state)]
    return len(values) == len(jax.tree.leaves(state)) and all(
        isinstance(x, (jax.Array, np.ndarray)) for x in values)


class _Slots:
    """The Variables behind one split ``State``: read as a flat list, written in place."""

    __slots__ = ("variables", "treedef")

    def __init__(self, node: Any, state: Any):
        self.variables = _find_variables(node, state)
        self.treedef = jax.tree.structure(state)

    def values(self) -> list:
        return [v.get_raw_value() for v in self.variables]

    def tree(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.values())

    def write(self, values: Any) -> bool:
        """Set the Variables from a flat list or a tree of the bound structure; ``False``
        (nothing written) when ``values`` has another structure."""
        if not isinstance(values, list):
            values, treedef = jax.tree.flatten(values)
            if treedef != self.treedef:
                return False
        if len(values) != len(self.variables):
            return False
        for i, (v, x) in enumerate(zip(self.variables, values, strict=True)):
            if i and _BYPASS:
                v.set_raw_value(x, _unsafe_bypass_check=True)
            else:
                v.set_raw_value(x)
        return True


class Binding:
    """One step function's view of a module (and optimizer), found at its first call.

    Attributes:
      gdef, ogdef: the module's and the optimizer's graphdefs (``ogdef`` None without one).
      fast: the Variables were found and hold plain arrays: :meth:`read` and
        :meth:`write` go straight to them. Otherwise (a future flax, refs, lazy values)
        every read splits the module and every write is ``nnx.update``.
      treedefs: the tree structures of (params, buffers, opt_state) read at bind time.
      cache: the step's pieces built for this binding (its owner's to fill).
    """

    def __init__(self, module: nnx.Module, optimizer: Any = None):
        self.module, self.optimizer = module, optimizer
        self.gdef, params, buffers = split(module)
        states = [params, buffers]
        self.ogdef = None
        if optimizer is not None:
            self.ogdef, ostate = nnx.split(optimizer)
            states.append(ostate)
        self._states = states  # the slow path's values for the first read
        self.cache: dict = {}
        self.fast = all(_plain(s) for s in states)
        self._slots: list = []
        if self.fast:
            try:
                nodes = [module, module] + ([optimizer] if optimizer is not None else [])
                self._slots = [_Slots(n, s) for n, s in zip(nodes, states, strict=True)]
            except (AttributeError, TypeError, KeyError, ValueError, ImportError):
                self.fast = False
        self.treedefs = tuple(jax.tree.structure(s) for s in states)

    def read(self, flat: bool) -> list:
        """``[params, buffers(, opt_state)]``: flat lists of arrays (``flat`` and
        :attr:`fast`) or ``State`` trees."""
        if self.fast:
            return [s.values() if flat else s.tree() for s in self._slots]
        states, self._states = self._states, None
        if states is None:  # not bound: split again (the module may have changed)
            _, params, buffers = split(self.module)
            states = [params, buffers]
            if self.optimizer is not None:
                states.append(nnx.split(self.optimizer)[1])
        return states

    def write(self, buffers: Any, params: Any = None, opt_state: Any = None) -> bool:
        """Write a step's outputs (flat lists or trees; ``params``/``opt_state`` None:
        not written). Returns ``False`` when an output had another structure than the
        bound one (the step added or removed variables): it was written with
        ``nnx.update`` and this binding is stale."""
        outs = [(params, self.module, 0), (buffers, self.module, 1),
                (opt_state, self.optimizer, 2)]
        kept = True
        for value, node, i in outs:
            if value is None or node is None:
                continue
            if self.fast and self._slots[i].write(value):
                continue
            if isinstance(value, list):
                value = jax.tree.unflatten(self.treedefs[i], value)
            nnx.update(node, value)
            kept = False
        return kept and self.fast


class Binder:
    """The current :class:`Binding` of one step function, rebuilt once it went stale."""

    __slots__ = ("module", "optimizer", "_binding")

    def __init__(self, module: nnx.Module, optimizer: Any = None):
        self.module, self.optimizer = module, optimizer
        self._binding: Binding | None = None

    def get(self) -> Binding:
        b = self._binding
        if b is None:
            b = Binding(self.module, self.optimizer)
            if b.fast:
                self._binding = b
        return b

    def write(self, b: Binding, buffers: Any, params: Any = None,
              opt_state: Any = None) -> None:
        """:meth:`Binding.write`; a stale binding is dropped (the next call binds again)."""
        if not b.write(buffers, params, opt_state):
            self._binding = None
