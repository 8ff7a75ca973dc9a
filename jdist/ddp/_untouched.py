"""Parameters without a gradient are left untouched by the optimizer step, as in torch.

torch's optimizers skip a parameter whose ``.grad`` is ``None``: one the loss never
reached (unused under ``find_unused_parameters=True``, or reached only through
``detach``). Its value, its optimizer state (momentum, Adam's moments) and its weight
decay all stay as they were. optax instead sees a zero gradient and still decays the
weight (AdamW, SGD with ``weight_decay``) and the moments. A DDP train step knows at
trace time which parameters got no gradient (symbolic zeros) in this step and in the
``no_sync`` steps accumulated into it; for those it keeps the old parameter and every
optimizer-state leaf that belongs to it.

An optimizer-state leaf belongs to a parameter when its key path ends with the
parameter's key path (the longest such parameter) and it has the parameter's shape:
optax's per-parameter states (``mu``, ``nu``, ``trace``, ...) mirror the parameter tree.
Scalars (Adam's ``count``) are shared by all parameters in optax, counted per parameter
in torch: a parameter without gradient at some steps and with one at others gets a
different bias correction (docs/migration.md, DDP).

Guarded by tests/ddp/test_untouched.py and tests/differential/test_ddp_diff.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["SkipTracker", "keep_untouched", "owners"]


def _keys(path) -> tuple:
    return tuple(str(k) for k in path)


def owners(params: Any, opt_state: Any) -> list[int | None]:
    """For each leaf of ``opt_state``, the index of the parameter it belongs to."""
    pflat = jax.tree_util.tree_flatten_with_path(params)[0]
    pkeys = [(_keys(path), jnp.shape(x)) for path, x in pflat]
    out: list[int | None] = []
    for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        keys, best = _keys(path), None
        for j, (pk, shape) in enumerate(pkeys):
            if (len(pk) <= len(keys) and keys[len(keys) - len(pk):] == pk
                    and jnp.shape(x) == shape
                    and (best is None or len(pk) > len(pkeys[best][0]))):
                best = j
        out.append(best)
    return out


def keep_untouched(skip: Sequence[int], params: Any, new_params: Any, opt_state: Any,
                   new_opt: Any) -> tuple[Any, Any]:
    """``(new_params, new_opt)`` with the parameters ``skip`` (leaf indices) and their
    optimizer-state leaves set back to ``params`` / ``opt_state`` (trace time)."""
    if not skip:
        return new_params, new_opt
    skip = set(skip)
    old_p = jax.tree.leaves(params)
    new_p, pdef = jax.tree.flatten(new_params)
    kept_p = [o if j in skip else n for j, (o, n) in enumerate(zip(old_p, new_p, strict=True))]
    old_o = jax.tree.leaves(opt_state)
    new_o, odef = jax.tree.flatten(new_opt)
    kept_o = [o if k in skip else n for k, o, n in zip(
        owners(params, opt_state), old_o, new_o, strict=True)]
    return jax.tree.unflatten(pdef, kept_p), jax.tree.unflatten(odef, kept_o)


class SkipTracker:
    """Warns once when a parameter the optimizer skipped at an earlier step (no
    gradient) has a gradient again: optax counts steps for all parameters, torch per
    parameter, so from then on the two differ for it (the departure above)."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        self._every = frozenset(range(len(self.paths)))
        self.skipped: set[int] = set()
        self.warned = False

    def note(self, with_grad: frozenset) -> None:
        """Record one optimizer step; ``with_grad``: the leaves that had a gradient."""
        back = with_grad & self.skipped
        self.skipped |= self._every - with_grad
        if back and not self.warned:
            self.warned = True
            warnings.warn(
                f"parameter {self.paths[min(back)]} got no gradient at an earlier step "
                "(the optimizer left it untouched, as torch does) and has one now. torch's "
                "optimizers count steps per parameter; optax's count is shared, so Adam's "
                "bias correction and step-indexed schedules for this parameter differ from "
                "torch's from here on. Give every parameter a gradient at every step (or "
                "use an optimizer without a step count) to match torch exactly.",
                stacklevel=5)
