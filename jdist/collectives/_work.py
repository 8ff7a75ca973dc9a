"""``Work``: the handle of an ``async_op=True`` collective, and the queues that run them.

Async collectives of a group run on one FIFO worker thread per group, so they execute
in issue order on every rank (as torch's process-group queue guarantees); a blocking
collective issued while async ones are pending joins the same queue. Point-to-point
operations run on one FIFO thread per (direction, peer) channel, so ``isend`` to one
peer and ``irecv`` from another proceed concurrently (a ring of ``isend``/``irecv``
does not deadlock) while messages on one channel stay ordered.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any

from jdist.collectives import _fingerprint as fpr
from jdist.errors import CollectiveTimeoutError

__all__ = ["Work", "Queues", "Future"]


class Future(cf.Future):
    """``torch.futures.Future``'s interface on a ``concurrent.futures.Future``.

    ``wait()`` returns the value or re-raises the error; ``value()`` reads a finished
    future; ``then(callback)`` returns a new Future holding ``callback(self)`` once this
    one finishes (an error raised by the callback is the new future's error). The
    ``concurrent.futures`` methods (``result``, ``add_done_callback``, ...) stay.
    """

    @classmethod
    def following(cls, source: cf.Future) -> Future:
        """A Future that finishes as ``source`` does, with its value or error."""
        out = cls()

        def copy(src: cf.Future) -> None:
            err = src.exception()
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(src.result())

        source.add_done_callback(copy)
        return out

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished (at most ``timeout`` seconds); the value, or raise."""
        return self.result(timeout)

    def value(self) -> Any:
        """The value of a finished future (raises its error, or RuntimeError if pending)."""
        if not self.done():
            raise RuntimeError("Future.value() on a future that has not finished; "
                               "call wait() instead")
        return self.result()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A new Future holding ``callback(self)`` once this future finishes."""
        nxt = Future()

        def run(_: cf.Future) -> None:
            try:
                nxt.set_result(callback(self))
            except BaseException as err:  # the chained future carries it, as torch's
                nxt.set_exception(err)

        self.add_done_callback(run)
        return nxt


class Work:
    """A pending (or finished) collective, as torch's ``Work``.

    ``wait(timeout=None)`` blocks until it finishes and returns its result (the array
    or list the blocking call would return); it re-raises the collective's error.
    """

    def __init__(self, future: cf.Future, what: str) -> None:
        self._future = future
        self._what = what

    @classmethod
    def done(cls, value: Any, what: str) -> Work:
        """A Work that has already finished with ``value``."""
        fut: cf.Future = cf.Future()
        fut.set_result(value)
        return cls(fut, what)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (at most ``timeout`` seconds; None = no limit); return the result.

        Raises:
          CollectiveTimeoutError: not finished within ``timeout``.
        """
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            if self._future.done():
                raise  # the operation's own error (a timeout it diagnosed), unchanged
            raise CollectiveTimeoutError(
                f"{self._what} did not complete within {timeout} s; check that every "
                f"member rank issued it (Work.wait(timeout=None) waits without limit)"
            ) from None

    def result(self) -> Any:
        """The result (waits, like ``wait()``)."""
        return self.wait()

    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether it finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """Its error once finished, else None (does not wait)."""
        return self._future.exception() if self._future.done() else None

    def get_future(self) -> Future:
        """A :class:`Future` (torch's ``wait``/``value``/``then``, and the
        ``concurrent.futures`` methods) that finishes with this operation's result."""
        if not isinstance(self._future, Future):
            self._future = Future.following(self._future)
        return self._future

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"Work({self._what}, {state})"


class Queues:
    """FIFO worker threads keyed by name (one per group, one per p2p channel)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[Any, cf.ThreadPoolExecutor] = {}
        self._last: dict[Any, cf.Future] = {}

    def submit(self, key: Any, fn: Callable[[], Any]) -> cf.Future:
        """Queue ``fn`` on ``key``'s thread; return its future. ``fn`` runs under the
        mismatch-check mode in force now (:func:`_fingerprint.issued`)."""
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"jdist-{key}")
                self._pools[key] = pool
            fut = pool.submit(fpr.issued(fn))
            self._last[key] = fut
        return fut

    def pending(self, key: Any) -> bool:
        """Whether ``key``'s queue still has unfinished work."""
        fut = self._last.get(key)
        return fut is not None and not fut.done()

    def call(self, key: Any, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` now, or behind ``key``'s pending work when there is some."""
        if self.pending(key):
            return self.submit(key, fn).result()
        return fn()

    def shutdown(self) -> None:
        """Stop every thread (pending work is abandoned, not waited for)."""
        with self._lock:
            pools, self._pools, self._last = self._pools, {}, {}
        for pool in pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
