"""``jdist.rpc.functions.async_execution``: remote functions that return a Future."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable)


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a :class:`jdist.rpc.Future` instead of a value.

    The RPC thread that ran ``fn`` is freed at once; the reply is sent when the
    returned future completes (for example a chained ``rpc_async(...).then(...)``).
    Apply it as the outermost decorator (on static/class methods, inside
    ``@staticmethod``), as in torch.

    Example::

        @async_execution
        def add_then_double(to, x):
            return rpc.rpc_async(to, operator.add, (x, 1)).then(lambda f: f.wait() * 2)
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper._jdist_async_execution = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
