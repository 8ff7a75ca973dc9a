"""One jitted program per placement over a list of arrays (floor 0).

Work on each leaf of a tree as an eager op compiles a program per leaf shape; a
jitted ``list -> list`` function run once per group of leaves that live alike (one
sharding, committed or not) compiles one per tree. Used by the copies before a donated
step (``jdist/_donation.py``) and the first replica's rows (``jdist/ddp/_placement.py``);
``tests/ddp/test_few_programs.py`` counts the programs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

__all__ = ["by_placement", "one_program"]


def by_placement(fn: Callable[[list], list], xs: list) -> list:
    """``fn`` (jitted, element-wise over its list) applied to ``xs`` once per group of
    arrays with the same sharding and commitment; results in ``xs``'s order."""
    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault((x.sharding, x.committed), []).append(i)
    out: list = [None] * len(xs)
    for idx in groups.values():
        for i, y in zip(idx, fn([xs[i] for i in idx]), strict=True):
            out[i] = y
    return out


def one_program(fn: Callable) -> Callable[[list], list]:
    """``fn`` of one array as a jitted function of a list of them."""
    return jax.jit(lambda xs: [fn(x) for x in xs])
