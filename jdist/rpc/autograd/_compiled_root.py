"""A loss function marked ``dist_autograd.pure``: ``backward`` runs it as one compiled
program, its RPCs made by host callbacks.

``backward`` runs an unmarked loss function under eager ``jax.vjp``: every pass pays
JAX's autodiff op by op in Python (about a millisecond for a loss made of one RPC and a
jitted ``nll``), where the work itself takes microseconds. A marked loss function
keeps ``jax.jit``'s contract, so per *signature* (the arguments' structure, their
static leaves by value or identity, the arrays' shapes and dtypes) it becomes one
jitted program computing the loss and its backward pass. Each differentiable RPC in
it is a ``custom_vjp`` of two host callbacks (``_host.host_call``): the forward one
makes the call (``_callee_forward``, as the eager path sends it) and returns the reply's
arrays; the backward one sends their cotangents (``_callee_backward``) and returns the cotangents
of the arrays sent.

A reply's shapes are not known while tracing, so the first pass of a signature runs
the eager path and records its calls (:class:`_Recorder`): per call the worker, the
function, the arguments' leaves and the reply's structure, shapes and dtypes. The next
pass traces the program (:class:`_Tracer`); every call it meets must match the record,
or the signature stays eager. What the record cannot describe stays eager for good:
calls that overlap (an ``rpc_async`` waited on after the next call was made),
``remote()`` and ``to_here()`` of differentiable RRefs, a DDP stage, plain RPCs,
replies holding arrays that are not floating (they would become constants), or a
trace that fails. Parameter holders of this worker among the arguments (the caller's
own modules, Variables, plain objects holding them, its own RRefs to them) are part of
the program: their parameters and non-parameter state are inputs, their gradients
(added to the context) and state after (written back) outputs; the signature holds
them by identity, with their Variables and shapes.

At run time the callbacks run on XLA's threads: they carry the pass's context
explicitly (the program's :class:`_Run`; passes of one program are serialized by its
lock), each call takes the previous call's first output as an operand so the calls go
out in the recorded order, and an exception in one is raised as itself once the
program stops. Backward messages
that need no answer (no cotangent to come back) stay in flight and are waited for
before ``backward`` returns, as on the eager path.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.errors import DistAutogradError
from jdist.rpc._futures import Future
from jdist.rpc._rref import RRef
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._compiled_pure import STATIC as _STATIC
from jdist.rpc.autograd._engine import _callee_backward, _callee_forward, _check_loss
from jdist.rpc.autograd._host import host_call
from jdist.rpc.autograd._params import find_params, flatten_args, rebuild_args
from jdist.rpc.autograd._slots import _is_slot, _Slot

__all__ = ["MAX_SIGNATURES", "TRACES", "backward"]

TRACES: Counter = Counter()
"""Programs traced (``"root"``) and passes run compiled (``"root runs"``): tests count
them."""

_EAGER = object()  # a signature that stays on the eager path
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # agent -> _Table
_tables_lock = threading.Lock()

MAX_SIGNATURES = 64
"""Signatures remembered per agent (the least recently used go first): a signature
holds its static leaves (an RRef among them keeps the owner's value alive), so a loss
function given a new RRef on every pass must not grow the table for ever."""


_RAISED: set[int] = set()  # ids of callback exceptions kept (alive) by a _Run


class _QuietCallbackErrors(logging.Filter):
    """Drops JAX's log record of a callback's failure when ``backward`` raises that very
    exception to its caller (a remote error would otherwise print its traceback twice)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or id(exc) not in _RAISED


logging.getLogger("jax._src.callback").addFilter(_QuietCallbackErrors())


class _NotCompilable(Exception):
    """Raised while tracing: the signature stays eager."""


class _Ident:
    """A static leaf compared by identity (an object the program holds as it is)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ident) and other.obj is self.obj


def _aval(x: Any) -> tuple:
    return tuple(np.shape(x)), np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array, np.generic))


def _static(x: Any) -> Any:
    """A static leaf's stand-in in a key: by value for plain values, else by identity."""
    if isinstance(x, _STATIC):
        return (type(x), x)
    return _Ident(x)


def _same(a: Any, b: Any) -> bool:
    """Whether a leaf is the recorded one: the same object, or an equal plain value."""
    return a is b or (isinstance(a, _STATIC) and type(a) is type(b) and a == b)


# ---------------------------------------------------------------- recording (eager)
class _Call:
    """One recorded differentiable call: what was sent and what came back."""

    __slots__ = ("worker", "func", "tdef", "leaves", "out_tdef", "out_avals")

    def __init__(self, worker: int, func: Any, tdef: Any, leaves: list):
        self.worker, self.func, self.tdef, self.leaves = worker, func, tdef, leaves
        self.out_tdef: Any = None
        self.out_avals: list | None = None


class _Recorder:
    """The calls of one eager pass (``C.capture()`` while it runs)."""

    compiling = False

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.spoiled: str | None = None

    def spoil(self, what: str) -> None:
        if self.spoiled is None:
            self.spoiled = what

    def note_call(self, worker: int, func: Any, skeleton: Any, xs: list,
                  links: list) -> int | None:
        if links:
            self.spoil("an RRef made by a differentiable remote() sent along")
        if self.calls and self.calls[-1].out_avals is None:
            self.spoil("a call made before the reply of the one before was waited on")
        leaves, tdef = flatten_args(skeleton)
        sig: list = []
        for leaf in leaves:
            if _is_slot(leaf):
                sig.append(("slot", _aval(xs[leaf.index])))
            elif _is_array(leaf):
                sig.append(("array", _aval(leaf)))
            else:
                sig.append(("obj", leaf))
        self.calls.append(_Call(worker, func, tdef, sig))
        return len(self.calls) - 1

    def note_reply(self, index: int, skel_out: Any, diff_out: list) -> None:
        call = self.calls[index]
        leaves, tdef = jax.tree_util.tree_flatten(skel_out, is_leaf=_is_slot)
        if not all(_is_slot(x) for x in leaves):
            self.spoil(f"a reply of {getattr(call.func, '__qualname__', call.func)} holding "
                       "values other than floating arrays")
        call.out_tdef = tdef
        call.out_avals = [_aval(np.asarray(d)) for d in diff_out]

    def usable(self) -> bool:
        return (self.spoiled is None and bool(self.calls)
                and all(c.out_avals is not None for c in self.calls))


# ---------------------------------------------------------------- the compiled pass
class _Run:
    """The state of one pass of a program, read by its callbacks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one pass of the program at a time
        self.reset(None)

    def reset(self, ctx: Any) -> None:
        if getattr(self, "error", None) is not None:
            _RAISED.discard(id(self.error))
        self.ctx = ctx
        self.msgs: dict[int, tuple] = {}
        self.pending: list = []
        self.error: BaseException | None = None
        self.started = False

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run a callback's body in the pass's context; keep its exception."""
        self.started = True
        prev_ctx, prev_cap = C.current(), C.set_capture(None)
        C._set_current(self.ctx)  # the calls carry the context id (XLA's thread has none)
        try:
            return fn()
        except BaseException as e:
            if self.error is None:
                self.error = e
                _RAISED.add(id(e))  # raised to the caller as itself: JAX need not log it
            raise
        finally:
            C._set_current(prev_ctx)
            C.set_capture(prev_cap)


class _Tracer:
    """Turns the calls of the loss function, while the program is traced, into
    callbacks matching the record (``C.capture()`` during the trace)."""

    compiling = True

    def __init__(self, record: _Recorder, run: _Run, loss_name: str):
        self.record, self.run, self.loss_name = record, run, loss_name
        self.next = 0
        self.last: Any = None  # the last call's first output: the next call takes it

    def spoil(self, what: str) -> None:
        raise _NotCompilable(what)

    def call(self, agent: Any, worker: Any, func: Any, args: Any, kwargs: Any,
             timeout: Any, token: Any) -> Any:
        i, self.next = self.next, self.next + 1
        if i >= len(self.record.calls):
            raise _NotCompilable("more calls than the recorded pass made")
        rec = self.record.calls[i]
        leaves, tdef = flatten_args((tuple(args or ()), dict(kwargs or {})))
        if rec.worker != worker.id or rec.func is not func or rec.tdef != tdef:
            raise _NotCompilable(f"call {i} differs from the recorded one")
        trace = getattr(token, "_trace", None)
        skel, xs, holes, hole_pos = list(leaves), [], [], []
        for p, (leaf, sig) in enumerate(zip(leaves, rec.leaves, strict=True)):
            if isinstance(leaf, jax.core.Tracer) and getattr(leaf, "_trace", None) is trace:
                ok = sig[0] == "slot" and sig[1] == _aval(leaf)
                skel[p] = _Slot(len(xs))
                xs.append(leaf)
            elif isinstance(leaf, jax.core.Tracer):  # a value of the pass, not differentiated
                ok = sig[0] == "array" and sig[1] == _aval(leaf)
                skel[p] = None  # filled in by the callback with the value
                hole_pos.append(p)
                holes.append(leaf)
            elif _is_array(leaf):  # a constant of the program
                ok = sig[0] == "array" and sig[1] == _aval(leaf)
            else:
                ok = sig[0] == "obj" and _same(sig[1], leaf)
            if not ok:
                raise _NotCompilable(f"argument {p} of call {i} differs from the record")
        outs = self._bind(i, rec, agent, worker, func, timeout, token, skel, tdef, xs,
                          holes, hole_pos)
        fut: Future = Future(_desc=f"compiled differentiable rpc of {func!r}")
        fut.set_result(jax.tree_util.tree_unflatten(rec.out_tdef, list(outs)))
        return fut

    def _bind(self, i: int, rec: _Call, agent: Any, worker: Any, func: Any, timeout: Any,
              token: Any, skel: list, tdef: Any, xs: list, holes: list,
              hole_pos: list) -> tuple:
        host = _HostCall(self, i, rec, (agent, worker, func, timeout), (skel, tdef, hole_pos),
                         xs)
        deps = () if self.last is None else (self.last,)

        def call(tok, deps_, xs_, holes_):
            del tok
            return host_call(host.forward, host.out_specs, *deps_, *xs_, *holes_)

        def fwd(tok, deps_, xs_, holes_):
            out = call(tok, deps_, xs_, holes_)
            return out, out[0]  # the residual orders the backward callback after this one

        def bwd(first, cts):
            back = host_call(host.backward,
                             (jax.ShapeDtypeStruct((), np.float32), *host.x_specs), first, *cts)
            ct_xs = tuple(c if d else np.zeros(np.shape(c), jax.dtypes.float0)
                          for c, d in zip(back[1:], host.x_diff, strict=True))
            ct_holes = tuple(jnp.zeros_like(h) if jnp.issubdtype(h.dtype, jnp.inexact)
                             else np.zeros(np.shape(h), jax.dtypes.float0) for h in holes)
            return (back[0].astype(token.dtype), tuple(jnp.zeros_like(d) for d in deps),
                    ct_xs, ct_holes)

        op = jax.custom_vjp(call)
        op.defvjp(fwd, bwd)
        out = op(token, deps, tuple(xs), tuple(holes))
        self.last = out[0]
        return out


class _HostCall:
    """The host side of one recorded call inside the compiled pass: its forward
    callback sends the call and checks the reply against the record, its backward
    callback sends the cotangents (and waits for the inputs' only when they are
    differentiable)."""

    def __init__(self, tracer: _Tracer, i: int, rec: _Call, target: tuple, sent: tuple,
                 xs: list):
        self.run, self.i, self.rec, self.loss_name = tracer.run, i, rec, tracer.loss_name
        self.agent, self.worker, self.func, self.timeout = target
        self.skel, self.tdef, self.hole_pos = sent
        self.out_specs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in rec.out_avals)
        if not self.out_specs:  # nothing to chain the next call to, nor to keep this one
            raise _NotCompilable(f"call {i} returns no floating array")
        self.nd = 0 if tracer.last is None else 1
        self.nx = len(xs)
        self.x_specs = tuple(jax.ShapeDtypeStruct(*_aval(x)) for x in xs)
        self.x_diff = [jnp.issubdtype(x.dtype, jnp.inexact) for x in xs]

    def forward(self, *operands: Any) -> tuple:
        vals = operands[self.nd:]  # before them the previous call's output (an order only)
        return self.run.guard(lambda: self._send(vals))

    def _send(self, vals: tuple) -> tuple:
        ctx, nx = self.run.ctx, self.nx
        sent = list(self.skel)
        for p, v in zip(self.hole_pos, vals[nx:], strict=True):
            sent[p] = np.asarray(v)
        msg = ctx.new_message_id()
        after = ctx.chain(self.worker.id, msg)
        reply = self.agent.rpc_async(
            self.worker, _callee_forward,
            (msg, self.func, jax.tree_util.tree_unflatten(self.tdef, sent),
             [np.asarray(v) for v in vals[:nx]], [], after), None, self.timeout)
        skel_out, diff_out = reply.wait()
        self.run.msgs[self.i] = msg
        self._check(skel_out, diff_out)
        return tuple(np.asarray(d, s.dtype) for d, s in zip(diff_out, self.out_specs,
                                                            strict=True))

    def _check(self, skel_out: Any, diff_out: list) -> None:
        rec = self.rec
        got = [_aval(np.asarray(d)) for d in diff_out]
        out_tdef = jax.tree_util.tree_structure(skel_out, is_leaf=_is_slot)
        if got != rec.out_avals or out_tdef != rec.out_tdef:
            name = getattr(self.func, "__qualname__", repr(self.func))
            raise DistAutogradError(
                f"the reply of {name} from {self.worker} (call {self.i} of "
                f"{self.loss_name}) has arrays {got} in structure {out_tdef}; the pass "
                f"this compiled loss function was recorded from had {rec.out_avals} in "
                f"{rec.out_tdef}. A loss function marked dist_autograd.pure must get "
                "replies of the same shapes for arguments of the same shapes; remove the "
                "mark")

    def backward(self, first: Any, *cts: Any) -> tuple:
        del first
        return self.run.guard(lambda: self._send_back(cts))

    def _send_back(self, cts: tuple) -> tuple:
        reply = self.agent.rpc_async(self.worker, _callee_backward,
                                     (self.run.msgs[self.i], [np.asarray(c) for c in cts]),
                                     None, self.timeout)
        if not any(self.x_diff):  # nothing to wait for: it stays in flight
            self.run.pending.append(reply)
            return (np.ones((), np.float32),
                    *[np.zeros(s.shape, s.dtype) for s in self.x_specs])
        ct_xs, _ = reply.wait()
        return (np.ones((), np.float32),
                *[np.asarray(c, s.dtype) for c, s in zip(ct_xs, self.x_specs, strict=True)])


