"""Which arrays a compiled step may consume (donate), and the copies it makes first.

A step that replaces parameters and optimizer state donates them to XLA
(``jax.jit(donate_argnums=...)``): the new values are written into the old buffers, so
from its second step a training loop holds one copy of each instead of two (torch
updates in place; without donation every step's peak holds old and new parameters and
optimizer state). Used by DDP's ``train_step`` (parameters, optimizer state, comm-hook
state, accumulated ``no_sync`` gradients), ``ZeroRedundancyOptimizer.step`` and the RPC
``DistributedOptimizer``'s owners (their optimizer state).

Invariants (``tests/test_donation.py``):

1. A step consumes only arrays its owner made or owns (:meth:`Donation.made`): for DDP
   the parameters after its init sync, what a previous step returned, a functional
   optimizer state it initialized, and the state an ``nnx.Optimizer`` holds when
   ``train_step(loss_fn, optimizer)`` binds it (torch's optimizer state is the
   optimizer's own, and ``load_state_dict`` copies into it). Any other array (a module's
   parameters on one process before the first step, values loaded with ``nnx.update``
   from another module or a checkpoint later) is copied first, so whoever else holds it
   keeps it.
2. An array that appears twice among the donated leaves (tied parameters given one
   array, an optimizer state holding the parameters themselves) is copied for its second
   place (XLA cannot take one buffer twice, and the other place must survive).
3. Values equal a step without donation bit for bit; ``donate=False`` consumes nothing.

A reference the user took to an array the owner made (``model.w.value`` read between
steps) is consumed by the next step and raises JAX's "Array has been deleted" when used:
torch would show the new value there, so a stale read would be silently wrong.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp

from jdist._placed import by_placement, one_program

__all__ = ["Donation", "trim_host_memory"]

_copies = one_program(jnp.copy)  # (one program per placement: jdist/_placed.py)


class Donation:
    """The arrays one owner (a DDP engine, an optimizer) made, held weakly, and the
    copying rule."""

    def __init__(self) -> None:
        self._made: dict[int, weakref.ref] = {}

    def _is_made(self, x: Any) -> bool:
        ref = self._made.get(id(x))
        return ref is not None and ref() is x

    def own(self, placed: Any, held: Any, seen: set[int]) -> Any:
        """``placed`` (the arrays the step gets) with every leaf that may not be
        consumed replaced by a copy (see the module docstring). ``held``: the same tree
        as the module or optimizer holds it (placement may wrap a held array's buffer in
        a new global array, so DDP's arrays are recognized there); ``seen``: ids of the
        held arrays given to this call's donated arguments so far (updated)."""
        placed_leaves, tdef = jax.tree.flatten(placed)
        held_leaves = jax.tree.leaves(held)
        if len(held_leaves) != len(placed_leaves):  # not one structure: copy them all
            held_leaves = [None] * len(placed_leaves)
        out = list(placed_leaves)
        copy: list[int] = []  # the leaves that may not be consumed
        for i, (x, h) in enumerate(zip(placed_leaves, held_leaves, strict=True)):
            if isinstance(x, jax.Array):
                if h is None or id(h) in seen or not self._is_made(h):
                    copy.append(i)
                seen.add(id(h))
        for i, y in zip(copy, by_placement(_copies, [out[i] for i in copy]), strict=True):
            out[i] = y
        return jax.tree.unflatten(tdef, out)

    def made(self, *trees: Any, replace: bool = False) -> None:
        """Remember the arrays of ``trees`` as DDP's own (``replace``: forget the rest:
        a step's outputs, its inputs being consumed)."""
        if replace:
            self._made = {}
        for x in jax.tree.leaves(trees):
            if isinstance(x, jax.Array):
                self._made[id(x)] = weakref.ref(x)


def trim_host_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing
    elsewhere). glibc keeps freed memory for reuse, and arrays below its mmap threshold
    (which rises to 32 MB after the first large free) live on that heap, so a one-time
    phase that frees a lot (DDP's init sync stages the model several times over) would
    otherwise stay in the process's resident set and add to every later peak."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None
