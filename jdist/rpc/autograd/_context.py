"""Distributed autograd contexts: ids, per-worker tables, the thread's current context.

No jax here, and nothing above it: ``_hooks`` (installed on each agent by
``start_agent``) asks it which context id to put on an outgoing call
(:func:`current_context_id`) and enters a context around an incoming one
(:func:`enter_context`). Everything is per agent, so several agents in one process
(the in-process tests) keep separate tables, as separate processes would.

A context id is ``(worker id << 48) | counter``: globally unique, as torch's. A context
holds, on each worker it reached:

- ``grads``: gradients accumulated for this worker's own parameters (``nnx.Variable``
  objects, keyed by ``id()``, the Variable kept alive beside its gradient);
- ``vjps``: the VJP closures of the functions this worker ran for a differentiable
  RPC, keyed by the message id the caller holds (torch's ``send``/``recv`` pair).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jdist.errors import DistAutogradError

__all__ = [
    "NO_CONTEXT",
    "DistAutogradContext",
    "registry",
    "current",
    "current_context_id",
    "enter_context",
    "no_context",
    "not_found",
    "call_traced",
    "capture",
    "set_capture",
    "spoil_capture",
]

NO_CONTEXT = -1  # the same value as jdist.rpc._protocol.NO_CONTEXT
_ID_BITS = 48


def _internal(fn: Any) -> Any:
    """Mark a function sent by distributed autograd itself (never made differentiable)."""
    fn._jdist_autograd_internal = True
    return fn


def not_found(context_id: int) -> DistAutogradError:
    """torch's error for an unknown (never made, or released) context id."""
    return DistAutogradError(f"Could not find autograd context with id: {context_id}")


class DistAutogradContext:
    """One worker's share of one distributed autograd pass (thread-safe)."""

    def __init__(self, context_id: int, agent: Any):
        self.context_id = context_id
        self.agent = agent
        self.lock = threading.Lock()
        self.grads: dict[int, list] = {}  # id(variable) -> [variable, gradient]
        self.vjps: dict[tuple[int, int], Any] = {}  # message id -> recorded VJP
        self._msg_ids = itertools.count()
        self.released = False
        # (worker id, frame) -> the last message id sent there from that frame
        self._last_sent: dict[tuple, tuple[int, int]] = {}
        self._recorded: dict[tuple, threading.Event] = {}  # (caller, message) -> recorded
        #: workers this worker sent a message of this context to (each made the context
        #: there): where its release goes, torch's known worker ids
        self.reached: set[int] = set()

    def __repr__(self) -> str:
        return (f"DistAutogradContext(id={self.context_id}, worker={self.agent.info}, "
                f"{len(self.grads)} gradients, {len(self.vjps)} recorded calls)")

    def new_message_id(self) -> tuple[int, int]:
        """A message id unique in this context across workers: (this worker, counter)."""
        return (self.agent.info.id, next(self._msg_ids))

    def chain(self, worker_id: int, msg: tuple[int, int]) -> tuple[int, int] | None:
        """Note ``msg`` as the newest differentiable call to ``worker_id`` made by the
        code running here (the loss function, or one incoming call: :func:`frame`);
        returns the one before it (the callee records them in this order).

        Calls made while serving an incoming call are not ordered after the calls that
        led to it: a call from w0 to w2 whose callee calls back into w0, which calls w2
        again, would otherwise wait at w2 for the first call, which waits for it."""
        key = (worker_id, frame())
        with self.lock:
            prev = self._last_sent.get(key)
            self._last_sent[key] = msg
        return prev

    def _event(self, msg: tuple) -> threading.Event:
        with self.lock:
            ev = self._recorded.get(msg)
            if ev is None:
                ev = self._recorded[msg] = threading.Event()
            return ev

    def wait_recorded(self, msg: Any, timeout: float | None) -> None:
        """Wait until the call ``msg`` (from the same caller, sent before this one) is
        recorded here, so that a caller's differentiable calls to one worker read and
        write its modules' state in the order they were made, as when each waited for
        the one before.

        Raises:
          DistAutogradError: not recorded within ``timeout`` seconds, or the context
            was released meanwhile.
        """
        if msg is None:
            return
        if not self._event(tuple(msg)).wait(timeout):
            raise DistAutogradError(
                f"{self.agent.info} waited {timeout} s in autograd context "
                f"{self.context_id} for the differentiable call {tuple(msg)} sent before "
                "this one by the same worker, which never ran here (its message was lost, "
                "or every thread of the RPC pool is busy: raise num_worker_threads)")
        if self.released:
            raise not_found(self.context_id)

    def mark_recorded(self, msg: tuple) -> None:
        """The call ``msg`` has been recorded (or failed): the next one may run."""
        self._event(tuple(msg)).set()

    def keep_vjp(self, msg: tuple[int, int], entry: tuple) -> None:
        """Keep a recorded call's ``(vjp, trackers, links)`` under its message id.

        Raises:
          DistAutogradError: the context was released meanwhile.
        """
        with self.lock:
            if self.released:
                raise not_found(self.context_id)
            self.vjps[msg] = entry

    def accumulate(self, variable: Any, grad: Any) -> None:
        """Add ``grad`` to the gradient of ``variable`` (an ``nnx.Variable``)."""
        with self.lock:
            entry = self.grads.get(id(variable))
            if entry is None:
                self.grads[id(variable)] = [variable, grad]
            else:
                entry[1] = entry[1] + grad

    def gradient_of(self, variable: Any) -> Any:
        """The accumulated gradient of ``variable`` or ``None``."""
        with self.lock:
            entry = self.grads.get(id(variable))
            return None if entry is None else entry[1]