class _Program:
    """A signature's compiled pass: the loss, its backward pass through the recorded
    calls, and the gradients of this worker's parameter holders among the arguments
    (their parameters and non-parameter state are inputs, the state after an output)."""

    def __init__(self, record: _Recorder, loss_fn: Any, leaves: list,
                 tdef: Any, dyn_pos: list, has_aux: bool):
        self.run = _Run()
        self.params: list = []  # the holders of the pass being traced
        name = getattr(loss_fn, "__qualname__", repr(loss_fn))

        def program(dyn, tok, pvals, rests):
            TRACES["root"] += 1
            tracer = _Tracer(record, self.run, name)
            params = self.params

            def g(tok_, pvals_):
                new = list(leaves)
                for p, v in zip(dyn_pos, dyn, strict=True):
                    new[p] = v
                for (_, t), rest in zip(params, rests, strict=True):
                    t.use_rest(rest)
                args, kwargs = rebuild_args(new, tdef, [], params, [], pvals_)
                prev = C.set_capture(tracer)
                try:
                    out = C.call_traced(tok_, loss_fn, args, kwargs)
                finally:
                    C.set_capture(prev)
                if tracer.next != len(record.calls):
                    raise _NotCompilable("fewer calls than the recorded pass made")
                loss, aux = _check_loss(out, has_aux)
                return loss, (aux, tracer.last, [t.state_after() for _, t in params])

            loss, vjp_fn, (aux, last, states) = jax.vjp(g, tok, pvals, has_aux=True)
            ct_tok, ct_p = vjp_fn(jnp.ones(loss.shape, loss.dtype))
            # last: the last call's callback is never cut
            return loss, aux, last, ct_tok, ct_p, states

        self.fn = jax.jit(program)

    def __call__(self, ctx: Any, dyn: list, params: list, has_aux: bool) -> Any:
        run = self.run
        with run.lock:
            run.reset(ctx)
            self.params = params
            rests = [t.rest_state() for _, t in params]
            try:
                loss, aux, _, _, grads, states = jax.block_until_ready(self.fn(
                    dyn, np.zeros((), np.float32), [t.values() for _, t in params], rests))
            except _NotCompilable:
                raise
            except Exception as e:
                if run.error is not None:
                    raise run.error from None
                if not run.started:  # the trace or compilation failed: nothing was sent
                    raise _NotCompilable(f"{type(e).__name__}: {e}") from e
                raise
            finally:
                for (_, t), rest in zip(params, rests, strict=True):
                    t.use_rest(rest)  # the trace left tracers there
                self.params = []
                pending, run.pending = run.pending, []
                run.ctx = None
            for fut in pending:  # backward messages still in flight
                fut.wait()
        for (_, t), st, g in zip(params, states, grads, strict=True):
            t.write_back(st)
            t.accumulate(ctx, g)
        TRACES["root runs"] += 1
        return (loss, aux) if has_aux else loss


