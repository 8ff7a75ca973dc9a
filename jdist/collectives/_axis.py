"""Which mesh axis a group, an axis name or ``None`` means, and whether it is bound here.

One helper for every in-graph user of a replica axis: the in-graph collectives
(``_traced``), the optimizers (``jdist.optim``) and DDP's comm hooks. ``group`` is an
axis name, a tuple of axis names, a :class:`~jdist.collectives.ProcessGroup` (its
``axis_name``) or ``None`` (the default group's axis, ``"dp"`` without
``init_process_group``). An axis is *bound* inside ``jax.shard_map`` (or anything else
that names it, e.g. ``vmap(axis_name=...)``); outside, :func:`bound_size` raises
:class:`UnboundAxisError` with the caller's context and fix.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from jdist.collectives._group import ProcessGroup, resolve_group

__all__ = ["UnboundAxisError", "axis_of", "bound_size", "is_bound"]


class UnboundAxisError(NameError, ValueError):
    """A collective's mesh axis is not bound where it was called (outside ``shard_map``).

    A ``NameError`` as JAX's own unbound-axis error is, and a ``ValueError`` as the
    optimizers' and hooks' argument errors are.
    """


def axis_of(group: Any) -> str | tuple[str, ...]:
    """The mesh axis name(s) that ``group`` stands for.

    Args:
      group: an axis name, a non-empty tuple of axis names, a ``ProcessGroup`` or
        ``None`` (the default group, else the embedded local group: axis ``"dp"``).

    Returns:
      A ``str`` or a tuple of ``str``, as ``lax`` collectives accept.

    Raises:
      TypeError: anything else (a list gets the hint to pass a tuple).
    """
    if group is None or isinstance(group, ProcessGroup):
        return resolve_group(group).axis_name
    if isinstance(group, str):
        return group
    if isinstance(group, tuple) and group and all(isinstance(a, str) for a in group):
        return group[0] if len(group) == 1 else group
    if isinstance(group, list):
        raise TypeError(
            f"group must be an axis name, a tuple of axis names or a ProcessGroup, got the "
            f"list {group!r}; pass tuple({group!r}) instead"
        )
    raise TypeError(
        f"group must be an axis name (str), a non-empty tuple of axis names, a jdist "
        f"ProcessGroup or None, got {group!r}"
    )


def is_bound(axes: Any) -> bool:
    """Whether the mesh axis (or every axis of a tuple) is bound here."""
    try:
        lax.axis_size(axes)
    except NameError:
        return False
    return True


def bound_size(axes: Any, what: str, hint: str) -> int:
    """The size of the bound axis ``axes`` (the product over a tuple).

    Args:
      axes: an axis name or tuple of names (see :func:`axis_of`).
      what: who needs it, for the message (e.g. ``"functional.all_reduce"``).
      hint: what to do instead, appended to the message.

    Raises:
      UnboundAxisError: ``"<what>: mesh axis <axes> is not bound here. <hint>"``.
    """
    try:
        return int(lax.axis_size(axes))
    except NameError as e:
        raise UnboundAxisError(f"{what}: mesh axis {axes!r} is not bound here. {hint}") from e
