"""Compiled recorded calls of functions marked :func:`jdist.rpc.dist_autograd.pure`.

Any arguments: the parameter holders ``_params.find_params`` finds, the received
arrays, other arrays, RRefs to arrays (fetched first, their values program inputs) and
static leaves (numbers, strings, functions). The call is one jitted forward+VJP program
per signature, with the holders' non-parameter state in and out of the program (RNG
counters and batch statistics advance per call), and one jitted backward. A signature
whose first trace fails always takes the generic (eager) path.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._compiled import TRACES, NotCompilable, run_program
from jdist.rpc.autograd._params import aval

__all__ = ["STATIC", "try_record_pure"]

STATIC = (bool, int, float, complex, str, bytes, type(None))
"""Leaf types a compiled program takes as static values (compared by value)."""


def _static_key(x: Any) -> Any:
    """A stand-in for a static leaf, compared by value (hashed with the key), or raise
    TypeError."""
    if isinstance(x, STATIC):
        return (type(x), x)
    if callable(x) and not isinstance(x, (nnx.Module, nnx.Variable)):
        return ("callable", x)  # an unhashable one fails the key's hash check
    raise TypeError(type(x).__name__)


class _PureCall:
    """One call's leaves sorted into parameters, received slots, arrays, fetched RRefs
    and static values; ``sig`` is their signature (None: not compilable)."""

    def __init__(self, leaves: list, params: list, linked: list, xs: list):
        self.dyn_pos, self.ref_pos, self.refs, self.sig = [], [], [], []
        held = {pos for pos, _ in params}
        for i, leaf in enumerate(leaves):
            entry = self._classify(i, leaf, held, linked)
            if entry is None:
                self.sig = None
                return
            self.sig.append(entry)
        self.xs = [np.asarray(x) for x in xs]
        self.dyn = [np.asarray(leaves[i]) for i in self.dyn_pos]
        self.diff = tuple(k for k, x in enumerate(self.xs) if np.issubdtype(x.dtype, np.inexact))
        # fetched values differentiated: those of differentiable remote() calls
        self.rdiff = tuple(k for k, (i, r) in enumerate(zip(self.ref_pos, self.refs, strict=True))
                           if i in linked and np.issubdtype(r.dtype, np.inexact))

    def _classify(self, i: int, leaf: Any, held: set, linked: list) -> tuple | None:
        from jdist.rpc._rref import RRef
        from jdist.rpc.autograd._slots import _is_slot

        if i in held:
            return ("param",)
        if _is_slot(leaf):
            return ("slot", leaf.index)
        if isinstance(leaf, (np.ndarray, jax.Array)):
            self.dyn_pos.append(i)
            return ("array", aval(leaf))
        if isinstance(leaf, RRef):
            value = leaf.to_here()  # outside any trace: a plain fetch
            if not isinstance(value, (np.ndarray, jax.Array)):
                return None
            self.ref_pos.append(i)
            self.refs.append(np.asarray(value))
            return ("rref", aval(self.refs[-1]), i in linked)
        try:
            return _static_key(leaf)
        except TypeError:
            return None

    def key(self, func: Any, tdef: Any, params: list) -> tuple | None:
        try:
            # by structure: a program serves any holders of the same structure
            holders = tuple(t.signature(by_identity=False) for _, t in params)
            key = ("pure", func, tdef, tuple(self.sig), holders,
                   tuple(aval(x) for x in self.xs), self.diff, self.rdiff)
            hash(key)
        except TypeError:
            return None
        return key


def _swap(values: list, positions: Any, new: Any) -> list:
    out = list(values)
    for k, v in zip(positions, new, strict=True):
        out[k] = v
    return out


def _build(call: _PureCall, func: Any, leaves: list, tdef: Any, slots: list,
           params: list) -> tuple:
    """The jitted forward (outputs, holders' states, VJP) and backward of ``call``;
    the third entry, a dict, gets the output skeleton when the forward is traced."""
    from jdist.rpc.autograd._params import _TrackedRRef, rebuild_args
    from jdist.rpc.autograd._slots import _split_outputs

    box: dict = {}

    def h(pv, dv, rv, rests, xs_, dyn_, refs_):
        new = _swap(leaves, call.dyn_pos, dyn_)
        for i, v in zip(call.ref_pos, _swap(refs_, call.rdiff, rv), strict=True):
            new[i] = _TrackedRRef(leaves[i], v)
        for (_, t), rest in zip(params, rests, strict=True):
            if t.gdef is not None:  # the state as an input of the program
                t.rest = rest
        args, kwargs = rebuild_args(new, tdef, slots, params, _swap(xs_, call.diff, dv),
                                    list(pv))
        skel, diff_out = _split_outputs(C.call_traced(None, func, args, kwargs))
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(skel)):
            raise NotCompilable("an output computed inside is not a floating array")
        box["skeleton"] = skel
        return tuple(diff_out), [t.state_after() for _, t in params]

    def forward(pvals, rests, xs_, dyn_, refs_):
        TRACES["pure forward"] += 1
        out, vjp_fn, states = jax.vjp(
            lambda pv, dv, rv: h(pv, dv, rv, rests, xs_, dyn_, refs_), list(pvals),
            [xs_[k] for k in call.diff], [refs_[k] for k in call.rdiff], has_aux=True)
        return out, states, vjp_fn

    def backward(vjp_fn, cts):
        TRACES["pure backward"] += 1
        return vjp_fn(cts)

    return jax.jit(forward), jax.jit(backward), box


def _run(key: tuple, call: _PureCall, build: Any, params: list) -> Any:
    """The program's result; the holders' state is restored after the trace."""
    saved = [t.rest for _, t in params]
    try:
        return run_program(key, build, [t.values() for _, t in params], saved, call.xs,
                           call.dyn, call.refs, untraceable=(Exception,))
    finally:
        for (_, t), rest in zip(params, saved, strict=True):
            t.rest = rest


def try_record_pure(ctx: Any, msg: tuple, func: Any, leaves: list, tdef: Any,
                    slots: list[int], params: list, xs: list,
                    rref_pos: list[int] = ()) -> tuple[Any, list] | None:
    """Record a call of a function marked :func:`jdist.rpc.dist_autograd.pure` as one
    compiled forward+VJP program (the state of its modules as inputs and outputs), or
    return None when the generic path must run it: an RRef that is not a parameter
    holder of this worker, a plain object holding modules, a leaf that is neither an
    array nor a static value (number, string, None, function), or a first trace that
    failed (then that signature always takes the generic path).

    ``leaves``, ``tdef``, ``slots``, ``params``: the call's flattened arguments, the
    leaf position of each received array and the parameter holders, as ``_record``
    found them. An RRef among the arguments that holds an array (owned elsewhere, or
    here but not a module) is fetched first and its value is an input of the program
    (its ``to_here()`` inside returns it); for those at ``rref_pos`` (made by a
    differentiable ``remote()`` of the caller) the value's cotangent goes back with the
    backward answer, as the generic path's differentiable fetch sends it.
    """
    from jdist.rpc.autograd._params import Tracked
    from jdist.rpc.autograd._slots import _Link

    if any(not isinstance(t, Tracked) for _, t in params):
        return None
    linked = list(rref_pos)
    call = _PureCall(leaves, params, linked, xs)
    key = call.key(func, tdef, params) if call.sig is not None else None
    ran = key and _run(key, call, lambda: _build(call, func, leaves, tdef, slots, params),
                       params)
    if not ran:
        return None
    (_, bwd, box), (out, states, vjp_fn) = ran
    for (_, t), st in zip(params, states, strict=True):
        t.write_back(st)
    out_dtypes = [o.dtype for o in out]
    links = {i: _Link() for i in linked}

    def vjp(cts: tuple) -> tuple:
        ct_p, ct_d, ct_r = bwd(vjp_fn, tuple(np.asarray(c, d) for c, d in zip(
            cts, out_dtypes, strict=True)))
        ct_xs = _swap([np.zeros(x.shape, x.dtype) for x in call.xs], call.diff, ct_d)
        for k, c in zip(call.rdiff, ct_r, strict=True):
            links[call.ref_pos[k]].add([c])
        return None, ct_xs, list(ct_p)

    ctx.keep_vjp(msg, (vjp, [t for _, t in params], [links[i] for i in linked]))
    return box["skeleton"], list(out)
