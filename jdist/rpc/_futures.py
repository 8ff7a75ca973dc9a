"""A thread-safe Future with torch.futures' API, plus ``wait_all`` and ``collect_all``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, Generic, Protocol, TypeVar

from jdist.errors import RpcError, RpcTimeoutError

__all__ = ["Future", "wait_all", "collect_all"]

T = TypeVar("T")
log = logging.getLogger("jdist.rpc")

_busy = [0]  # RPC calls of this process queued on or running in pool threads
_busy_lock = threading.Lock()
_in_call = threading.local()  # .depth: RPC functions this thread is running


def add_busy(k: int) -> None:
    """Count ``k`` calls more (queued or running); a waiting thread does not poll then."""
    with _busy_lock:
        _busy[0] += k


def others_running() -> bool:
    """Whether calls other than the one this thread runs are queued or running here
    (their threads need the GIL: a thread polling meanwhile would delay them)."""
    return _busy[0] > getattr(_in_call, "depth", 0)


class Waiter(Protocol):
    """A future's way of waiting (given with :meth:`Future.set_waiter`)."""

    def before_wait(self, fut: Future, timeout: float | None) -> None:
        """Called by ``fut.wait()`` before it blocks (not when ``fut`` is done)."""

    def arrived(self, now: float) -> None:
        """``fut`` completed at ``now`` (``time.perf_counter()``)."""


class Future(Generic[T]):
    """The eventual result of an RPC (or of anything you complete yourself).

    ``wait()`` blocks and returns the value or raises the error; ``then(cb)`` chains a
    callback that receives this (completed) future and returns a new future of its
    result; ``add_done_callback(cb)`` runs ``cb(self)`` once done. Callbacks of futures
    made by the RPC agent run on the agent's thread pool, never on its I/O loop.
    """

    def __init__(self, *, _executor: Executor | None = None, _desc: str = "a Future"):
        self._cond = threading.Condition(threading.Lock())
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Future], Any]] = []
        self._executor = _executor
        self._desc = _desc
        self._waiter: Waiter | None = None  # see set_waiter

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._exc else "done")
        return f"Future({self._desc}, {state})"

    def __reduce__(self):
        raise RpcError("Can not pickle torch.futures.Future: a jdist.rpc.Future cannot be "
                       "sent in an RPC (as an argument or a result); send its value (wait() "
                       "first), or mark a function that returns one @async_execution")

    def done(self) -> bool:
        """Whether a result or an error is set."""
        return self._done

    def set_waiter(self, waiter: Waiter | None) -> None:
        """How a ``wait()`` on this future waits first (the agent's reply wait: it may
        read the reply's connection in the waiting thread), and whom its completion is
        told (:class:`Waiter`)."""
        self._waiter = waiter

    @property
    def waiter(self) -> Waiter | None:
        return self._waiter

    def wait(self, timeout: float | None = None) -> T:
        """Block until done; return the value or raise the error.

        Args:
          timeout: seconds to wait; ``None`` waits as long as it takes (an RPC future
            fails by itself when the RPC's own timeout expires).

        Raises:
          RpcTimeoutError: not done within ``timeout`` seconds.
        """
        waiter = self._waiter
        if not self._done and waiter is not None:
            waiter.before_wait(self, timeout)  # may read the reply in this thread
        with self._cond:
            if not self._done and not self._cond.wait_for(lambda: self._done, timeout):
                raise RpcTimeoutError(f"Future.wait timed out after {timeout} s waiting for "
                                      f"{self._desc}")
        if self._exc is not None:
            raise self._exc
        return self._value

    def value(self) -> T:
        """The value of a completed future (raises its error).

        Raises:
          RuntimeError: the future is not done yet; call ``wait()`` first.
        """
        if not self._done:
            raise RuntimeError(f"Future.value() called on {self!r} before it completed; "
                               "call wait() or use then()")
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self) -> BaseException | None:
        """The error of a completed future, or None."""
        return self._exc

    def _complete(self, value: Any, exc: BaseException | None) -> None:
        with self._cond:
            if self._done:
                raise RuntimeError(f"Future can only be marked completed once: {self!r} is "
                                   "already done")
            self._value, self._exc, self._done = value, exc, True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        waiter = self._waiter
        if waiter is not None:  # the agent's bookkeeping: never fails the completion
            try:
                waiter.arrived(time.perf_counter())
            except Exception:
                log.exception("jdist.rpc: timing a reply's arrival failed")
        for cb in callbacks:
            self._run(cb)

    def set_result(self, result: T) -> None:
        """Complete with ``result``; raises RuntimeError if already completed."""
        self._complete(result, None)

    def set_exception(self, exc: BaseException) -> None:
        """Complete with error ``exc``; raises RuntimeError if already completed."""
        if not isinstance(exc, BaseException):
            raise TypeError(f"set_exception needs an exception, got {exc!r}")
        self._complete(None, exc)

    def _run(self, cb: Callable[[Future], Any]) -> None:
        if self._executor is not None:
            try:
                self._executor.submit(_safe_call, cb, self)
                return
            except RuntimeError:  # executor shut down: run inline
                pass
        _safe_call(cb, self)

    def add_done_callback(self, callback: Callable[[Future[T]], Any]) -> None:
        """Run ``callback(self)`` once done (at once if already done)."""
        if not callable(callback):
            raise TypeError(f"add_done_callback(): incompatible function arguments: the "
                            f"callback must be callable, got {callback!r}")
        with self._cond:
            if not self._done:
                self._callbacks.append(callback)
                return
        self._run(callback)

    def then(self, callback: Callable[[Future[T]], Any]) -> Future:
        """A new future of ``callback(self)``, run once this one is done.

        The callback should call ``wait()`` or ``value()`` on its argument; an error it
        raises (including this future's own error re-raised) fails the new future.
        """
        if not callable(callback):
            raise TypeError(f"then(): incompatible function arguments: the callback must be "
                            f"callable (it gets the completed future), got {callback!r}")
        nxt: Future = Future(_executor=self._executor, _desc=f"then() of {self._desc}")

        def chain(f: Future) -> None:
            try:
                nxt.set_result(callback(f))
            except BaseException as e:  # noqa: BLE001 - forwarded to the waiter
                nxt.set_exception(e if f._exc is e else as_runtime_error(e))

        self.add_done_callback(chain)
        return nxt


