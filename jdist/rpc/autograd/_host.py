"""A host function called from inside a compiled program, at the least cost JAX offers.

``jax.pure_callback`` puts every operand on a device (``jax.device_put``) and copies the
results back through ``np.asarray``: about 70-130 us per call here, paid on every RPC a
compiled distributed-autograd pass makes (``_compiled_root.py``). JAX's
``buffer_callback`` hands the host function the program's own buffers instead (about
1 us). :func:`host_call` uses it where this JAX has it and ``pure_callback`` where not;
both have ``pure_callback``'s contract (no side effects the program relies on; the
caller orders calls by data dependencies).

Invariant: the host function sees numpy *copies* of its operands (a buffer is only
valid while the callback runs, and an RPC may still be sending its bytes after it
returns), and returns one array per spec, of the spec's shape; each is converted to the
spec's dtype. Guarded by ``tests/rpc/test_host_call.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["host_call"]

try:  # experimental in JAX 0.7+; absent in older releases
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - depends on the installed JAX
    _buffer_callback = None


def host_call(fn: Callable[..., Sequence[Any]], specs: Sequence[jax.ShapeDtypeStruct],
              *operands: Any, use_buffers: bool | None = None) -> tuple:
    """``fn(*numpy operands)`` as an operation of the program being traced; returns one
    traced array per ``specs`` entry. ``use_buffers=False`` forces ``pure_callback``
    (tests compare the two)."""
    specs = tuple(specs)
    if use_buffers is False or _buffer_callback is None:
        return tuple(jax.pure_callback(fn, specs, *operands))

    def body(ctx: Any, outs: Any, *bufs: Any) -> None:
        del ctx
        results = fn(*[np.asarray(b).copy() for b in bufs])
        if len(results) != len(specs):
            raise ValueError(f"host function {fn!r} returned {len(results)} arrays for "
                             f"{len(specs)} outputs; return one array per output spec")
        for out, res, spec in zip(outs, results, specs, strict=True):
            res = np.asarray(res, spec.dtype)
            if res.shape != tuple(spec.shape):
                raise ValueError(f"host function {fn!r} returned shape {res.shape} for an "
                                 f"output of shape {tuple(spec.shape)}")
            np.asarray(out)[...] = res

    return tuple(_buffer_callback(body, specs)(*operands))
