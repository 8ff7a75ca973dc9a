"""Parameters a differentiated function reads from outside its arguments are refused.

JAX has no tape: a distributed-autograd pass differentiates the parameters it is given
(the loss function's arguments on the caller, a called function's arguments on each
callee). One the function reaches another way (a module in a closure, a global, a
default argument, the object of a bound method) is read as a constant: it gets no
gradient, and a ``DistributedOptimizer`` step then skips it without a word, where torch,
which records every tensor that requires grad, would have trained it. Such a silent
difference is refused instead, before the pass runs, naming the value and the fix.

What is looked at: the function's closure cells, its defaults, the globals its own code
names, a bound method's object and a ``functools.partial``'s arguments. Values are
NNX modules and Variables (a module's own method included) and RRefs owned by this
worker holding them. Parameters also among the arguments are fine (a module captured
*and* passed). Not looked into: plain objects (a trainer's ``self`` holding modules
whose gradients come from a DDP stage, as torch's HybridModel tests do) and what the
function's callees read; those stay the user's to pass.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from flax import nnx

from jdist.errors import DistAutogradError
from jdist.rpc._rref import RRef
from jdist.rpc.autograd._params import track

__all__ = ["check_captured"]


def _outside(fn: Any) -> list[tuple[str, Any]]:
    """``(description, value)`` of what ``fn`` reads other than its arguments."""
    out: list[tuple[str, Any]] = []
    while isinstance(fn, functools.partial):
        out += [(f"functools.partial argument {i}", a) for i, a in enumerate(fn.args)]
        out += [(f"functools.partial argument {k}=", a) for k, a in fn.keywords.items()]
        fn = fn.func
    if inspect.ismethod(fn):
        out.append(("the bound method's object", fn.__self__))
        fn = fn.__func__
    if isinstance(fn, (nnx.Module, nnx.Variable)):
        return [*out, ("the function itself (a module)", fn)]
    code = getattr(fn, "__code__", None)
    if code is None:
        return out
    cells = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars, cells, strict=False):
        try:
            out.append((f"closure variable {name!r}", cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    for i, d in enumerate(getattr(fn, "__defaults__", None) or ()):
        out.append((f"default argument {i}", d))
    for k, d in (getattr(fn, "__kwdefaults__", None) or {}).items():
        out.append((f"default argument {k}=", d))
    names = getattr(fn, "__globals__", {})
    out += [(f"global {n!r}", names[n]) for n in code.co_names if n in names]
    return out


def _variables(value: Any, me: int) -> list:
    if isinstance(value, RRef):
        if value.owner().id != me:
            return []
        value = value.local_value()
    if not isinstance(value, (nnx.Module, nnx.Variable)):
        return []
    t = track(value)
    return [] if t is None else list(t.variables)


def check_captured(fn: Any, given: list, me: int, where: str) -> None:
    """Raise if ``fn`` reaches parameters that are not among ``given`` (trackers of its
    arguments' parameter holders, ``(position, tracker)``) on worker ``me``."""
    ids = {id(v) for _, t in given for v in t.variables}
    for what, value in _outside(fn):
        missing = [v for v in _variables(value, me) if id(v) not in ids]
        if missing:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            raise DistAutogradError(
                f"{where}: {name} reads {len(missing)} parameter(s) through its {what} "
                f"({type(value).__name__}), not through its arguments. JAX differentiates "
                "only arguments, so they would get no gradient (and a DistributedOptimizer "
                "would skip them), where torch trains them. Pass the module (or its RRef) "
                "as an argument, e.g. backward(cid, lambda model, x: loss(model(x)), "
                "model, x); keep state that must not be trained in a Variable that is not "
                "an nnx.Param")
