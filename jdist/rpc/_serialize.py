"""Python objects <-> (pickle payload, raw buffers), arrays out of band.

Objects and function references go through pickle protocol 5. numpy arrays are not
copied into the payload: their memory is handed out as ``PickleBuffer`` views, which the
transport sends as separate frames straight from the array (and the receiver rebuilds
the array on top of the received frame, again without a copy). jax arrays travel the
same way as their host view and are rebuilt with ``jax.device_put`` on the receiver's
default device. ``persistent_id`` / ``persistent_load`` hooks let the agent swap RRefs
for ids (the fork protocol) while pickling.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["dumps", "loads", "describe_callable", "check_callable_picklable"]

PersistentId = Callable[[Any], Any]
PersistentLoad = Callable[[Any], Any]


def _is_jax_array(obj: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(obj, jax.Array)


def _jax_to_host(x: Any) -> Any:
    import numpy as np

    if not getattr(x, "is_fully_addressable", True):
        raise TypeError(
            f"cannot send a jax.Array sharded over processes (shape {x.shape}) by RPC: "
            "gather it first (jax.experimental.multihost_utils.process_allgather)")
    return np.asarray(x)


def _jax_from_host(arr: Any) -> Any:
    import jax

    return jax.device_put(arr)


class _Pickler(pickle.Pickler):
    def __init__(self, file, buffers: list, hook: PersistentId | None):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._hook = hook

    def persistent_id(self, obj: Any) -> Any:
        if self._hook is not None:
            pid = self._hook(obj)
            if pid is not None:
                return pid
        if _is_jax_array(obj):
            return ("jax", _jax_to_host(obj))
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, buffers: Sequence[Any], hook: PersistentLoad | None):
        super().__init__(file, buffers=buffers)
        self._hook = hook

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "jax":
            return _jax_from_host(pid[1])
        if self._hook is not None:
            return self._hook(pid)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def dumps(obj: Any, hook: PersistentId | None = None) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; return ``(payload, buffers)`` with array memory out of band.

    ``hook(obj)`` may return a persistent id (a picklable tuple) to replace ``obj``.
    """
    buffers: list = []
    f = io.BytesIO()
    _Pickler(f, buffers, hook).dump(obj)
    return f.getvalue(), [b.raw() for b in buffers]


def loads(payload: Any, buffers: Sequence[Any] = (), hook: PersistentLoad | None = None) -> Any:
    """Inverse of :func:`dumps`; arrays are rebuilt on top of ``buffers`` (no copy)."""
    return _Unpickler(io.BytesIO(payload), buffers, hook).load()


def describe_callable(func: Any) -> str:
    """``module.qualname`` of a function (for error messages)."""
    mod = getattr(func, "__module__", None)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if name is None:
        return repr(func)
    return f"{mod}.{name}" if mod else name


def check_callable_picklable(func: Any, dest: str) -> None:
    """Raise a clear ``TypeError`` if ``func`` cannot be sent by reference.

    Raises:
      TypeError: ``func`` is not callable, or it is a lambda / nested function / other
        object that pickle cannot name.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, got {func!r} of type {type(func).__name__}")
    name = getattr(func, "__qualname__", "")
    if "<lambda>" in name or "<locals>" in name:
        raise TypeError(
            f"cannot send {describe_callable(func)} to {dest}: lambdas and nested functions "
            "cannot be pickled by reference. Define the function at module level (in a module "
            "the remote worker can import) and pass that instead.")
    try:
        pickle.dumps(func, protocol=5)
    except Exception as e:
        raise TypeError(
            f"cannot send {describe_callable(func)} to {dest}: it cannot be pickled ({e}). "
            "Use a module-level function or a picklable callable object.") from e
