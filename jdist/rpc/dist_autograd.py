"""Distributed autograd: torch.distributed.autograd for JAX loss functions.

torch records a tape during the forward pass and ``backward(context_id, [loss])``
replays it. JAX keeps no tape on eager arrays, so here the forward pass is a function
that :func:`backward` runs under ``jax.vjp``::

    # torch
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("ps", f, (x, w))
        dist_autograd.backward(cid, [out.sum()])
        grads = dist_autograd.get_gradients(cid)

    # jdist: the forward pass is a function of the parameters (here one held in an RRef)
    with dist_autograd.context() as cid:
        def loss_fn(w_rref):
            w = w_rref.local_value()                  # traced copy of an nnx.Param
            return jnp.sum(rpc.rpc_sync("ps", f, (x, w[...])))
        loss = dist_autograd.backward(cid, loss_fn, w_rref)
        grads = dist_autograd.get_gradients(cid)      # {ParamKey(w): gradient}

Inside the loss function (and inside every function a worker runs for such a call),
``rpc_sync`` / ``rpc_async`` / RRef proxies / ``RemoteModule.forward`` are
differentiable: the callee keeps the VJP of what it ran, and the backward pass sends
cotangents back along the calls, worker to worker (torch's FAST mode). Parameters are
NNX modules and ``nnx.Variable`` s (e.g. ``nnx.Param``) passed as arguments, directly or
through RRefs owned by the worker running the function; their gradients accumulate in
the context on their own worker (never in the parameters), readable there with
:func:`get_gradients` and applied by :class:`jdist.rpc.DistributedOptimizer`.

Differences from torch:

- the forward pass runs inside :func:`backward`, so each call of it runs the forward
  again (and a second ``backward`` in one context simply accumulates more gradient:
  there is no freed graph to complain about);
- a call whose result is never used in the loss keeps its recorded VJP until the
  context exits (torch's FAST mode can hang or error on it);
- ``rpc_async`` and ``remote()`` inside the loss function return at once and run
  while it goes on (pipelining as in torch); wait on their futures inside the loss
  function; one worker records the calls it gets from one caller in the order they
  were made;
- ``remote()`` inside the loss function is differentiable through ``to_here()`` calls
  made in the same loss function or on a worker the RRef is handed to in a
  differentiable call (the cotangents of all of them are summed and sent once);
  ``remote()`` to the worker itself there raises (call the function directly);
- a function differentiated here sees a copy of each module whose parameters are
  traced; the copy's other state afterwards (dropout RNG counters, batch statistics)
  is written back to the module, as a plain call would leave it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jdist.errors import DistAutogradError, LossTypeError
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._context import DistAutogradContext as DistAutogradContext
from jdist.rpc.autograd._ddp_stage import ddp_layer as ddp_layer
from jdist.rpc.autograd._ddp_stage import ddp_stage as ddp_stage
from jdist.rpc.autograd._gradients import GradientMap as GradientMap
from jdist.rpc.autograd._gradients import ParamKey as ParamKey

__all__ = ["DistAutogradContext", "GradientMap", "ParamKey", "backward", "context", "pure",
           "ddp_layer", "ddp_stage", "get_gradients"]

log = logging.getLogger("jdist.rpc")


def _agent(agent: Any) -> Any:
    if agent is not None:
        return agent
    ctx = C.current()
    if ctx is not None:
        return ctx.agent
    from jdist.rpc._state import current_agent

    return current_agent()


@contextmanager
def context(agent: Any = None) -> Iterator[int]:
    """``with context() as context_id:`` a distributed autograd pass.

    The id is globally unique (this worker's id in the high bits) and travels with every
    RPC made in this thread inside the block. On exit the context is released on every
    worker it reached (asynchronously on the others, as torch: each worker passes the
    release on to the workers it sent messages of the context to; they hear of it with
    this worker's next call to them, or from a call of its own soon after); using the
    id afterwards raises ``Could not find autograd context with id: N``.

    Args:
      agent: the RPC agent (default: this process's, from ``init_rpc``; tests running
        several agents in one process pass one).

    Raises:
      DistAutogradError: this thread is already in a context
        (``Already have an autograd context id for this thread.``).
    """
    agent = _agent(agent)
    if C.current() is not None:
        raise DistAutogradError("Already have an autograd context id for this thread.")
    reg = C.registry(agent)
    ctx = reg.new()
    C._set_current(ctx)
    try:
        yield ctx.context_id
    finally:
        try:
            C.release_on_reached(ctx)
        finally:
            C._set_current(None)
            reg.release(ctx.context_id)


def _lookup(context_id: int, agent: Any) -> C.DistAutogradContext:
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(f"context_id must be the int from dist_autograd.context(), "
                        f"got {context_id!r}")
    return C.registry(_agent(agent)).get(context_id)


def backward(context_id: int, loss_fn: Any, *args: Any, has_aux: bool = False,
             agent: Any = None, **kwargs: Any) -> Any:
    """Run ``loss_fn(*args, **kwargs)`` and its backward pass across workers.

    This is torch's ``backward(context_id, [loss])`` with the forward pass inside:
    ``loss_fn`` returns a float scalar (or ``(loss, aux)`` with ``has_aux``); the
    differentiable RPCs it makes are followed backwards to every worker they reached.
    Blocks until the whole pass is done. Gradients of parameters (NNX modules and
    Variables among ``args``, directly or in RRefs owned here; likewise on every worker
    reached) accumulate in the context on their owner: read them with
    :func:`get_gradients`.

    Returns:
      the loss (``(loss, aux)`` with ``has_aux``).

    Raises:
      DistAutogradError: ``context_id`` is unknown or released.
      TypeError: the loss is not a float scalar.
      the error of any remote call, with its remote traceback; a worker that died on
      the way: :class:`jdist.errors.WorkerUnavailableError` naming it.
    """
    from jdist.rpc.autograd import _engine

    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(f"backward(): incompatible function arguments: context_id must be the "
                        f"int from dist_autograd.context(), got {context_id!r}")
    if isinstance(loss_fn, (list, tuple)) and not loss_fn:
        raise DistAutogradError("No tensors provided for gradient computation: jdist's "
                                "backward(context_id, loss_fn, *args) takes the function that "
                                "computes the loss")
    if isinstance(loss_fn, (list, tuple)):
        raise LossTypeError(f"requires_grad not set on the arrays given: jdist arrays carry no "
                            f"autograd graph, so torch's list of loss tensors "
                            f"({type(loss_fn).__name__} of {len(loss_fn)}) cannot be "
                            "differentiated; pass the function that computes the loss, "
                            "backward(context_id, loss_fn, *args)")
    ctx = _lookup(context_id, agent)
    if not callable(loss_fn):
        raise TypeError(f"backward(): incompatible function arguments: loss_fn must be "
                        f"callable, got {loss_fn!r}; torch's list of loss tensors has no JAX "
                        "equivalent (arrays carry no tape): pass the function that computes "
                        "the loss, backward(context_id, loss_fn, *args)")
    prev = C.current()
    C._set_current(ctx)
    try:
        if getattr(loss_fn, "_jdist_pure", False):  # one compiled program per signature
            from jdist.rpc.autograd import _compiled_root

            return _compiled_root.backward(
                ctx, loss_fn, args, kwargs, has_aux,
                lambda: _engine.backward(ctx, loss_fn, args, kwargs, has_aux))
        return _engine.backward(ctx, loss_fn, args, kwargs, has_aux)
    finally:
        C._set_current(prev)


def pure(func: Any) -> Any:
    """Mark ``func``, a function run by RPC, as pure: under distributed autograd its
    callee may record it as one compiled forward+VJP program per signature.

    A differentiable call of an unmarked function runs it under eager ``jax.vjp`` on
    the callee: every call traces it op by op (several milliseconds of Python for a
    small network, even when its body is an ``nnx.jit``). A marked function is traced
    once per signature (the argument structure, the static leaves, the shapes and
    dtypes of the arrays, the structure of the modules reached) and then runs as two
    compiled programs, its forward with the VJP's residuals and the backward.

    The contract is ``jax.jit``'s: the result depends only on the arrays and the state
    of the modules among the arguments (RRefs owned by the callee included); Python
    side effects run when it is traced, not on every call; it makes no RPCs other than
    ``to_here()`` of RRefs among its arguments that hold an array (fetched before the
    program runs, their values are inputs of it; the value of a differentiable
    ``remote()`` gets its gradient as in an unmarked call). Numbers, strings and
    functions among the arguments are static (a new value traces again). Module state
    other than parameters (dropout RNG counters, batch statistics) is an input and an
    output of the program, so it advances as in a plain call. A method so marked is
    compiled when called through an RRef proxy of its owner (``rref.remote().forward(x)``).
    A function (or method) already wrapped by ``jax.jit`` or ``nnx.jit`` has this
    contract by construction and is compiled without the mark.
    Calls that do not fit (a plain object holding modules, an RRef holding neither a
    module nor an array, another kind of leaf) run the generic way. Outside distributed
    autograd the mark changes nothing. Returns ``func`` itself (it still pickles by
    reference)::

        @dist_autograd.pure
        def call_method(method, rref, *args):
            return method(rref.local_value(), *args)

    On the loss function given to :func:`backward` the mark compiles the caller's side:
    the first pass of a signature runs eagerly and records its differentiable calls;
    from the next one on, the loss, its backward pass and the calls (as host
    callbacks) are one jitted program. Arrays among the arguments are its inputs;
    other leaves are static (numbers and strings by value, other objects by identity,
    as ``static_argnums``); arrays the function reaches otherwise are constants of the
    program. It applies where the calls run one after another (each waited on before
    the next), with no ``remote()`` / ``to_here()`` of differentiable RRefs, no plain
    RPC, no DDP stage, replies of floating arrays only and no parameters of this worker
    among the arguments; otherwise the loss function keeps running eagerly. A reply
    of other shapes than the recorded pass's raises :class:`DistAutogradError`::

        @dist_autograd.pure
        def nll_loss(net, data, target):     # net(data) makes the forward RPC
            return nll(net(data), target)
    """
    if not callable(func):
        raise TypeError(f"dist_autograd.pure marks a function, got {func!r}")
    func._jdist_pure = True
    return func


def get_gradients(context_id: int, agent: Any = None) -> GradientMap:
    """The gradients accumulated on this worker for its own parameters in the context.

    Returns:
      a :class:`GradientMap`: ``{ParamKey: gradient}``, one hashable :class:`ParamKey`
      per parameter (torch's ``{k: v for k, v in grads.items()}``, ``dict(grads)``
      and ``grads != {}`` work); ``grads[param]`` also takes the ``nnx.Variable``, a
      module or an RRef owned here.

    Raises:
      DistAutogradError: unknown or released ``context_id``.
    """
    ctx = _lookup(context_id, agent)
    with ctx.lock:
        return GradientMap(dict(ctx.grads))
