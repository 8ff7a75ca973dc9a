"""The distributed-autograd hooks of an RPC agent (installed where agents are built).

The RPC core knows nothing of autograd: ``jdist.rpc._api.start_agent`` calls
:func:`install`, which points the agent's five hooks here. Outgoing calls carry the
thread's context id; incoming ones run inside their context; a call made inside a
differentiable trace goes to the engine (imported on first such call: the engine
loads jax, and ``import jdist.rpc`` must not).
"""

from __future__ import annotations

from typing import Any

from jdist.rpc.autograd._context import (
    DistAutogradContext,
    current,
    current_context_id,
    enter_context,
    release_from_peer,
    spoil_capture,
    tracing,
)

__all__ = ["install", "call_hook", "remote_hook"]


def _differentiable_context(agent: Any, func: Any) -> DistAutogradContext | None:
    """The context a call of ``func`` through ``agent`` is differentiable in, or None:
    it must be made inside a differentiable trace of this worker's live current context,
    and not be one of dist_autograd's own internal calls."""
    ctx = current()
    if tracing() is None or ctx is None or ctx.agent is not agent or ctx.released:
        return None
    if getattr(func, "_jdist_autograd_internal", False):
        return None
    return ctx


def _plain_call_seen(func: Any) -> None:
    """A plain (not differentiable) RPC of ``func``: a loss function being captured for
    compiling (``_compiled_root``) stays eager, where such a call runs on every pass
    (dist_autograd's own messages excepted)."""
    if not getattr(func, "_jdist_autograd_internal", False):
        spoil_capture(f"a plain RPC of {getattr(func, '__qualname__', func)!r}")


def call_hook(agent: Any, to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> Any:
    """``agent.rpc_async`` asks this first: a Future when the call is differentiable.

    A call is differentiable when it is made inside a differentiable trace of this
    worker's current context (``dist_autograd.backward``'s loss function, or a function
    this worker runs for a differentiable RPC). Otherwise ``None``: a plain call.
    """
    ctx = _differentiable_context(agent, func)
    if ctx is None:
        _plain_call_seen(func)
        return None
    from jdist.rpc._rref import rref_fetch

    if func is rref_fetch:  # to_here(): differentiable only for a remote() made in a trace
        link = getattr(args[0], "_ad_link", None) if args else None
        if link is None:
            _plain_call_seen(func)
            return None
        from jdist.rpc.autograd._engine import differentiable_fetch

        return differentiable_fetch(ctx, args[0], link, timeout)
    from jdist.rpc.autograd._engine import differentiable_call

    return differentiable_call(ctx, to, func, args, kwargs, timeout)


def remote_hook(agent: Any, to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> Any:
    """``agent.remote`` asks this first: an RRef when the call is differentiable."""
    ctx = _differentiable_context(agent, func)
    if ctx is None:
        _plain_call_seen(func)
        return None
    from jdist.rpc.autograd._engine import differentiable_remote

    return differentiable_remote(ctx, to, func, args, kwargs, timeout)


def install(agent: Any) -> None:
    """Point ``agent``'s hooks at this module (``start_agent`` calls it)."""
    agent.context_id_hook = lambda to: current_context_id(agent, to)
    agent.enter_context_hook = lambda cid: enter_context(agent, cid)
    agent.release_contexts_hook = lambda cids: release_from_peer(agent, cids)
    agent.call_hook = lambda to, func, args, kwargs, timeout: call_hook(
        agent, to, func, args, kwargs, timeout)
    agent.remote_hook = lambda to, func, args, kwargs, timeout: remote_hook(
        agent, to, func, args, kwargs, timeout)
