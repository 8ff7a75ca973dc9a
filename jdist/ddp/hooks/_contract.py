"""What DDP checks about a comm hook: at registration, and about each result it returns.

At registration (:func:`check_hook`), with torch's exception classes and texts:

- the hook is callable (``TypeError: Communication hook must be callable.``);
- it takes ``(state, bucket)`` positionally (``TypeError`` naming its signature);
- an annotated bucket parameter is a :class:`GradBucket` (``ValueError: Communication
  hook: bucket annotation should be dist.GradBucket.``);
- an annotated return is a ``tuple`` (jdist's ``(buffer, new_state)``) or a Future
  (a class with ``wait``, e.g. ``jdist.rpc.Future`` or ``torch.futures.Future``)
  (``ValueError: Communication hook: return annotation should be ...``).

Per bucket (:func:`hook_output`), inside the traced step:

- the hook returns ``(buffer, new_state)``, or, as a torch hook does, a Future whose
  ``wait()`` gives the buffer or a one-element list of it (the state is then kept,
  as a torch hook's state is an object it may mutate); anything else raises torch's
  ``RuntimeError: ... callback must return a torch.futures.Future object, but got ...``;
- the buffer must be the same on every replica. A result typed *invariant* over the
  replica axis (``psum``, ``pmean``, ``jdist.collectives.functional``) is used as is.
  A result typed *varying* may still hold equal values (``jnp.ones_like(buffer)``,
  ``jax.lax.all_gather`` then a sum, a ring of ``ppermute``): :func:`replicated` takes
  replica 0's value (one extra all-reduce of the bucket, only for such hooks) and
  compares it with every replica's; if any differs a host callback raises
  :class:`~jdist.errors.ReplicaDivergenceError` in the runtime, which the engine turns
  back into that error (:func:`raise_hook_failure`) on every process, instead of letting
  the replicas drift apart as torch's DDP does silently.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

import jax
import jax.numpy as jnp

from jdist.ddp.hooks._base import GradBucket
from jdist.errors import ReplicaDivergenceError

__all__ = ["NOT_CALLABLE_MSG", "check_hook", "hook_output", "replicated", "is_varying",
           "raise_hook_failure"]

NOT_CALLABLE_MSG = "Communication hook must be callable."
BUCKET_ANNOTATION_MSG = "Communication hook: bucket annotation should be dist.GradBucket."
RETURN_ANNOTATION_MSG = (
    "Communication hook: return annotation should be torch.futures.Future (any Future "
    "class with wait(), e.g. jdist.rpc.Future) or tuple (jdist's (buffer, new_state)), "
    "got {got!r}")
BAD_RESULT_MSG = (
    "Communication hook {name!r}: callback must return a torch.futures.Future object, but "
    "got {got}. A jdist hook returns (reduced_buffer, new_state); a Future whose wait() "
    "gives the reduced buffer is accepted too (the state is then kept).")
DIVERGED_MSG = (
    "comm hook {name!r} returned a buffer for bucket {index} that differs across replicas "
    "({bad} of {n} elements differ from replica 0's). DDP keeps one replicated copy of the "
    "parameters, so every replica must get the same reduced gradients (torch's DDP would "
    "let the replicas drift apart silently). Reduce over bucket.axis_name, e.g. "
    "jax.lax.pmean(bucket.buffer, bucket.axis_name) or "
    "jdist.collectives.functional.all_reduce(bucket.buffer, ReduceOp.AVG, bucket.axis_name).")


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)


def _signature(hook: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError):  # an annotation that does not resolve
        try:
            return inspect.signature(hook)
        except (TypeError, ValueError):
            return None
    except ValueError:  # builtins without a signature
        return None


def _takes_two(sig: inspect.Signature) -> bool:
    try:
        sig.bind(None, None)
    except TypeError:
        return False
    return True


def _is_future_type(ann: Any) -> bool:
    origin = typing.get_origin(ann) or ann
    return isinstance(origin, type) and callable(getattr(origin, "wait", None))


def _is_tuple_type(ann: Any) -> bool:
    origin = typing.get_origin(ann) or ann
    return isinstance(origin, type) and issubclass(origin, tuple)


def check_hook(hook: Any) -> None:
    """Raise as torch's ``register_comm_hook`` does for a hook DDP cannot call."""
    if not callable(hook):
        raise TypeError(NOT_CALLABLE_MSG)
    sig = _signature(hook)
    if sig is None:
        return
    if not _takes_two(sig):
        raise TypeError(
            f"Communication hook {_hook_name(hook)!r} must take (state, bucket) "
            f"positionally, but its signature is {sig}; define it as "
            f"def hook(state, bucket) -> (reduced_buffer, new_state)")
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) >= 2:
        ann = params[1].annotation
        if ann is not inspect.Parameter.empty and not isinstance(ann, str) and not (
                isinstance(ann, type) and issubclass(ann, GradBucket)) and ann is not Any:
            raise ValueError(f"{BUCKET_ANNOTATION_MSG} Got {ann!r}; annotate it as "
                             "jdist.ddp.hooks.GradBucket or leave it unannotated.")
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and not isinstance(ret, str) and ret is not Any \
            and not _is_tuple_type(ret) and not _is_future_type(ret):
        raise ValueError(RETURN_ANNOTATION_MSG.format(got=ret))