class _Registry:
    """The contexts known to one agent."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.lock = threading.Lock()
        self.contexts: dict[int, DistAutogradContext] = {}
        self._counter = itertools.count()

    def new(self) -> DistAutogradContext:
        cid = (self.agent.info.id << _ID_BITS) | next(self._counter)
        ctx = DistAutogradContext(cid, self.agent)
        with self.lock:
            self.contexts[cid] = ctx
        return ctx

    def get_or_create(self, cid: int) -> DistAutogradContext:
        with self.lock:
            ctx = self.contexts.get(cid)
            if ctx is None:
                ctx = self.contexts[cid] = DistAutogradContext(cid, self.agent)
            return ctx

    def get(self, cid: int) -> DistAutogradContext:
        """The context ``cid``.

        Raises:
          DistAutogradError: no such context on this worker (torch's message).
        """
        with self.lock:
            ctx = self.contexts.get(cid)
        if ctx is None:
            raise not_found(cid)
        return ctx

    def release(self, cid: int) -> bool:
        """Forget ``cid`` here (its gradients and recorded VJPs); whether it existed."""
        with self.lock:
            ctx = self.contexts.pop(cid, None)
        if ctx is None:
            return False
        with ctx.lock:
            ctx.released = True
            ctx.grads.clear()
            ctx.vjps.clear()
        return True


_registries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_registries_lock = threading.Lock()
_tls = threading.local()


def registry(agent: Any) -> _Registry:
    """The context table of ``agent`` (made on first use)."""
    reg = _registries.get(agent)
    if reg is None:
        with _registries_lock:
            reg = _registries.get(agent)
            if reg is None:
                reg = _registries[agent] = _Registry(agent)
    return reg


def current() -> DistAutogradContext | None:
    """The context this thread is in (made by ``context()`` or entered for an RPC)."""
    return getattr(_tls, "ctx", None)


def _set_current(ctx: DistAutogradContext | None) -> None:
    _tls.ctx = ctx


_frames = itertools.count(1)


def frame() -> int:
    """Which code this thread runs for the pass: 0 for the caller's own (the loss
    function), else the number of the incoming call being served (:func:`enter_context`)."""
    return getattr(_tls, "frame", 0)


def current_context_id(agent: Any, to: int) -> int:
    """The id an outgoing call of ``agent`` to worker ``to`` carries (``NO_CONTEXT``
    outside a context); ``to`` is noted as a worker the context has reached."""
    ctx = current()
    if ctx is None or ctx.agent is not agent or ctx.released:
        return NO_CONTEXT
    if to != agent.info.id:
        ctx.reached.add(to)
    return ctx.context_id


@contextmanager
def enter_context(agent: Any, cid: int) -> Iterator[DistAutogradContext]:
    """Make ``cid`` current in this thread while an incoming call runs (callee side).

    The context is created on first contact, as torch does when the first message of a
    context reaches a worker.
    """
    prev, prev_frame = current(), frame()
    ctx = registry(agent).get_or_create(cid)
    _set_current(ctx)
    _tls.frame = next(_frames)
    try:
        yield ctx
    finally:
        _set_current(prev)
        _tls.frame = prev_frame


@contextmanager
def as_current(ctx: DistAutogradContext) -> Iterator[None]:
    """Make ``ctx`` current in this thread for the body (a callback on a pool thread that
    sends a message of the pass)."""
    prev = current()
    _set_current(ctx)
    try:
        yield
    finally:
        _set_current(prev)


@contextmanager
def no_context() -> Iterator[None]:
    """Run the body outside any context (calls made in it carry no context id)."""
    prev = current()
    _set_current(None)
    try:
        yield
    finally:
        _set_current(prev)


def tracing() -> Any:
    """The differentiable trace this thread runs in (set by the engine), or ``None``."""
    return getattr(_tls, "trace", None)


def set_tracing(trace: Any) -> Any:
    """Set this thread's trace; returns the previous one (restore it afterwards)."""
    prev = getattr(_tls, "trace", None)
    _tls.trace = trace
    return prev


