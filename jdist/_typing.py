"""Type aliases shared across jdist."""

from __future__ import annotations

from typing import Any, Hashable, Union

import jax

PyTree = Any
Array = jax.Array
ArrayLike = Any
AxisName = Union[Hashable, tuple]
Rank = int
Params = PyTree
Grads = PyTree

__all__ = ["PyTree", "Array", "ArrayLike", "AxisName", "Rank", "Params", "Grads"]