# ---------------------------------------------------------------- entry
def _signature(ctx: Any, loss_fn: Any, args: tuple, kwargs: dict,
               has_aux: bool) -> tuple | None:
    """``(key, leaves, tdef, array positions, parameter holders)`` of a pass, or None
    when it cannot be compiled (an unhashable leaf or holder)."""
    leaves, tdef = flatten_args((tuple(args), dict(kwargs)))
    params = find_params(leaves, ctx.agent.info.id)
    held = {}
    for p, t in params:
        try:
            held[p] = ("param", _Ident(leaves[p]), t.signature())
        except TypeError:
            return None
    sig, dyn_pos = [], []
    for p, leaf in enumerate(leaves):
        if p in held:
            sig.append(held[p])
        elif isinstance(leaf, jax.core.Tracer) or isinstance(leaf, (nnx.Module, nnx.Variable)):
            return None
        elif _is_array(leaf):
            dyn_pos.append(p)
            sig.append(("array", _aval(leaf)))
        elif isinstance(leaf, RRef):
            sig.append(("rref", _Ident(leaf)))
        else:
            sig.append(_static(leaf))
    key = (loss_fn, tdef, tuple(sig), has_aux)
    try:
        hash(key)
    except TypeError:
        return None
    return key, leaves, tdef, dyn_pos, params


