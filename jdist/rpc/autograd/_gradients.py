"""``get_gradients``' result: a mapping from parameters to their gradients.

torch's ``get_gradients`` returns ``{Tensor: Tensor}``: tensors hash by identity. An
``nnx.Variable`` does not hash at all (its ``==`` compares values), so the keys here are
:class:`ParamKey` s: one per parameter, hashable by the Variable's identity, equal to
it, and standing in for it (attributes, ``key[...]``, ``np.asarray(key)``). torch's
idioms then work unchanged: ``{k: v for k, v in grads.items()}``, ``dict(grads)``,
``grads[param]``, ``grads != {}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.rpc._rref import RRef
from jdist.rpc.autograd._params import param_variables

__all__ = ["GradientMap", "ParamKey"]


class ParamKey:
    """A parameter (an ``nnx.Variable``) as a dict key: hashed and compared by identity,
    like torch's tensors as keys.

    ``key.variable`` is the Variable; other attributes, indexing and ``np.asarray`` read
    through to it. ``ParamKey(param)`` looks a parameter up in a plain dict copied from a
    :class:`GradientMap` (``d[ParamKey(param)]``; the GradientMap itself takes ``param``).
    """

    __slots__ = ("variable",)

    def __init__(self, variable: Any):
        if isinstance(variable, ParamKey):
            variable = variable.variable
        if not isinstance(variable, nnx.Variable):
            raise TypeError(f"ParamKey takes an nnx.Variable (e.g. an nnx.Param), got "
                            f"{type(variable).__name__}")
        object.__setattr__(self, "variable", variable)

    def __hash__(self) -> int:
        return id(self.variable)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ParamKey):
            return other.variable is self.variable
        if isinstance(other, nnx.Variable):
            return other is self.variable
        return NotImplemented

    def __getattr__(self, name: str) -> Any:
        if name == "variable":  # not set yet (copy/pickle internals)
            raise AttributeError(name)
        return getattr(self.variable, name)

    def __getitem__(self, index: Any) -> Any:
        return self.variable[index]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        del copy
        return np.asarray(self.variable.get_value(), dtype)

    def __reduce__(self):
        # flax's own pickle state of the Variable, its value as a host (numpy) copy: the
        # receiver holds a copy of the parameter as torch's keys arrive as CPU tensors,
        # without a device put per key (get_gradients' replies carry one key a gradient)
        state = dict(self.variable.__getstate__())
        if "_raw_value" not in state:  # another flax layout: the Variable as it pickles
            return ParamKey, (self.variable,)
        state["_raw_value"] = _host_copy(state["_raw_value"])
        return _received_key, (type(self.variable), state)

    def __repr__(self) -> str:
        value = self.variable.get_value()
        return (f"ParamKey({type(self.variable).__name__} {getattr(value, 'dtype', '')}"
                f"{list(getattr(value, 'shape', ()))})")


def _host_copy(value: Any) -> Any:
    return np.asarray(value) if isinstance(value, jax.Array) else value


def _received_key(variable_type: type, state: dict) -> ParamKey:
    """Receiver side of a pickled :class:`ParamKey`: a new Variable of the same type and
    metadata, holding the sent value as a numpy array."""
    variable = object.__new__(variable_type)
    variable.__setstate__(state)
    return ParamKey(variable)


def _variable_of(key: Any) -> Any:
    return key.variable if isinstance(key, ParamKey) else key


class GradientMap(Mapping):
    """This worker's gradients in one context, keyed by parameter (torch's dict).

    Iterating gives a :class:`ParamKey` per parameter (hashable, unlike
    ``nnx.Variable``, so ``dict(grads)`` and dict comprehensions work). ``grads[key]``
    takes a ``ParamKey`` or the ``nnx.Variable`` itself, an NNX module (an ``nnx.State``
    of its parameters' gradients, zeros for parameters without one) or an RRef owned
    here (the same for its value).
    """

    def __init__(self, entries: dict[int, list]):
        self._entries = {k: (ParamKey(v[0]), v[1]) for k, v in entries.items()}

    def __repr__(self) -> str:
        return f"GradientMap({len(self)} parameters)"

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ParamKey]:
        return (key for key, _ in self._entries.values())

    def __contains__(self, key: object) -> bool:
        var = _variable_of(key)
        return isinstance(var, nnx.Variable) and id(var) in self._entries

    def get_variable(self, var: Any) -> Any:
        """The gradient of Variable ``var`` (or its ParamKey) or ``None``."""
        entry = self._entries.get(id(_variable_of(var)))
        return None if entry is None else entry[1]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, RRef):
            key = key.local_value()
        key = _variable_of(key)
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
        raise KeyError(f"gradients are keyed by nnx.Variable (or its ParamKey), NNX module "
                       f"or owned RRef, got {type(key).__name__}")

    def items(self):  # type: ignore[override]
        """``(ParamKey, gradient)`` pairs."""
        return [(key, g) for key, g in self._entries.values()]

    def values(self):  # type: ignore[override]
        return [g for _, g in self._entries.values()]

    def __eq__(self, other: object) -> bool:
        """Equal to a mapping with the same parameters (by identity; keys may be
        ParamKeys or Variables) and equal gradients (``grads != {}`` tests for any
        gradient, as with torch's dict)."""
        if isinstance(other, GradientMap):
            theirs = other._entries
        elif isinstance(other, Mapping):
            if len(other) != len(self):
                return False
            try:
                theirs = {id(_variable_of(k)): (k, v) for k, v in other.items()}
            except TypeError:
                return False
        else:
            return NotImplemented
        if theirs.keys() != self._entries.keys():
            return False
        return all(np.array_equal(np.asarray(g), np.asarray(theirs[k][1]))
                   for k, (_, g) in self._entries.items())

    __hash__ = None  # type: ignore[assignment]  # mutable mapping semantics, like dict
