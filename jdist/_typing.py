"""Type aliases shared across jdist."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax

PyTree = Any
Array = jax.Array
ArrayLike = Any
AxisName = Hashable | tuple
Rank = int
Params = PyTree
Grads = PyTree

__all__ = ["PyTree", "Array", "ArrayLike", "AxisName", "Rank", "Params", "Grads"]