class _Table:
    """One agent's signatures: key -> a :class:`_Recorder` (recorded, not compiled yet),
    a :class:`_Program` or ``_EAGER``; at most :data:`MAX_SIGNATURES`, least recently
    used dropped first."""

    def __init__(self) -> None:
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def __setitem__(self, key: Any, entry: Any) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > MAX_SIGNATURES:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def _table(agent: Any) -> _Table:
    with _tables_lock:
        table = _tables.get(agent)
        if table is None:
            table = _tables[agent] = _Table()
        return table


def backward(ctx: Any, loss_fn: Any, args: tuple, kwargs: dict, has_aux: bool,
             eager: Callable[[], Any]) -> Any:
    """``dist_autograd.backward`` of a loss function marked pure (see the module
    docstring); ``eager()`` runs the eager path."""
    got = _signature(ctx, loss_fn, args, kwargs, has_aux)
    if got is None:
        return eager()
    key, leaves, tdef, dyn_pos, params = got
    table = _table(ctx.agent)
    entry = table.get(key)
    if entry is _EAGER:
        return eager()
    if entry is None:  # the first pass: eager, recorded
        rec = _Recorder()
        prev = C.set_capture(rec)
        try:
            out = eager()
        finally:
            C.set_capture(prev)
        table[key] = rec if rec.usable() else _EAGER
        return out
    if isinstance(entry, _Recorder):
        template = [None if p in dyn_pos else leaf for p, leaf in enumerate(leaves)]
        # (the holders stay in the template: rebuild_args puts their traced copies there)
        entry = table[key] = _Program(entry, loss_fn, template, tdef, dyn_pos, has_aux)
    try:
        return entry(ctx, [leaves[p] for p in dyn_pos], params, has_aux)
    except _NotCompilable:
        table[key] = _EAGER
        return eager()
