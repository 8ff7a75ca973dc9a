"""The distributed autograd engine: differentiable RPCs and the backward pass.

JAX keeps no tape on eager arrays, so a distributed pass is the user's loss function
run under ``jax.vjp`` by :func:`backward`. Inside it (and inside every function a
worker runs for a differentiable call) an RPC becomes a ``jax.custom_vjp``:

- forward rule (the caller's ``send``): runs the call; the callee runs the function
  under ``jax.vjp`` with the arrays it received and its own parameters as primal
  inputs, keeps the VJP closure in its context under the call's message id (the
  ``recv``), and answers with the value;
- backward rule: sends the cotangent of the value to the callee, which runs the stored
  VJP (whose own differentiable calls send their cotangents on, worker to worker: torch's
  FAST mode), adds the gradients of its parameters to its context and answers with the
  cotangents of the arrays it received.

A scalar "token" tracer, an extra input of every such ``custom_vjp``, ties calls whose
arguments carry no traced array (a remote lookup with integer indices) into the
trace, so their backward rules still run. Eager ``jax.vjp`` runs ``custom_vjp`` rules
with concrete arrays, which is what lets them make RPCs.

A ``RemoteModule`` forward makes no RPCs of its own: the callee records it as one
compiled forward+VJP program instead (``_compiled.py``, with shape buckets).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.errors import DistAutogradError, LossTypeError
from jdist.rpc._futures import Future
from jdist.rpc._rref import RRef, rref_method_call
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._captured import check_captured
from jdist.rpc.autograd._context import call_traced
from jdist.rpc.autograd._params import Tracked, find_params, flatten_args, rebuild_args
from jdist.rpc.autograd._slots import _fill, _is_slot, _Link, _Slot, _split_outputs, to_array
from jdist.rpc.autograd._vjp_ops import ReceiveFuture, bind, from_token, no_answer

__all__ = ["differentiable_call", "differentiable_remote", "differentiable_fetch", "backward"]


def _concrete(x: Any, what: str) -> Any:
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        raise DistAutogradError(
            f"{what}: a differentiable RPC ran inside jax.jit (or another staging "
            "transform), where its arguments have no values to send. Make the RPC outside "
            "jit and jit only the local parts of the loss function.") from None


# ---------------------------------------------------------------- caller side
def differentiable_call(ctx: C.DistAutogradContext, to: Any, func: Any, args: Any,
                        kwargs: Any, timeout: Any) -> Future:
    """An RPC made inside a differentiable trace (see the module docstring).

    Two ``custom_vjp`` s of the trace: the *send*, bound now, starts the call and does
    not wait for it (its output is a scalar token), and the *receive*, bound when the
    returned future is first waited on (or given a callback), takes the token and
    returns the value. So a loss function that starts several calls before it waits
    (torch's pipelining over micro-batches) has them all running at once. In the
    backward pass the receive's rule keeps the value's cotangents and the send's rule
    sends them to the callee. A call with no traced array and no RRef of the trace
    among its arguments starts at once with no send in the trace (the receive hangs on
    the trace's token, and its rule sends the cotangents itself).
    """
    agent = ctx.agent
    worker = agent.worker_info(to)
    token = C.tracing()
    cap = C.capture()  # a loss function marked pure (_compiled_root)
    if cap is not None and cap.compiling:
        return cap.call(agent, worker, func, args, kwargs, timeout, token)
    call = _DiffCall(ctx, worker, func, timeout, token, _prepare(args, kwargs, token), cap)
    return ReceiveFuture(call.receive, f"differentiable rpc of {call.name}")


class _DiffCall:
    """One differentiable RPC of a trace: its send, backward message and receive."""

    def __init__(self, ctx: Any, worker: Any, func: Any, timeout: Any, token: Any,
                 prepared: tuple, cap: Any):
        self.ctx, self.worker, self.func, self.timeout, self.token = (ctx, worker, func,
                                                                      timeout, token)
        self.xs, _, self.skeleton, self.links = prepared
        self.cap = cap
        self.noted = None if cap is None else cap.note_call(worker.id, func, self.skeleton,
                                                             self.xs, self.links)
        self.msg = ctx.new_message_id()
        self.name = getattr(func, "__qualname__", repr(func))
        self.state: dict = {}
        # with no traced argument and no RRef sent along, the send has nothing to give a
        # cotangent to: one custom_vjp in the trace instead of two (each costs about a
        # third of a millisecond of eager autodiff)
        self.direct = not self.xs and not self.links
        if self.direct:
            self.send([])
            self.sent = token
        else:
            self.sent = bind(token, self.xs, self.send, self.backward, self.links)

    def send(self, xs_concrete: list) -> Any:
        vals = [_concrete(x, f"rpc of {self.name}") for x in xs_concrete]
        after = self.ctx.chain(self.worker.id, self.msg)
        rref_pos = [pos for pos, _, _ in self.links]
        self.state["reply"] = self.ctx.agent.rpc_async(
            self.worker, _callee_forward, (self.msg, self.func, self.skeleton, vals,
                                           rref_pos, after), None, self.timeout)
        C.add_pending(self.state["reply"])
        return np.zeros((), np.float32)

    def backward(self, ct: Any) -> Any:
        del ct
        cts = self.state.pop("cts", None)
        if cts is None:  # the value never reached the loss
            return no_answer(self.xs, self.links)
        return self.ctx.agent.rpc_async(self.worker, _callee_backward, (self.msg, cts), None,
                                        self.timeout)

    def sink(self, cts: Any) -> None:
        self.state["cts"] = cts
        if self.direct:  # no send's rule to send them: the backward message goes now
            C.add_pending(self.backward(None))

    def receive(self) -> Any:
        if C.tracing() is not self.token:
            raise DistAutogradError(
                f"the future of a differentiable rpc of {self.name} was waited on outside "
                "the loss function that made it; wait for it inside (its value is part "
                "of the differentiated pass)")
        box: dict = {}

        def value():
            skel_out, diff_out = self.state["reply"].wait()
            box["skeleton"] = skel_out
            if self.noted is not None:
                self.cap.note_reply(self.noted, skel_out, diff_out)
            return tuple(to_array(d) for d in diff_out)

        diff = from_token(self.sent, value, self.sink)
        return _fill(box["skeleton"], list(diff))


def _prepare(args: Any, kwargs: Any, token: Any) -> tuple[list, list, Any, list]:
    """(traced arrays, their leaf positions, the structure with Slots in their place,
    the differentiable RRefs among the leaves as ``(position, tracer, link)``)."""
    leaves, tdef = flatten_args((tuple(args or ()), dict(kwargs or {})))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
    skel = list(leaves)
    for k, i in enumerate(pos):
        skel[i] = _Slot(k)
    links = []
    for i, x in enumerate(leaves):
        ad = getattr(x, "_ad_link", None) if isinstance(x, RRef) else None
        if ad is not None and ad[2] is token:  # made by a differentiable call of this trace
            links.append((i, ad[0], ad[1]))
    return [leaves[i] for i in pos], pos, jax.tree_util.tree_unflatten(tdef, skel), links



def differentiable_remote(ctx: C.DistAutogradContext, to: Any, func: Any, args: Any,
                          kwargs: Any, timeout: Any) -> Any:
    """``remote()`` inside a differentiable trace: the value stays on ``to``; its
    ``to_here()`` in the same trace is differentiable back through the call."""
    agent = ctx.agent
    worker = agent.worker_info(to)
    fn_name = getattr(func, "__qualname__", repr(func))
    if worker.id == agent.info.id:
        raise DistAutogradError(
            f"remote({worker}, {fn_name}) to this worker inside a dist_autograd loss "
            "function: its value would not be differentiable; call the function directly")
    C.spoil_capture("remote() inside the loss function")
    token = C.tracing()
    xs, _, skeleton, links = _prepare(args, kwargs, token)
    msg = ctx.new_message_id()
    link = _Link()
    box: dict = {}
    rref_pos = [pos for pos, _, _ in links]

    def forward(xs_c):  # the value is made on the callee; this does not wait for it
        vals = [_concrete(x, f"remote of {fn_name}") for x in xs_c]
        after = ctx.chain(worker.id, msg)
        prev = C.set_tracing(None)  # the remote() itself is a plain one
        try:
            box["rref"] = agent.remote(worker, _callee_remote,
                                       (msg, func, skeleton, vals, rref_pos, after), None,
                                       timeout)
        finally:
            C.set_tracing(prev)
        C.add_pending(box["rref"]._get_future())
        return np.zeros((), np.float32)

    def send_back(cts):  # on this thread, or on the pool thread of a later answer
        if cts is None:  # the value never reached the loss
            return no_answer(xs, links)
        with C.as_current(ctx):
            return agent.rpc_async(worker, _callee_backward, (msg, cts), None, timeout)

    def backward(ct):
        del ct  # the to_here() calls' cotangents, summed in link, are what flows back
        # those that come back from a worker the RRef was handed to are sent on when they
        # arrive: the pass does not wait for them here (the pipeline's micro-batches)
        return link.collect_then(send_back)

    tracer = bind(token, xs, forward, backward, links)
    rref = box["rref"]
    rref._ad_link = (tracer, link, token)
    return rref


def differentiable_fetch(ctx: C.DistAutogradContext, rref: Any, ad_link: tuple,
                         timeout: Any) -> Future:
    """``to_here()`` of an RRef made by a differentiable ``remote()``."""
    del ctx
    tracer, link, token = ad_link
    if token is not C.tracing():  # made in another (finished) trace: a plain fetch
        prev = C.set_tracing(None)
        try:
            return rref._fetch(timeout)
        finally:
            C.set_tracing(prev)
    C.spoil_capture("to_here() of a differentiable remote()")
    box: dict = {}

    def forward():
        prev = C.set_tracing(None)  # the fetch itself is a plain call
        try:
            if rref.is_owner():
                value = rref.local_value(timeout)
            else:
                value = rref._fetch(timeout).wait()
        finally:
            C.set_tracing(prev)
        skel, diff = _split_outputs(value)
        box["skeleton"] = skel
        return tuple(to_array(d) for d in diff)

    diff = from_token(tracer, forward, link.add)
    fut: Future = Future(_desc=f"differentiable to_here of {rref!r}")
    fut.set_result(_fill(box["skeleton"], list(diff)))
    return fut


# ---------------------------------------------------------------- callee side
def _require_context(what: str) -> C.DistAutogradContext:
    ctx = C.current()
    if ctx is None:
        raise DistAutogradError(f"{what} arrived without a distributed autograd context id")
    return ctx


def _record(msg: tuple, func: Any, skeleton: Any, xs: list,
            rref_pos: list[int]) -> tuple[Any, list]:
    """Run ``func`` under ``jax.vjp``; keep the VJP under ``msg``; return its value split.

    ``rref_pos``: leaves of ``skeleton`` that are RRefs to differentiable values (made
    by a differentiable call of the caller's trace); their ``to_here()`` in ``func`` is
    differentiable, and the cotangents it gets go back with the backward message.
    The parameter holders' other state (RNG counters, batch statistics) as ``func``
    left it is written back to the originals once the forward has run.
    """
    ctx = _require_context("a differentiable call")
    if getattr(func, "_jdist_compiled_forward", False) and not rref_pos:
        got = _try_compiled(ctx, msg, skeleton, xs)
        if got is not None:
            return got
    leaves, tdef = flatten_args(skeleton)
    slots = [0] * len(xs)
    for i, x in enumerate(leaves):
        if _is_slot(x):
            slots[x.index] = i
    params = find_params(leaves, ctx.agent.info.id)
    check_captured(func, params, ctx.agent.info.id,
                   f"{ctx.agent.info}, a differentiable call")
    if _is_pure(func, leaves) and not getattr(func, "_jdist_async_execution", False):
        from jdist.rpc.autograd._compiled_pure import try_record_pure

        got = try_record_pure(ctx, msg, func, leaves, tdef, slots, params, xs, rref_pos)
        if got is not None:
            return got
    xs = [to_array(x) for x in xs]
    pvals = [t.values() for _, t in params]
    links = [_Link() for _ in rref_pos]

    def g(token, xs_, pvals_):
        args, kwargs = rebuild_args(leaves, tdef, slots, params, xs_, pvals_)
        for pos, link in zip(rref_pos, links, strict=True):
            leaves[pos]._ad_link = (token, link, token)
        try:
            out = call_traced(token, func, args, kwargs)
            if getattr(func, "_jdist_async_execution", False) and isinstance(out, Future):
                out = out.wait()  # an @async_execution function (or RRef proxy method)
            skel_out, diff = _split_outputs(out)
        finally:
            for pos in rref_pos:
                leaves[pos]._ad_link = None
        return tuple(diff), (skel_out, [t.state_after() for _, t in params])

    diff, vjp_fn, (skel_out, states) = jax.vjp(g, np.zeros((), np.float32), xs, pvals,
                                               has_aux=True)
    for (_, t), st in zip(params, states, strict=True):
        t.write_back(st)
    ctx.keep_vjp(msg, (vjp_fn, [t for _, t in params], links))
    return skel_out, diff


def _pure_by_contract(func: Any) -> bool:
    """Marked :func:`jdist.rpc.dist_autograd.pure`, or jitted (``jax.jit``, ``nnx.jit``:
    a ``jax.stages.Wrapped``), whose contract is the same: Python runs once per trace,
    so compiling its forward and VJP changes nothing."""
    return bool(getattr(func, "_jdist_pure", False)) or isinstance(func, jax.stages.Wrapped)


def _is_pure(func: Any, leaves: list) -> bool:
    """Whether ``func`` is pure by contract (:func:`_pure_by_contract`), or is an RRef
    proxy's call (``rref.rpc_sync().name(...)``, ``rref.remote().name(...)``) of a
    method that is."""
    if _pure_by_contract(func):
        return True
    if func is rref_method_call and len(leaves) >= 2 and isinstance(leaves[0], RRef) \
            and isinstance(leaves[1], str) and leaves[0].is_owner():
        return _pure_by_contract(getattr(type(leaves[0].local_value()), leaves[1], None))
    return False


def _try_compiled(ctx: C.DistAutogradContext, msg: tuple, skeleton: Any,
                  xs: list) -> tuple[Any, list] | None:
    """A ``RemoteModule`` forward as one compiled program (``_compiled``), or None."""
    outer, outer_kw = skeleton
    if outer_kw or len(outer) != 3 or not isinstance(outer[0], RRef):
        return None
    rref, args, kwargs = outer
    if rref.owner().id != ctx.agent.info.id or not isinstance(args, tuple) \
            or not isinstance(kwargs, dict):
        return None
    from jdist.rpc.autograd._compiled import try_record

    return try_record(ctx, msg, rref, args, kwargs, xs)


def _record_in_order(msg: tuple, func: Any, skeleton: Any, xs: list, rref_pos: list,
                     after: Any) -> tuple[Any, list]:
    """:func:`_record`, once the caller's previous call to this worker (``after``) is
    recorded."""
    ctx = _require_context("a differentiable call")
    try:
        if after is not None:
            _prefetch_rrefs(func, skeleton)
        ctx.wait_recorded(after, ctx.agent.options.rpc_timeout or None)
        return _record(msg, func, skeleton, xs, rref_pos)
    finally:
        ctx.mark_recorded(msg)


def _prefetch_rrefs(func: Any, skeleton: Any) -> None:
    """Start fetching the values of the other workers' RRefs among the arguments of a
    ``pure`` function, which fetches them all before it runs (``_compiled``): a call
    waiting for the caller's previous one (the pipeline's micro-batches) then gets them
    while it waits, not after."""
    leaves, _ = flatten_args(skeleton)
    if not _is_pure(func, leaves) or getattr(func, "_jdist_async_execution", False):
        return
    for leaf in leaves:
        if isinstance(leaf, RRef):
            leaf._prefetch()


@C._internal
def _callee_forward(msg: tuple, func: Any, skeleton: Any, xs: list,
                    rref_pos: list[int] = (), after: Any = None) -> tuple[Any, list]:
    """Callee side of a differentiable call: the value, its VJP kept under ``msg``."""
    skel_out, diff = _record_in_order(msg, func, skeleton, xs, list(rref_pos), after)
    return skel_out, [np.asarray(d) for d in diff]


@C._internal
def _callee_remote(msg: tuple, func: Any, skeleton: Any, xs: list,
                   rref_pos: list[int] = (), after: Any = None) -> Any:
    """Callee side of a differentiable ``remote()``: the value (kept here by the
    ``remote()`` that ran this)."""
    skel_out, diff = _record_in_order(msg, func, skeleton, xs, list(rref_pos), after)
    return _fill(skel_out, [to_array(d) for d in diff])


@C._internal
def _callee_backward(msg: tuple, cts: list) -> list:
    """Run the VJP recorded under ``msg`` with ``cts``; keep parameter gradients here."""
    ctx = _require_context("a backward message")
    with ctx.lock:
        entry = ctx.vjps.pop(msg, None)
    if entry is None:
        raise DistAutogradError(
            f"{ctx.agent.info} has no recorded call {msg} in autograd context "
            f"{ctx.context_id}: it was already used by a backward pass, or the context was "
            "released")
    vjp_fn, params, links = entry
    with C.pending_scope():  # its own differentiable calls' backward messages
        _, ct_xs, ct_p = vjp_fn(tuple(to_array(c) for c in cts))
    for tracked, g in zip(params, ct_p, strict=True):
        tracked.accumulate(ctx, g)
    rref_cts = [None if c is None else [np.asarray(x) for x in c]
                for c in (lk.collect() for lk in links)]
    return [np.asarray(c) for c in ct_xs], rref_cts


# ---------------------------------------------------------------- root
def backward(ctx: C.DistAutogradContext, loss_fn: Any, args: tuple, kwargs: dict,
             has_aux: bool) -> Any:
    """Differentiate ``loss_fn(*args, **kwargs)`` across workers (see ``dist_autograd``)."""
    leaves, tdef = flatten_args((tuple(args), dict(kwargs)))
    params: list[tuple[int, Tracked]] = find_params(leaves, ctx.agent.info.id)
    check_captured(loss_fn, params, ctx.agent.info.id, "dist_autograd.backward")
    pvals = [t.values() for _, t in params]

    def g(token, pvals_):
        a, kw = rebuild_args(leaves, tdef, [], params, [], pvals_)
        out = call_traced(token, loss_fn, a, kw)
        loss, aux = _check_loss(out, has_aux)
        return loss, (aux, [t.state_after() for _, t in params])

    loss, vjp_fn, (aux, states) = jax.vjp(g, np.zeros((), np.float32), pvals, has_aux=True)
    for (_, t), st in zip(params, states, strict=True):
        t.write_back(st)
    with C.pending_scope():  # backward messages still in flight
        _, ct_p = vjp_fn(np.ones(loss.shape, loss.dtype))
    for (_, tracked), grads in zip(params, ct_p, strict=True):
        tracked.accumulate(ctx, grads)
    return (loss, aux) if has_aux else loss


def _check_loss(out: Any, has_aux: bool) -> tuple[Any, Any]:
    aux = None
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"with has_aux=True the loss function must return (loss, aux), "
                            f"got {type(out).__name__}")
        out, aux = out
    shape = getattr(out, "shape", None)
    dtype = getattr(out, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise LossTypeError(
            f"the loss is not a scalar, all roots need to be scalar (torch's words): "
            f"dist_autograd.backward needs a loss function returning a float scalar "
            f"(torch's scalar root), got {type(out).__name__} with shape {shape} and dtype "
            f"{dtype}; reduce it (e.g. jnp.sum) or pass has_aux=True for (loss, aux)")
    return out, aux
