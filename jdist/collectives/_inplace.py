"""Torch's in-place outputs on immutable arrays: refuse what would read a stale value.

``torch.distributed.all_reduce(t)`` and its kin update ``t`` and return nothing, so
ported code calls them as statements. A ``jax.Array`` cannot be updated: jdist returns
the result, and a statement call would silently keep the old value. :func:`check_kept`
raises :class:`~jdist.errors.ImmutableTargetError` in exactly that case: the output
argument is a ``jax.Array`` and the caller discards the call's value (the instruction
after the call in the caller's bytecode pops it). Nothing else is refused: a used
result, a numpy output (updated in place), or a call whose use cannot be read.
"""

from __future__ import annotations

import bisect
import dis
import sys
import weakref
from typing import Any

import jax

from jdist.errors import ImmutableTargetError

__all__ = ["check_kept", "result_discarded"]

_CODE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # code -> (offsets, ops)


def _instructions(code: Any) -> tuple[list, list]:
    """The offsets and names of ``code``'s instructions (inline caches left out)."""
    found = _CODE.get(code)
    if found is None:
        ins = list(dis.get_instructions(code))
        found = _CODE[code] = ([i.offset for i in ins], [i.opname for i in ins])
    return found


def result_discarded(depth: int) -> bool:
    """Whether the frame ``depth`` levels above the caller throws away the value of the
    call it is making: its next instruction after the call pops it (False when that
    cannot be read). The frame's ``f_lasti`` is the call or, on Python 3.11, the last
    inline cache after it."""
    try:
        frame = sys._getframe(depth + 1)
        offsets, ops = _instructions(frame.f_code)
        i = bisect.bisect_right(offsets, frame.f_lasti)
        return i < len(ops) and ops[i] == "POP_TOP"
    except (ValueError, TypeError, AttributeError):
        return False


def check_kept(target: Any, what: str, arg: str = "tensor") -> None:
    """Raise when ``target`` (the call's in-place output) is a ``jax.Array`` and the
    user's call of ``jdist.<what>`` (the caller's caller) discards the result."""
    if isinstance(target, jax.Array) and result_discarded(2):
        raise ImmutableTargetError(
            f"jdist.{what}({arg}=<jax.Array {tuple(target.shape)} {target.dtype}>) was "
            f"called as a statement: torch updates {arg} in place, but a jax.Array cannot "
            f"change, so the value read next would be the old one. Use the result "
            f"({arg} = jdist.{what}({arg}, ...)) or pass a numpy array (updated in place "
            "as in torch)")
