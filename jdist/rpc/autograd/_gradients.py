"""``get_gradients``' result: a mapping from parameter Variables to their gradients."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.rpc._rref import RRef
from jdist.rpc.autograd._params import param_variables

__all__ = ["GradientMap"]


class GradientMap(Mapping):
    """This worker's gradients in one context, keyed by parameter (torch's dict).

    Keys are the ``nnx.Variable`` objects themselves, compared by identity (like torch's
    tensors). ``grads[key]`` also accepts an NNX module (an ``nnx.State`` of its
    parameters' gradients, zeros for parameters without one) and an RRef owned here (the
    same for its value).
    """

    def __init__(self, entries: dict[int, list]):
        self._entries = {k: (v[0], v[1]) for k, v in entries.items()}

    def __repr__(self) -> str:
        return f"GradientMap({len(self)} parameters)"

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Any]:
        return (var for var, _ in self._entries.values())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, nnx.Variable) and id(key) in self._entries

    def get_variable(self, var: Any) -> Any:
        """The gradient of Variable ``var`` or ``None``."""
        entry = self._entries.get(id(var))
        return None if entry is None else entry[1]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, RRef):
            key = key.local_value()
        if isinstance(key, nnx.Variable):
            entry = self._entries.get(id(key))
            if entry is None:
                raise KeyError(f"no gradient for {type(key).__name__} with shape "
                               f"{key.get_value().shape} in this context")
            return entry[1]
        if isinstance(key, nnx.Module):
            state = nnx.state(key, nnx.Param)
            variables = param_variables(key)
            leaves, tdef = jax.tree_util.tree_flatten(state)
            grads = []
            for var, leaf in zip(variables, leaves, strict=True):
                g = self.get_variable(var)
                grads.append(jax.numpy.zeros_like(leaf) if g is None else g)
            return jax.tree_util.tree_unflatten(tdef, grads)
        raise KeyError(f"gradients are keyed by nnx.Variable, NNX module or owned RRef, got "
                       f"{type(key).__name__}")

    def items(self):  # type: ignore[override]
        return [(var, g) for var, g in self._entries.values()]

    def __eq__(self, other: object) -> bool:
        """Equal to a mapping with the same Variables (by identity) and equal gradients
        (``grads != {}`` tests for any gradient, as with torch's dict). Mapping's own
        ``__eq__`` would hash the keys, and ``nnx.Variable`` is not hashable."""
        if isinstance(other, GradientMap):
            theirs = other._entries
        elif isinstance(other, Mapping):
            if len(other) != len(self):
                return False
            try:
                theirs = {id(k): (k, v) for k, v in other.items()}
            except TypeError:
                return False
        else:
            return NotImplemented
        if theirs.keys() != self._entries.keys():
            return False
        return all(np.array_equal(np.asarray(g), np.asarray(theirs[k][1]))
                   for k, (_, g) in self._entries.items())

    __hash__ = None  # type: ignore[assignment]  # mutable mapping semantics, like dict