def capture() -> Any:
    """What watches this thread's differentiable calls for a compiled loss function (see
    ``_compiled_root``): a recorder of an eager pass, the tracer of a compiled one, or
    ``None``."""
    return getattr(_tls, "capture", None)


def set_capture(obj: Any) -> Any:
    """Set this thread's :func:`capture`; returns the previous one (restore it)."""
    prev = getattr(_tls, "capture", None)
    _tls.capture = obj
    return prev


def spoil_capture(what: str) -> None:
    """Tell this thread's :func:`capture`, if any, that the loss function met ``what``,
    which only the eager path runs."""
    cap = capture()
    if cap is not None:
        cap.spoil(what)


def call_traced(token: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` with this thread's differentiable trace set to ``token``.

    The differentiable calls it starts without waiting for them (``rpc_async`` futures
    never waited on, ``remote()`` values never fetched) are waited for before it
    returns (:func:`pending_scope`): their callees' recordings are part of this pass.
    """
    prev = set_tracing(token)
    try:
        with pending_scope():
            return func(*args, **kwargs)
    finally:
        set_tracing(prev)


@contextmanager
def pending_scope() -> Iterator[None]:
    """Collect the futures that :func:`add_pending` is given in the body (calls and
    backward messages sent without waiting) and wait for all of them at its end: an
    error in one is an error of the body."""
    prev = getattr(_tls, "pending", None)
    pending: list = []
    _tls.pending = pending
    try:
        yield
        for fut in pending:
            fut.wait()
    finally:
        _tls.pending = prev


def add_pending(fut: Any) -> None:
    """A future for the current :func:`pending_scope` to wait for."""
    pending = getattr(_tls, "pending", None)
    if pending is not None:
        pending.append(fut)


def release_on_reached(ctx: DistAutogradContext) -> None:
    """Tell the live workers ``ctx`` reached (sent messages of it to) that it is
    released; each forgets it and passes it on the same way (asynchronously, as torch:
    with this worker's next call to them, see ``RpcAgent.release_context_on``)."""
    agent = ctx.agent
    dead = agent.dead_workers()
    for w in sorted(ctx.reached):
        if w != agent.info.id and w not in dead:
            agent.release_context_on(w, ctx.context_id)


def release_from_peer(agent: Any, cids: tuple) -> None:
    """A peer released contexts ``cids``: pass them on, then forget them here."""
    reg = registry(agent)
    for cid in cids:
        with reg.lock:
            ctx = reg.contexts.get(cid)
        if ctx is not None:
            release_on_reached(ctx)
            reg.release(cid)
