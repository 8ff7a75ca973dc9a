"""Compiled recorded forwards: a ``RemoteModule`` call under distributed autograd.

The generic callee path (:func:`jdist.rpc.autograd._engine._record`) runs the function
under eager ``jax.vjp``: every call pays op-by-op dispatch and every new input shape
compiles the forward and, separately, its transposed backward. A ``RemoteModule``
forward is a pure function of the module's state and the received arrays, so here it
is one ``jax.jit`` program returning ``(output, state after, VJP)`` (the VJP's
residuals are outputs of the program) and one jitted backward that applies that VJP.
Both are compiled once per *signature*: the module's graph, the static arguments and the
shapes and dtypes of the arrays.

Shape buckets: a module that opts into ``bucket_call`` (``jdist/rpc/_buckets.py``) has its
variable-size calls padded to a few sizes; the output is cut back to the real rows (in
numpy, outside the program), output cotangents are zero-padded and argument cotangents
cut back, so values and gradients are exactly the unpadded ones.

Calls that do not fit (differentiable RRefs among the arguments, non-array arguments,
outputs that are not floating arrays, a module that cannot be traced) take the generic
path.

A function marked :func:`jdist.rpc.dist_autograd.pure` gets the same treatment for any
arguments (:func:`try_record_pure`): the parameter holders ``_params.find_params``
finds, the received arrays, other arrays and static leaves (numbers, strings,
functions); the holders' non-parameter state goes in and out of the program, so RNG
counters and batch statistics advance per call.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.rpc._buckets import padded_call
from jdist.rpc.autograd import _context as C

__all__ = ["try_record", "try_record_pure", "TRACES"]

TRACES: Counter = Counter()
"""How often each program kind was traced (``"forward"``, ``"backward"``): tests count
compilations with it."""

_lock = threading.Lock()
_programs: dict = {}
_EAGER = object()  # a signature that failed to trace: always the generic path


class _NotCompilable(Exception):
    """Raised while tracing: this call takes the generic (eager) path."""


def _aval(x: Any) -> tuple:
    return (tuple(np.shape(x)), str(x.dtype))


def _program(key: tuple, build: Any) -> Any:
    with _lock:
        prog = _programs.get(key)
        if prog is None:
            prog = _programs[key] = build()
    return prog


def _build(gdef: Any, ptdef: Any, nargs: int, diff: tuple, static: dict, kwnames: tuple):
    """The jitted forward and backward of ``module(*args, **kwargs)``."""

    def assemble(dyn, dv):
        vals = list(dyn)
        for j, v in zip(diff, dv, strict=True):
            vals[j] = v
        full = [static[i] if i in static else vals.pop(0) for i in range(nargs)]
        return tuple(full[:nargs - len(kwnames)]), dict(zip(kwnames, full[nargs - len(kwnames):],
                                                            strict=True))

    def forward(pvals, rest, dyn):
        TRACES["forward"] += 1
        dv = [dyn[j] for j in diff]

        def h(pv, dv_):
            # fresh Variables for the non-parameter state, made at this trace level: a
            # Dropout's RngCount made by the jit trace cannot be updated inside the vjp
            module = nnx.merge(gdef, jax.tree_util.tree_unflatten(ptdef, list(pv)),
                               jax.tree.map(lambda x: x, rest))
            args, kwargs = assemble(dyn, dv_)
            out = module(*args, **kwargs)
            leaves = jax.tree_util.tree_leaves(out)
            if not leaves or not all(isinstance(x, jax.Array)
                                     and jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves):
                raise _NotCompilable("an output leaf is not a floating array")
            return out, nnx.split(module, nnx.Param, ...)[2]

        out, vjp_fn, state = jax.vjp(h, list(pvals), dv, has_aux=True)
        return out, state, vjp_fn

    def backward(vjp_fn, ct):
        TRACES["backward"] += 1
        return vjp_fn(ct)

    return jax.jit(forward), jax.jit(backward)


def try_record(ctx: Any, msg: tuple, module_rref: Any, args: tuple, kwargs: dict,
               xs: list) -> tuple[Any, list] | None:
    """Record a ``RemoteModule`` forward compiled: ``(skeleton, diff outputs)`` as
    ``_record`` returns them, or None when the generic path must run it.

    ``args`` / ``kwargs``: the call's arguments with ``Slot``s where the caller sent
    traced arrays (``xs``, in slot order).
    """
    from jdist.rpc.autograd._params import Tracked
    from jdist.rpc.autograd._slots import _is_slot, _split_outputs

    module = module_rref.local_value()
    if not isinstance(module, nnx.Module):
        return None
    flat = list(args) + [kwargs[k] for k in kwargs]
    kwnames = tuple(kwargs)
    slot_of: dict[int, int] = {}  # argument position -> slot index
    vals: list = []
    for i, a in enumerate(flat):
        if _is_slot(a):
            slot_of[i] = a.index
            vals.append(np.asarray(xs[a.index]))
        elif isinstance(a, (np.ndarray, jax.Array)):
            vals.append(np.asarray(a))
        elif isinstance(a, (bool, int, float)):  # as RemoteModule's nnx.jit takes them
            vals.append(a)
        else:
            return None
    padded = None if kwargs else padded_call(module, tuple(vals))
    if padded is not None:
        vals = list(padded.args)
    static = {i: v for i, v in enumerate(vals) if not isinstance(v, np.ndarray)}
    dyn = [v for v in vals if isinstance(v, np.ndarray)]
    dyn_pos = [i for i, v in enumerate(vals) if isinstance(v, np.ndarray)]
    diff = tuple(k for k, i in enumerate(dyn_pos)
                 if i in slot_of and np.issubdtype(dyn[k].dtype, np.inexact))
    tracked = Tracked.of_module(module, rref=module_rref)  # _build merges its gdef
    gdef, rest = tracked.gdef, tracked.rest
    rest_leaves, rest_tdef = jax.tree_util.tree_flatten(rest)
    try:
        key = (gdef, tracked._tdef, rest_tdef, tuple(_aval(x) for x in rest_leaves),
               len(vals), diff, tuple(sorted((i, type(v), v) for i, v in static.items())),
               kwnames)
        hash(key)
    except TypeError:
        return None
    prog = _program(key, lambda: _build(gdef, tracked._tdef, len(vals), diff, static,
                                        kwnames))
    if prog is _EAGER:
        return None
    fwd, bwd = prog
    try:
        out, state, vjp_fn = fwd(tracked.values(), rest, dyn)
    except (_NotCompilable, jax.errors.ConcretizationTypeError,
            jax.errors.TracerArrayConversionError, jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError):
        with _lock:
            _programs[key] = _EAGER
        return None
    nnx.update(module, state)
    full_shapes = [np.shape(o) for o in jax.tree_util.tree_leaves(out)]
    if padded is not None:
        out = padded.cut_output(out)
    out_leaves, out_tdef = jax.tree_util.tree_flatten(out)
    slot_pos = {k: slot_of[dyn_pos[k]] for k in diff}

    def vjp(cts: tuple) -> tuple:
        ct_out = []
        for c, leaf, shape in zip(cts, out_leaves, full_shapes, strict=True):
            c = np.asarray(c, np.asarray(leaf).dtype)
            ct_out.append(c if padded is None else padded.pad_cotangent(c, shape))
        ct_p, ct_d = bwd(vjp_fn, jax.tree_util.tree_unflatten(out_tdef, ct_out))
        ct_xs = [np.zeros(np.shape(x), np.asarray(x).dtype) for x in xs]
        for k, c in zip(diff, ct_d, strict=True):
            c = np.asarray(c)
            ct_xs[slot_pos[k]] = c if padded is None else padded.cut_argument(dyn_pos[k], c)
        return None, ct_xs, [list(ct_p)]

    ctx.keep_vjp(msg, (vjp, [tracked], []))
    return _split_outputs(out)


# ---------------------------------------------------------------- pure functions
_STATIC = (bool, int, float, complex, str, bytes, type(None))


def _static_key(x: Any) -> Any:
    """A stand-in for a static leaf, compared by value (hashed with the key), or raise
    TypeError."""
    if isinstance(x, _STATIC):
        return (type(x), x)
    if callable(x) and not isinstance(x, (nnx.Module, nnx.Variable)):
        return ("callable", x)  # an unhashable one fails the key's hash check
    raise TypeError(type(x).__name__)


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
    from jdist.rpc._rref import RRef
    from jdist.rpc.autograd._params import Tracked, _TrackedRRef, rebuild_args
    from jdist.rpc.autograd._slots import _is_slot, _Link, _split_outputs

    if any(not isinstance(t, Tracked) for _, t in params):
        return None
    held = {pos for pos, _ in params}
    linked = list(rref_pos)
    dyn_pos, ref_pos, refs, sig = [], [], [], []
    for i, leaf in enumerate(leaves):
        if i in held:
            sig.append(("param",))
        elif _is_slot(leaf):
            sig.append(("slot", leaf.index))
        elif isinstance(leaf, (np.ndarray, jax.Array)):
            dyn_pos.append(i)
            sig.append(("array", _aval(leaf)))
        elif isinstance(leaf, RRef):
            value = leaf.to_here()  # outside any trace: a plain fetch
            if not isinstance(value, (np.ndarray, jax.Array)):
                return None
            ref_pos.append(i)
            refs.append(np.asarray(value))
            sig.append(("rref", _aval(refs[-1]), i in linked))
        else:
            try:
                sig.append(_static_key(leaf))
            except TypeError:
                return None
    xs = [np.asarray(x) for x in xs]
    dyn = [np.asarray(leaves[i]) for i in dyn_pos]
    diff = tuple(k for k, x in enumerate(xs) if np.issubdtype(x.dtype, np.inexact))
    # fetched values differentiated: those of differentiable remote() calls
    rdiff = tuple(k for k, (i, r) in enumerate(zip(ref_pos, refs, strict=True))
                  if i in linked and np.issubdtype(r.dtype, np.inexact))
    try:
        holders = tuple(
            (t.gdef, t._tdef, jax.tree_util.tree_structure(t.rest),
             tuple(_aval(v) for v in jax.tree_util.tree_leaves(t.rest)))
            if t.gdef is not None else (type(t.holder), _aval(t.values()[0]))
            for _, t in params)
        key = ("pure", func, tdef, tuple(sig), holders, tuple(_aval(x) for x in xs), diff,
               rdiff)
        hash(key)
    except TypeError:
        return None
    box: dict = {}  # the output skeleton, set when the program is traced

    def build():
        def forward(pvals, rests, xs_, dyn_, refs_):
            TRACES["pure forward"] += 1
            dv = [xs_[k] for k in diff]
            rv = [refs_[k] for k in rdiff]

            def h(pv, dv_, rv_):
                xs_in = list(xs_)
                for k, v in zip(diff, dv_, strict=True):
                    xs_in[k] = v
                refs_in = list(refs_)
                for k, v in zip(rdiff, rv_, strict=True):
                    refs_in[k] = v
                new = list(leaves)
                for i, v in zip(dyn_pos, dyn_, strict=True):
                    new[i] = v
                for i, v in zip(ref_pos, refs_in, strict=True):
                    new[i] = _TrackedRRef(leaves[i], v)
                for (_, t), rest in zip(params, rests, strict=True):
                    if t.gdef is not None:  # the state as an input of the program
                        t.rest = rest
                args, kwargs = rebuild_args(new, tdef, slots, params, xs_in, list(pv))
                out = C.call_traced(None, func, args, kwargs)
                skel, diff_out = _split_outputs(out)
                if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(skel)):
                    raise _NotCompilable("an output computed inside is not a floating array")
                box["skeleton"] = skel
                return tuple(diff_out), [t.state_after() for _, t in params]

            out, vjp_fn, states = jax.vjp(h, list(pvals), dv, rv, has_aux=True)
            return out, states, vjp_fn

        def backward(vjp_fn, cts):
            TRACES["pure backward"] += 1
            return vjp_fn(cts)

        return jax.jit(forward), jax.jit(backward), box

    prog = _program(key, build)
    if prog is _EAGER:
        return None
    fwd, bwd, pbox = prog
    saved = [t.rest for _, t in params]
    try:
        out, states, vjp_fn = fwd([t.values() for _, t in params], saved, xs, dyn, refs)
    except Exception:  # noqa: BLE001 - not traceable here: the generic path runs it
        with _lock:
            _programs[key] = _EAGER
        return None
    finally:
        for (_, t), rest in zip(params, saved, strict=True):
            t.rest = rest
    for (_, t), st in zip(params, states, strict=True):
        t.write_back(st)
    out_dtypes = [o.dtype for o in out]

    links = {i: _Link() for i in linked}

    def vjp(cts: tuple) -> tuple:
        ct_p, ct_d, ct_r = bwd(vjp_fn, tuple(np.asarray(c, d) for c, d in zip(
            cts, out_dtypes, strict=True)))
        ct_xs = [np.zeros(x.shape, x.dtype) for x in xs]
        for k, c in zip(diff, ct_d, strict=True):
            ct_xs[k] = c
        for k, c in zip(rdiff, ct_r, strict=True):
            links[ref_pos[k]].add([c])
        return None, ct_xs, list(ct_p)

    ctx.keep_vjp(msg, (vjp, [t for _, t in params], [links[i] for i in linked]))
    return pbox["skeleton"], list(out)
