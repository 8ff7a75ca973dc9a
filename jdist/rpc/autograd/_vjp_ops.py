"""The ``custom_vjp`` building blocks of distributed autograd's differentiable calls.

:mod:`jdist.rpc.autograd._engine` builds every differentiable RPC (``rpc_async``,
``remote()``, ``to_here()``) from these:

- :func:`bind`: a call started with the traced arrays it sends; its backward rule
  sends the cotangents to the callee and hands the ones that come back to those arrays;
- :func:`from_token`: a value received after a call started; its backward rule keeps
  the value's cotangents for the call's rule;
- :class:`ReceiveFuture`: binds a call's receive where its future is first waited on;
- :func:`custom_vjp_of`: the per-call ``custom_vjp`` s, made cheaply (also used by
  ``_ddp_stage``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.rpc._futures import Future
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._slots import to_array

__all__ = ["ReceiveFuture", "bind", "custom_vjp_of", "from_token", "input_cts", "no_answer"]


def from_token(tracer: Any, produce: Callable[[], tuple], sink: Callable[[list], Any]) -> tuple:
    """``produce()``'s arrays as a ``custom_vjp`` of the scalar ``tracer`` (the output
    of the op that started the call or made the RRef): its backward rule hands the
    arrays' cotangents to ``sink`` and gives ``tracer`` a non-zero cotangent, so that
    the rule of that op runs later and sends them on."""
    def fwd(t):
        del t
        return produce(), None

    def bwd(_, cts):
        sink([np.asarray(c) for c in cts])
        return (np.ones((), tracer.dtype),)

    def op(t):
        del t
        return produce()

    return custom_vjp_of(op, fwd, bwd)(tracer)


_DEBUG_INFO: list = []  # [{"fun"|"fwd"|"bwd": DebugInfo} or None] once made


def custom_vjp_of(fun: Callable, fwd: Callable, bwd: Callable) -> Any:
    """``jax.custom_vjp(fun)`` with ``fwd`` / ``bwd``, for closures made per call (the
    engine's calls and ``_ddp_stage``).

    ``custom_vjp`` describes its functions for error messages on every call, with an
    ``inspect.signature`` of each (a tenth of a millisecond or more per call); a
    function carrying a ready description skips that, so these get a shared one
    (argument names unknown). With a JAX that has no such hook they go as they are.
    """
    if not _DEBUG_INFO:
        try:
            from jax._src import core

            _DEBUG_INFO.append({w: core.DebugInfo(f"custom_vjp {w}", "jdist_dist_autograd",
                                                  None, core.initial_result_paths)
                                for w in ("fun", "fwd", "bwd")})
        except Exception:  # noqa: BLE001 - another JAX layout
            _DEBUG_INFO.append(None)
    infos = _DEBUG_INFO[0]
    if infos is not None:
        fun.__fun_debug_info__ = infos["fun"]
        fwd.__fun_debug_info__ = infos["fwd"]
        bwd.__fun_debug_info__ = infos["bwd"]
    op = jax.custom_vjp(fun)
    op.defvjp(fwd, bwd)
    return op


class ReceiveFuture(Future):
    """The future of a differentiable call: waiting on it (or ``value()``, ``then``,
    ``add_done_callback``) binds the call's receive in the waiting trace, once."""

    def __init__(self, receive: Callable[[], Any], desc: str):
        super().__init__(_desc=desc)
        self._receive: Callable[[], Any] | None = receive

    def _bind_receive(self) -> None:
        receive, self._receive = self._receive, None
        if receive is None:
            return
        try:
            out = receive()
        except BaseException as e:  # noqa: BLE001 - the future's error
            self.set_exception(e)
        else:
            self.set_result(out)

    def done(self) -> bool:
        self._bind_receive()
        return super().done()

    def wait(self, timeout: float | None = None) -> Any:
        self._bind_receive()
        return super().wait(timeout)

    def value(self) -> Any:
        self._bind_receive()
        return super().value()

    def exception(self) -> BaseException | None:
        self._bind_receive()
        return super().exception()

    def add_done_callback(self, callback: Callable[[Future], Any]) -> None:
        self._bind_receive()
        super().add_done_callback(callback)


def no_answer(xs: list, links: list) -> Future:
    """The backward answer of a call whose value never reached the loss (no message
    sent): zero cotangents for ``xs``, none for the RRefs sent along."""
    fut: Future = Future(_desc="a backward pass that sent nothing")
    fut.set_result(([np.zeros(x.shape, x.dtype) for x in xs], [None] * len(links)))
    return fut


def bind(token: Any, xs: list, forward: Callable, backward: Callable,
         links: list = ()) -> Any:
    """``forward(xs)`` as a ``custom_vjp`` of the trace ``token`` and ``xs``, whose
    backward rule sends the output cotangents through ``backward(cts)``, which returns
    a future of ``(ct_xs, rref_cts)``: the cotangents of ``xs`` and those that come back
    for the differentiable RRefs sent along (``links``: ``(position, tracer, link)``).
    Those go to each RRef's link, and the RRef's tracer (an input here) gets a non-zero
    cotangent so that the backward rule of the call that made it runs later and sends
    them on to the RRef's owner.

    When no ``x`` needs a cotangent (no floating ``xs``) the rule does not wait for the
    callee: the backward message stays in flight (the enclosing ``pending_scope`` waits
    for it) while the backward pass goes on, so the backward of one micro-batch on one
    worker runs beside another's on the next worker.
    """
    tracers = [t for _, t, _ in links]
    needs_cts = any(jnp.issubdtype(x.dtype, jnp.inexact) for x in xs)

    def fwd(tok, xs_, ts_):
        del tok, ts_
        return forward(xs_), None

    def bwd(_, cts):
        fut = backward(cts)
        if not needs_cts:
            C.add_pending(fut)
            for k, (_, _, link) in enumerate(links):
                link.add_pending(fut, k)
            return (np.zeros((), token.dtype), input_cts(xs, [None] * len(xs)),
                    tuple(np.ones((), t.dtype) for t in tracers))
        ct_xs, rref_cts = fut.wait()
        ct_ts = []
        for (_, t, link), c in zip(links, rref_cts, strict=True):
            if c is not None:
                link.add(c)
            ct_ts.append(np.ones((), t.dtype) if c is not None else np.zeros((), t.dtype))
        return (np.zeros((), token.dtype), input_cts(xs, ct_xs), tuple(ct_ts))

    def call(tok, xs_, ts_):
        del tok, ts_
        return forward(xs_)

    return custom_vjp_of(call, fwd, bwd)(token, tuple(xs), tuple(tracers))


def input_cts(xs: list, ct_xs: list) -> tuple:
    out = []
    for x, c in zip(xs, ct_xs, strict=True):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            out.append(to_array(c, x.dtype))
        else:
            out.append(np.zeros(x.shape, jax.dtypes.float0))
    return tuple(out)