_RUNTIME_VARIANTS: dict[type, type] = {}


def as_runtime_error(exc: BaseException) -> BaseException:
    """``exc`` as an instance of its own type *and* ``RuntimeError`` (torch reports an
    error raised in a ``then`` callback as ``RuntimeError``; ``except TypeError`` still
    works). Returned as is when already a RuntimeError or when no such type can exist."""
    if isinstance(exc, RuntimeError) or not isinstance(exc, Exception):
        return exc
    cls = type(exc)
    try:
        variant = _RUNTIME_VARIANTS.get(cls)
        if variant is None:
            variant = _RUNTIME_VARIANTS[cls] = type(cls.__name__, (cls, RuntimeError),
                                                    {"__module__": cls.__module__})
        new = variant.__new__(variant, *exc.args)
        new.args = exc.args
        new.__dict__.update(getattr(exc, "__dict__", {}))
    except TypeError:  # a layout that cannot be combined with RuntimeError
        return exc
    new.__cause__ = exc
    new.__traceback__ = exc.__traceback__
    return new


def _safe_call(cb: Callable[[Future], Any], fut: Future) -> None:
    try:
        cb(fut)
    except Exception:
        log.exception("jdist.rpc: a Future callback raised")


def wait_all(futures: Iterable[Future], timeout: float | None = None) -> list:
    """Wait for every future in order; return their values or raise the first error.

    Raises:
      RpcTimeoutError: ``timeout`` (seconds, for all together) expired.
    """
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for f in futures:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        out.append(f.wait(left))
    return out


def copy_into(src: Future, dst: Future) -> None:
    """Complete ``dst`` as the completed ``src`` is (its value or its error)."""
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.value())


def collect_all(futures: Iterable[Future]) -> Future[list[Future]]:
    """A future completed with the list of ``futures`` once all of them are done."""
    futures = list(futures)
    out: Future[list[Future]] = Future(_desc=f"collect_all of {len(futures)} futures")
    if not futures:
        out.set_result([])
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            out.set_result(futures)

    for f in futures:
        f.add_done_callback(one_done)
    return out
