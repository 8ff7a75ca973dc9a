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
arguments in ``_compiled_pure.py``, which shares :func:`run_program` and ``TRACES``.
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
from jdist.rpc.autograd._params import aval

__all__ = ["NotCompilable", "TRACES", "UNTRACEABLE", "run_program", "try_record"]

TRACES: Counter = Counter()
"""How often each program kind was traced (``"forward"``, ``"backward"``): tests count
compilations with it."""

_lock = threading.Lock()
_programs: dict = {}
_EAGER = object()  # a signature that failed to trace: always the generic path


class NotCompilable(Exception):
    """Raised while tracing: this call takes the generic (eager) path."""


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
                raise NotCompilable("an output leaf is not a floating array")
            return out, nnx.split(module, nnx.Param, ...)[2]

        out, vjp_fn, state = jax.vjp(h, list(pvals), dv, has_aux=True)
        return out, state, vjp_fn

    def backward(vjp_fn, ct):
        TRACES["backward"] += 1
        return vjp_fn(ct)

    return jax.jit(forward), jax.jit(backward)


def _call_values(args: tuple, kwargs: dict, xs: list) -> tuple[list, dict] | None:
    """The call's values in order (received arrays for their slots) and each slot
    argument's position -> slot index, or None when an argument is neither an array nor
    a number (the generic path runs it)."""
    from jdist.rpc.autograd._slots import _is_slot

    slot_of: dict[int, int] = {}
    vals: list = []
    for i, a in enumerate(list(args) + [kwargs[k] for k in kwargs]):
        if _is_slot(a):
            slot_of[i] = a.index
            vals.append(np.asarray(xs[a.index]))
        elif isinstance(a, (np.ndarray, jax.Array)):
            vals.append(np.asarray(a))
        elif isinstance(a, (bool, int, float)):  # as RemoteModule's nnx.jit takes them
            vals.append(a)
        else:
            return None
    return vals, slot_of


UNTRACEABLE = (NotCompilable, jax.errors.ConcretizationTypeError,
               jax.errors.TracerArrayConversionError, jax.errors.TracerBoolConversionError,
               jax.errors.TracerIntegerConversionError)
"""What a first trace raises when a call cannot be one program (generic path then)."""


def run_program(key: tuple, build: Any, *inputs: Any, untraceable: tuple = UNTRACEABLE
                ) -> tuple[Any, Any] | None:
    """``(program, its forward's result on inputs)``: ``build()`` compiled once per
    ``key``; None when this signature cannot be compiled (then it never is again)."""
    prog = _program(key, build)
    if prog is _EAGER:
        return None
    try:
        return prog, prog[0](*inputs)
    except untraceable:
        with _lock:
            _programs[key] = _EAGER
        return None


class _ModuleCall:
    """One compiled ``RemoteModule`` call: its values, slots and padding."""

    def __init__(self, vals: list, slot_of: dict, padded: Any, kwnames: tuple):
        self.padded, self.kwnames = padded, kwnames
        self.vals = list(padded.args) if padded is not None else vals
        self.static = {i: v for i, v in enumerate(self.vals) if not isinstance(v, np.ndarray)}
        self.dyn_pos = [i for i, v in enumerate(self.vals) if isinstance(v, np.ndarray)]
        self.dyn = [self.vals[i] for i in self.dyn_pos]
        self.diff = tuple(k for k, i in enumerate(self.dyn_pos)
                          if i in slot_of and np.issubdtype(self.dyn[k].dtype, np.inexact))
        self.slot_pos = {k: slot_of[self.dyn_pos[k]] for k in self.diff}

    def key(self, tracked: Any) -> tuple | None:
        rest_leaves, rest_tdef = jax.tree_util.tree_flatten(tracked.rest)
        try:
            key = (tracked.graph_key(), tracked._tdef, rest_tdef,
                   tuple(aval(x) for x in rest_leaves), len(self.vals), self.diff,
                   tuple(sorted((i, type(v), v) for i, v in self.static.items())),
                   self.kwnames)
            hash(key)
        except TypeError:
            return None
        return key

    def vjp(self, bwd: Any, vjp_fn: Any, out: Any, xs: list) -> Any:
        """The backward function ``ctx.keep_vjp`` keeps; cuts ``out`` to the real rows."""
        padded = self.padded
        full_shapes = [np.shape(o) for o in jax.tree_util.tree_leaves(out)]
        out = out if padded is None else padded.cut_output(out)
        out_leaves, out_tdef = jax.tree_util.tree_flatten(out)

        def vjp(cts: tuple) -> tuple:
            ct_out = []
            for c, leaf, shape in zip(cts, out_leaves, full_shapes, strict=True):
                c = np.asarray(c, np.asarray(leaf).dtype)
                ct_out.append(c if padded is None else padded.pad_cotangent(c, shape))
            ct_p, ct_d = bwd(vjp_fn, jax.tree_util.tree_unflatten(out_tdef, ct_out))
            ct_xs = [np.zeros(np.shape(x), np.asarray(x).dtype) for x in xs]
            for k, c in zip(self.diff, ct_d, strict=True):
                c = np.asarray(c)
                ct_xs[self.slot_pos[k]] = (c if padded is None
                                           else padded.cut_argument(self.dyn_pos[k], c))
            return None, ct_xs, [list(ct_p)]

        return vjp, out


def try_record(ctx: Any, msg: tuple, module_rref: Any, args: tuple, kwargs: dict,
               xs: list) -> tuple[Any, list] | None:
    """Record a ``RemoteModule`` forward compiled: ``(skeleton, diff outputs)`` as
    ``_record`` returns them, or None when the generic path must run it.

    ``args`` / ``kwargs``: the call's arguments with ``Slot``s where the caller sent
    traced arrays (``xs``, in slot order).
    """
    from jdist.rpc.autograd._params import Tracked
    from jdist.rpc.autograd._slots import _split_outputs

    module = module_rref.local_value()
    found = _call_values(args, kwargs, xs) if isinstance(module, nnx.Module) else None
    if found is None:
        return None
    vals, slot_of = found
    call = _ModuleCall(vals, slot_of, None if kwargs else padded_call(module, tuple(vals)),
                       tuple(kwargs))
    tracked = Tracked.of_module(module, rref=module_rref)  # _build merges its gdef
    key = call.key(tracked)
    ran = key and run_program(key, lambda: _build(tracked.gdef, tracked._tdef, len(call.vals),
                                                  call.diff, call.static, call.kwnames),
                              tracked.values(), tracked.rest, call.dyn)
    if not ran:
        return None
    (_, bwd), (out, state, vjp_fn) = ran
    nnx.update(module, state)
    vjp, out = call.vjp(bwd, vjp_fn, out, xs)
    ctx.keep_vjp(msg, (vjp, [tracked], []))
    return _split_outputs(out)
