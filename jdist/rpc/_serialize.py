"""Python objects <-> (pickle payload, raw buffers), arrays out of band.

Objects and function references go through pickle protocol 5. numpy arrays are not
copied into the payload: their memory is handed out as ``PickleBuffer`` views, which the
transport sends as separate frames straight from the array (and the receiver rebuilds
the array on top of the received frame, again without a copy). jax arrays travel the
same way as their host view and are rebuilt with ``jax.device_put`` on the receiver's
default device. The C pickler's ``dispatch_table`` does the type dispatch (no Python
call per pickled object); the agent adds a reducer that swaps RRefs for ids (the fork
protocol), rebuilt through :func:`load_hook` by the agent decoding the message.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["dumps", "loads", "load_hook", "rebuild_jax", "describe_callable",
           "check_callable_picklable", "register_rpc_reducer"]

Reducers = dict  # type -> reduce function, consulted by pickle's C dispatch table
_LOAD = threading.local()  # the agent decoding in this thread (for RRefs)
_jax_types: tuple = ()


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported *completely*: while another thread is still
    running its import, importing from it here would break that import (a "partially
    initialized module" error in the importing thread), and no array of it exists yet."""
    mod = sys.modules.get(name)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing",
                                           False)


def _jax_array_types() -> tuple:
    """Concrete jax array types, once jax is imported (never imports jax itself)."""
    global _jax_types
    if not _jax_types and _imported("jax"):
        try:
            from jax._src.array import ArrayImpl

            _jax_types = (ArrayImpl,)
        except ImportError:  # pragma: no cover - another jax layout
            import jax

            _jax_types = (type(jax.device_put(0)),)
    return _jax_types


_jitted: dict = {}  # "jax" / "flax" -> the types of their jitted functions


def _jitted_types() -> tuple:
    """The types of ``jax.jit`` and ``nnx.jit`` functions, once those libraries are
    imported (never imports them itself)."""
    if "jax" not in _jitted and _imported("jax"):
        import jax

        _jitted["jax"] = type(jax.jit(_identity))
    if "flax" not in _jitted and _imported("flax.nnx"):
        from flax import nnx

        _jitted["flax"] = type(nnx.jit(_identity))
    return tuple(_jitted.values())


def _identity(x: Any) -> Any:
    return x


def resolve_name(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` names (a jitted function sent by reference)."""
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _reduce_by_name(obj: Any) -> Any:
    """A jitted function by reference, as pickle sends a plain function: its module and
    qualified name must name it (pickle's own reduce looks for the function it wraps
    under that name, finds the jitted object and refuses)."""
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None)
    if module and name and "<" not in name:
        try:
            if resolve_name(module, name) is obj:
                return resolve_name, (module, name)
        except Exception:  # noqa: BLE001 - not importable by name: pickle's own error
            pass
    return obj.__reduce_ex__(5)


def _jax_to_host(x: Any) -> Any:
    if not getattr(x, "is_fully_addressable", True):
        raise TypeError(
            f"cannot send a jax.Array sharded over processes (shape {x.shape}) by RPC: "
            "gather it first (jax.experimental.multihost_utils.process_allgather)")
    return np.asarray(x)


def rebuild_jax(arr: Any) -> Any:
    """Receiver side of a jax array: onto this process's default device, uncommitted
    (as ``jax.device_put(arr)`` puts it, without its Python dispatch: a message of a
    model's gradients holds dozens of arrays; ``jdist.collectives.runtime.uncommitted``).
    ``arr`` is the message's own buffer, which nothing writes to afterwards."""
    from jdist.collectives.runtime import uncommitted

    return uncommitted(arr)


def _reduce_jax(x: Any) -> tuple:
    return rebuild_jax, (_jax_to_host(x),)


def _reduce_ndarray(a: np.ndarray) -> tuple:
    # numpy pickles arrays of user dtypes (bfloat16, float8, int4 from ml_dtypes) in
    # band, i.e. copied into the payload; send those as raw bytes out of band too
    if a.dtype.num >= 256 and a.flags.c_contiguous and not a.dtype.hasobject:
        raw = pickle.PickleBuffer(a.reshape(-1).view(np.uint8))
        return rebuild_user_dtype, (raw, a.dtype, a.shape)
    return a.__reduce_ex__(5)


def rebuild_user_dtype(raw: Any, dtype: Any, shape: tuple) -> np.ndarray:
    """Receiver side of :func:`_reduce_ndarray`: a view on the received bytes."""
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def load_hook(pid: Any) -> Any:
    """Rebuild a persistent object (an RRef) with the agent decoding in this thread."""
    hook = getattr(_LOAD, "hook", None)
    if hook is None:
        raise pickle.UnpicklingError(
            "this payload holds an RRef: it can only be unpickled by an RPC agent")
    return hook(pid)


_RPC_REDUCERS: Reducers = {}


def register_rpc_reducer(cls: type, reduce: Callable[[Any], tuple]) -> None:
    """Pickle ``cls`` (exact type) with ``reduce`` in RPC messages only: a class whose
    plain ``__reduce__`` refuses (``RemoteModule``) can still travel by RPC."""
    _RPC_REDUCERS[cls] = reduce


def dumps(obj: Any, reducers: Reducers | None = None) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; return ``(payload, buffers)`` with array memory out of band.

    ``reducers`` maps exact types to reduce functions (the agent swaps RRefs for ids);
    jax arrays travel as their host numpy view.
    """
    buffers: list = []
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=5, buffer_callback=buffers.append)
    table = dict(copyreg.dispatch_table)
    table[np.ndarray] = _reduce_ndarray
    for t in _jax_array_types():
        table[t] = _reduce_jax
    for t in _jitted_types():
        table[t] = _reduce_by_name
    table.update(_RPC_REDUCERS)
    if reducers:
        table.update(reducers)
    p.dispatch_table = table
    p.dump(obj)
    return f.getvalue(), [b.raw() for b in buffers]


def loads(payload: Any, buffers: Sequence[Any] = (),
          hook: Callable[[Any], Any] | None = None) -> Any:
    """Inverse of :func:`dumps`; arrays are rebuilt on top of ``buffers`` (no copy).

    ``hook(pid)`` rebuilds the objects that a reducer replaced with
    ``(load_hook, (pid,))`` (RRefs), in this thread only.
    """
    prev = getattr(_LOAD, "hook", None)
    _LOAD.hook = hook
    try:
        return pickle.loads(payload, buffers=buffers)
    finally:
        _LOAD.hook = prev


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
        dumps(func)
    except Exception as e:
        raise TypeError(
            f"cannot send {describe_callable(func)} to {dest}: it cannot be pickled ({e}). "
            "Use a module-level function or a picklable callable object.") from e