def hook_output(result: Any, state: Any, hook: Any) -> tuple[Any, Any]:
    """``(buffer, new_state)`` from what ``hook`` returned (a pair, or a Future)."""
    if isinstance(result, tuple) and len(result) == 2:
        return result
    wait = getattr(result, "wait", None)
    if callable(wait) and not isinstance(result, jax.Array):
        value = wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:  # torch: [tensor] too
            value = value[0]
        return value, state
    got = type(result).__name__
    if isinstance(result, tuple):
        got = f"a tuple of {len(result)}"
    raise RuntimeError(BAD_RESULT_MSG.format(name=_hook_name(hook), got=got))


def is_varying(x: Any, axis: Any) -> bool:
    """Whether ``x`` is typed as differing across ``axis`` inside ``shard_map``."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return axis in mat.varying
    return axis in getattr(aval, "vma", frozenset())


_OK = jax.ShapeDtypeStruct((), jnp.int32)


def _raise_diverged(bad, *, n: int, name: str, index: int):
    raise ReplicaDivergenceError(DIVERGED_MSG.format(name=name, index=index, bad=int(bad),
                                                     n=int(n)))


def replicated(out: jax.Array, bucket: GradBucket, hook: Any) -> jax.Array:
    """``out`` typed invariant over the replica axis; checked equal on every replica.

    Inside ``shard_map``: a result already typed invariant is returned unchanged.
    Otherwise replica 0's value is sent to all (a masked ``psum``, exact), every replica
    compares its own with it, and a step where one differs raises
    :class:`~jdist.errors.ReplicaDivergenceError` from a host callback run only then.
    """
    axis = bucket.axis_name
    if not hasattr(out, "dtype") or not is_varying(out, axis):
        return out
    first = jax.lax.axis_index(axis) == 0
    as_num = out.astype(jnp.int32) if out.dtype == jnp.bool_ else out
    settled = jax.lax.psum(jnp.where(first, as_num, jnp.zeros_like(as_num)), axis)
    settled = settled.astype(out.dtype)
    same = out == settled
    if jnp.issubdtype(out.dtype, jnp.inexact):
        same = same | (jnp.isnan(out) & jnp.isnan(settled))
    bad = jax.lax.psum(jnp.sum(~same, dtype=jnp.int32), axis)
    cb = functools.partial(_raise_diverged, name=_hook_name(hook), index=bucket.index,
                           n=out.size)
    # a pure callback (no effect token left failed behind it), run only when ``bad``:
    # its result gates the buffer so that XLA keeps it
    ok = jax.lax.cond(bad > 0, lambda: jax.pure_callback(cb, _OK, bad),
                      lambda: jnp.zeros((), jnp.int32))
    return jnp.where(ok == 0, settled, jnp.zeros_like(settled))


_MARKER = "ReplicaDivergenceError: "


def _diverged_message(exc: BaseException) -> str | None:
    """The :data:`DIVERGED_MSG` text a runtime error (or its causes) carries, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for line in reversed(str(exc).splitlines()):
            i = line.find(_MARKER)
            if i >= 0 and line[i + len(_MARKER):].startswith("comm hook "):
                return line[i + len(_MARKER):]
        exc = exc.__cause__ or exc.__context__
    return None


def raise_hook_failure(exc: BaseException) -> None:
    """Raise :class:`~jdist.errors.ReplicaDivergenceError` from ``exc`` when the step
    failed because :func:`replicated` found a hook result differing across replicas
    (the runtime reports the callback's error as a ``JaxRuntimeError``); else return.

    JAX keeps the failed callback's runtime token, which would make every later
    ``jax.effects_barrier()`` (and ``jax.clear_backends()``) raise the error again; it
    is dropped here, once the error is reported.
    """
    if isinstance(exc, ReplicaDivergenceError):
        return
    msg = _diverged_message(exc)
    if msg is None:
        return
    from jax._src import dispatch  # no public way to drop a failed token

    dispatch.runtime_tokens.clear()
    raise ReplicaDivergenceError(msg) from exc
