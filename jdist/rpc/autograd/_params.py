"""Parameters seen by distributed autograd: NNX modules and Variables, direct or in RRefs.

A *parameter* is an ``nnx.Param`` (any ``nnx.Variable`` given on its own) living on
some worker; like torch's ``nn.Parameter`` it is a mutable holder, so an optimizer can
update it in place and gradients can be keyed by it. A function differentiated by
distributed autograd sees as parameters:

- every NNX module or Variable among its arguments;
- the value of every RRef among its arguments that is *owned by the worker running
  it* (``rref.local_value()`` and ``rref.to_here()`` then return the traced copy);
- the modules and Variables held by a plain Python object among those (an attribute,
  or in lists, tuples, dicts and further plain objects in its attributes), as torch
  finds a plain class's model through its tensors (:class:`_ObjectTracked`).

:class:`Tracked` splits one such holder into its parameter arrays (differentiated)
and the rest, rebuilds a copy from traced arrays inside the trace, and routes the
resulting gradients to the original Variables.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
import types
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.errors import DistAutogradError
from jdist.rpc._rref import RRef

__all__ = ["HashOnce", "Tracked", "is_holder_leaf", "flatten_args", "find_params",
           "param_variables", "read_variable", "rebuild_args", "track", "write_variable"]


def is_holder_leaf(x: Any) -> bool:
    """Leaves for flattening RPC arguments: modules, Variables and RRefs stay whole."""
    return isinstance(x, (nnx.Module, nnx.Variable, RRef))


def flatten_args(tree: Any) -> tuple[list, Any]:
    """``jax.tree_util.tree_flatten`` keeping modules, Variables and RRefs whole."""
    return jax.tree_util.tree_flatten(tree, is_leaf=is_holder_leaf)


def param_variables(value: Any) -> list:
    """The parameter Variables of a holder, in ``nnx.split`` state order.

    Raises:
      TypeError: ``value`` is neither an NNX module nor an ``nnx.Variable``.
    """
    if isinstance(value, nnx.Variable):
        return [value]
    if isinstance(value, nnx.Module):
        vs = nnx.variables(value, nnx.Param)
        return jax.tree.leaves(vs, is_leaf=lambda x: isinstance(x, nnx.Variable))
    raise TypeError(f"a distributed-autograd parameter must be an flax.nnx.Module or "
                    f"nnx.Variable (e.g. nnx.Param), got {type(value).__name__}; wrap arrays "
                    "in nnx.Param(array)")


def _plain(var: Any) -> bool:
    """Whether ``var`` holds a jax array as it is (no get/set hooks, no Variable type
    with its own ``get_value`` / ``set_value``): then its raw value is what those read
    and write, without their per-call cost (about 10 and 20 microseconds: a tenth of
    an optimizer step on a small model)."""
    if type(var).get_value is not _GET or type(var).set_value is not _SET:
        return False
    meta = var.get_metadata()
    return ("on_get_value" not in meta and "on_set_value" not in meta
            and isinstance(var.get_raw_value(), jax.Array))


_GET, _SET = nnx.Variable.get_value, nnx.Variable.set_value


def read_variable(var: Any) -> Any:
    """``var.get_value()``, read directly where that is the same."""
    return var.get_raw_value() if _plain(var) else var.get_value()


def write_variable(var: Any, value: Any) -> None:
    """``var.set_value(value)``, written directly where that is the same."""
    if _plain(var) and isinstance(value, jax.Array):
        var.set_raw_value(value)
    else:
        var.set_value(value)


class _TrackedRRef(RRef):
    """An owned RRef whose ``local_value()`` is the traced copy of its value.

    Pickles as the original RRef (it can be passed on to other workers).
    """

    def __init__(self, orig: RRef, traced: Any):  # noqa: D107 - no RRef.__init__
        self._orig = orig
        self._traced = traced
        self._agent, self._owner = orig._agent, orig._owner
        self._rref_id, self._fork = orig._rref_id, orig._fork
        self._confirmed, self._created, self._entry = True, None, orig._entry
        self._live = False  # never releases anything: the original does

    def __reduce_ex__(self, protocol: int):
        return _same, (self._orig,)

    def local_value(self, timeout: float = -1) -> Any:
        del timeout
        return self._traced

    def to_here(self, timeout: float = -1) -> Any:
        del timeout
        return self._traced


def _same(x: Any) -> Any:
    return x


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


_SPLIT_SHARES: list = []  # [bool] once probed (see _split_shares_variables)


def _split_shares_variables() -> bool:
    """Whether ``nnx.split`` puts the module's own Variables in its states and
    ``nnx.merge`` builds on the Variables it is given (flax 0.12 does both); then one
    split per call is enough. Probed once on a tiny module; if not, the slower path
    (``nnx.variables`` and a split of the copy after the call) runs."""
    if not _SPLIT_SHARES:
        m = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
        _, state = nnx.split(m)
        leaves = jax.tree.leaves(state, is_leaf=_is_variable)
        own = jax.tree.leaves(nnx.variables(m), is_leaf=_is_variable)
        fresh = jax.tree.map(lambda x: x, state)
        merged = nnx.merge(nnx.graphdef(m), fresh)
        again = jax.tree.leaves(nnx.variables(merged), is_leaf=_is_variable)
        theirs = jax.tree.leaves(fresh, is_leaf=_is_variable)
        _SPLIT_SHARES.append(
            len(leaves) == len(own) > 0 and len(again) == len(theirs)
            and all(a is b for a, b in zip(leaves, own, strict=True))
            and all(a is b for a, b in zip(again, theirs, strict=True)))
    return _SPLIT_SHARES[0]


_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # holder -> treedef
#: module -> (treedef, Variable ids, its Tracked split) for Tracked.of_module
_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class HashOnce:
    """A hashable value whose hash is computed once; equal to a ``HashOnce`` of an
    equal value (by identity first)."""

    __slots__ = ("obj", "_hash")

    def __init__(self, obj: Any) -> None:
        self.obj, self._hash = obj, hash(obj)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashOnce) and self._hash == other._hash and (
            self.obj is other.obj or self.obj == other.obj)


class _PytreeView:
    """A module (or list of modules) through its pytree flattening, its Variables as
    leaves: about a tenth of ``nnx.split``'s cost, which a recorded call pays on every
    call. Used only where it sees the same Variables as ``nnx.split`` (checked once per
    holder and structure, see :func:`_pytree_view`).

    Attributes:
      key: hashable, equal for holders of one structure and Variable types (a
        compiled program's cache key, as a graph definition is).
      params, others: the ``nnx.Param`` Variables and the rest, in flattening order.
      param_values, values: their values (as ``nnx.split``'s states flatten).
    """

    def __init__(self, variables: list, values: list, treedef: Any):
        self._treedef = treedef
        self._mask = tuple(isinstance(v, nnx.Param) for v in variables)
        self.key = ("pytree", treedef, tuple(type(v) for v in variables))
        self.params = [v for v, p in zip(variables, self._mask, strict=True) if p]
        self.others = [v for v, p in zip(variables, self._mask, strict=True) if not p]
        self.param_values = [x for x, p in zip(values, self._mask, strict=True) if p]
        self.values = [x for x, p in zip(values, self._mask, strict=True) if not p]

    def rebuild(self, params: list, others: list) -> tuple[Any, list]:
        """A copy with fresh Variables holding ``params`` and ``others`` (values in the
        order of :attr:`params` / :attr:`others`), and the copy's other Variables."""
        it_p = iter(zip(self.params, params, strict=True))
        it_o = iter(zip(self.others, others, strict=True))
        leaves, fresh = [], []
        for is_param in self._mask:
            var, value = next(it_p) if is_param else next(it_o)
            leaves.append(var.replace(value))
            if not is_param:
                fresh.append(leaves[-1])
        return jax.tree_util.tree_unflatten(self._treedef, leaves), fresh


def _agrees_with_split(holder: Any, flat: tuple | None = None) -> bool:
    """Whether ``holder``'s pytree flattening finds the Variables ``nnx.split`` finds:
    checked once per module and structure (``nnx.state`` costs ten flattenings), then
    remembered; a list of holders (a plain object's) is checked module by module.
    ``flat``: the holder's ``(Variables, treedef)`` where already flattened."""
    if isinstance(holder, nnx.Variable):
        return True
    variables, treedef = flat or jax.tree_util.tree_flatten(holder, is_leaf=_is_variable)
    try:
        if _VERIFIED.get(holder) == treedef:
            return True
    except TypeError:  # cannot be weakly referenced: checked every time
        pass
    graph = jax.tree.leaves(nnx.state(holder), is_leaf=_is_variable)
    if sorted(map(id, variables)) != sorted(id(v) for v in graph):
        return False
    try:
        _VERIFIED[holder] = treedef
    except TypeError:
        pass
    return True


def _per_item(holder: Any, variables: list, treedef: Any) -> list[tuple[Any, tuple]]:
    """``(item, (its Variables, its treedef))`` for each module of a list of holders
    (a plain object's), cut from the list's own flattening; ``[(holder, ...)]`` for one
    module."""
    if not isinstance(holder, list):
        return [(holder, (variables, treedef))]
    out, start = [], 0
    for item, sub in zip(holder, treedef.children(), strict=True):
        out.append((item, (variables[start:start + sub.num_leaves], sub)))
        start += sub.num_leaves
    return out


def _pytree_view(holder: Any) -> _PytreeView | None:
    """The pytree view of ``holder``, or None where it would differ from ``nnx.split``:
    a module that is no pytree (``pytree=False``), a leaf that is no Variable, or a
    Variable reached twice (a shared submodule: ``nnx.split`` keeps one)."""
    try:
        variables, treedef = jax.tree_util.tree_flatten(holder, is_leaf=_is_variable)
    except Exception:  # noqa: BLE001 - not flattenable here: nnx.split decides
        return None
    if not all(isinstance(v, nnx.Variable) for v in variables):
        return None
    values = jax.tree_util.tree_leaves(variables)
    ids = [id(v) for v in variables]
    if len(values) != len(variables) or len(set(ids)) != len(ids):
        return None  # a Variable holding a tree of arrays, or one reached twice
    if not all(_agrees_with_split(h, flat) for h, flat in _per_item(holder, variables, treedef)):
        return None
    return _PytreeView(variables, values, treedef)


class Tracked:
    """One parameter holder (module or Variable), split for differentiation.

    Attributes:
      holder: the original module or Variable (never modified during the call).
      variables: its parameter Variables, one per array in :meth:`values`.
      gdef, rest: a module's graph definition and its non-parameter state (None for a
        Variable); through a :class:`_PytreeView` (the default where it applies;
        ``graph=True``: always ``nnx.split``) the view's key and the list of the
        non-parameter Variables' values.
    """

    def __init__(self, holder: Any, rref: RRef | None = None, graph: bool = False):
        self.holder = holder
        self.rref = rref
        self.gdef = self.rest = None
        self._rest_vars: list = []
        self._view: _PytreeView | None = None
        if isinstance(holder, (nnx.Module, list)) and not graph:
            self._view = _pytree_view(holder)
        if self._view is not None:
            self.gdef, self._tdef = self._view.key, None
            self.variables = list(self._view.params)
            self._rest_vars = list(self._view.others)
            self._leaves, self.rest = list(self._view.param_values), list(self._view.values)
        elif isinstance(holder, (nnx.Module, list)):  # a list: _ObjectTracked's holders
            self.gdef, pstate, self.rest = nnx.split(holder, nnx.Param, ...)
            self._leaves, self._tdef = jax.tree_util.tree_flatten(pstate)
            if _split_shares_variables():
                self.variables = jax.tree.leaves(pstate, is_leaf=_is_variable)
                self._rest_vars = jax.tree.leaves(self.rest, is_leaf=_is_variable)
            elif isinstance(holder, list):  # pragma: no cover - other flax versions
                raise DistAutogradError(_PLAIN_UNSUPPORTED)
            else:  # pragma: no cover - other flax versions
                self.variables = param_variables(holder)
            if len(self._leaves) != len(self.variables):  # pragma: no cover - flax layout
                raise RuntimeError("nnx.split and nnx.variables disagree on parameters")
        elif isinstance(holder, nnx.Variable):
            self.variables, self._tdef = [holder], None
            self._leaves = [holder.get_value()]
        else:
            raise TypeError(f"Tracked holds an NNX module or Variable, got "
                            f"{type(holder).__name__}")
        self._copy: Any = None  # the last rebuilt copy (its state after the call)
        self._copy_rest: list = []  # that copy's non-parameter Variables
        self._graph_key: HashOnce | None = None

    def graph_key(self) -> HashOnce:
        """:attr:`gdef` for a cache key, its hash computed once (a GraphDef's hash
        walks the whole graph: tens of microseconds per call)."""
        if self._graph_key is None:
            self._graph_key = HashOnce(self.gdef)
        return self._graph_key

    @classmethod
    def of_module(cls, module: nnx.Module, rref: RRef | None = None) -> Tracked:
        """``Tracked(module, rref, graph=True)``, the split made once per module and
        structure: where ``nnx.split`` shares the module's own Variables, the split's
        states keep reading their current values, so later calls only check (by a
        pytree flattening, about a tenth of a split) that the module still holds the
        same Variables in the same structure, and read the parameter values."""
        if not _split_shares_variables():  # pragma: no cover - other flax versions
            return cls(module, rref, graph=True)
        try:
            variables, treedef = jax.tree_util.tree_flatten(module, is_leaf=_is_variable)
            ids = tuple(map(id, variables))
            known = _SPLITS.get(module)
        except Exception:  # noqa: BLE001 - not flattenable or not weakly referenceable
            return cls(module, rref, graph=True)
        if known is None or known[0] != treedef or known[1] != ids:
            known = (treedef, ids, cls(module, None, graph=True))
            with contextlib.suppress(TypeError):  # an unhashable graph: no key at all
                known[2].graph_key()  # shared by the copies below
            _SPLITS[module] = known
        out = copy.copy(known[2])
        out.rref = rref
        out._leaves = [v.get_value() for v in out.variables]
        return out

    def values(self) -> list:
        """The parameter arrays (the primal inputs of the differentiated function)."""
        return list(self._leaves)

    def rebuild(self, traced: Sequence[Any]) -> Any:
        """A copy of the holder (or of its RRef) whose parameters are ``traced``."""
        if self._view is not None:
            value, self._copy_rest = self._view.rebuild(list(traced), list(self.rest))
        elif self.gdef is not None:
            pstate = jax.tree_util.tree_unflatten(self._tdef, list(traced))
            rest = jax.tree.map(lambda x: x, self.rest)  # fresh Variables for the copy
            value = nnx.merge(self.gdef, pstate, rest)
            self._copy_rest = jax.tree.leaves(rest, is_leaf=_is_variable)
        else:
            value = type(self.holder)(traced[0])
        self._copy = value
        return value if self.rref is None else _TrackedRRef(self.rref, value)

    def state_after(self) -> Any:
        """The non-parameter state of the copy as the function left it (inside the
        trace: returned as auxiliary output, so it comes out concrete), or None."""
        if self.gdef is None or self._copy is None:
            return None
        if self._view is not None or self._rest_vars:
            return [v.get_value() for v in self._copy_rest]
        return nnx.split(self._copy, nnx.Param, ...)[2]

    def write_back(self, state: Any) -> None:
        """Put that state into the original module: RNG counters advance (dropout masks
        differ per step, as with a plain call) and batch statistics update, as in torch."""
        if state is None:
            return
        if isinstance(state, list):
            for var, value in zip(self._rest_vars, state, strict=True):
                write_variable(var, value)
        else:  # pragma: no cover - other flax versions
            nnx.update(self.holder, state)

    def accumulate(self, ctx: Any, grads: Sequence[Any]) -> None:
        """Add ``grads`` (one per Variable) to ``ctx``'s gradients."""
        for var, g in zip(self.variables, grads, strict=True):
            ctx.accumulate(var, g)

    # a compiled program takes the parameters and the non-parameter state as inputs
    def rest_state(self) -> Any:
        """The non-parameter state, an input of a compiled program (None: none)."""
        return self.rest

    def use_rest(self, rest: Any) -> None:
        """Rebuild from ``rest`` (inside a trace: the program's input) from now on."""
        if self.gdef is not None:
            self.rest = rest

    def signature(self, by_identity: bool = True) -> tuple:
        """What a compiled program depends on: the holder's structure and type, the
        shapes of its parameters and state and, ``by_identity``, its parameter
        Variables themselves (a program that closes over this holder). Raises
        TypeError when that is not hashable."""
        key = (self.gdef, self._tdef, type(self.holder),
               jax.tree_util.tree_structure(self.rest),
               tuple(aval(v) for v in jax.tree_util.tree_leaves(self.rest)),
               tuple(aval(v) for v in self._leaves),
               tuple(map(id, self.variables)) if by_identity else ())
        hash(key)
        return key


_DTYPE_NAMES: dict = {}  # dtype -> its name (str() of a dtype costs microseconds)


def aval(x: Any) -> tuple:
    """An array's shape and dtype name, a compiled program's key for it."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return tuple(np.shape(x)), type(x).__name__
    try:
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype)
    except TypeError:  # an unhashable dtype-like attribute
        name = str(dtype)
    return tuple(np.shape(x)), name


_MAX_DEPTH = 4  # plain objects inside plain objects, searched for modules
_MAX_NODES = 4096  # attributes and container items looked at per object
_PLAIN_UNSUPPORTED = ("a plain object holding NNX modules needs flax's shared-Variable "
                      "split (flax >= 0.12); make the object an nnx.Module")


def _is_plain(x: Any) -> bool:
    """A user object whose attributes may hold modules (not a module, Variable, RRef,
    array, class, function or module object)."""
    if isinstance(x, (nnx.Module, nnx.Variable, RRef, type, types.ModuleType,
                      types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                      jax.Array, np.ndarray, np.generic, numbers.Number, str, bytes)):
        return False
    return hasattr(x, "__dict__")


def _search(obj: Any, depth: int, budget: list, seen: set, holders: dict) -> Any:
    """Where the modules and Variables reachable from ``obj`` are (through attributes of
    plain objects and items of lists, tuples and dicts): a nested ``{step: node}`` dict
    (a step is ``("attr", name)`` or ``("item", key)``; a leaf node is the holder's
    index in ``holders``, ``id -> (index, holder)``), or None when there are none."""
    if isinstance(obj, (nnx.Module, nnx.Variable)):
        if id(obj) not in holders:
            holders[id(obj)] = (len(holders), obj)
        return holders[id(obj)][0]
    if depth > _MAX_DEPTH or id(obj) in seen:
        return None
    if isinstance(obj, (list, tuple)):
        items = [(("item", i), v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(("item", k), v) for k, v in obj.items()]
    elif _is_plain(obj):
        items = [(("attr", k), v) for k, v in vars(obj).items()]
    else:
        return None
    seen.add(id(obj))
    found = {}
    for step, value in items:
        budget[0] -= 1
        if budget[0] < 0:
            break
        node = _search(value, depth + 1, budget, seen, holders)
        if node is not None:
            found[step] = node
    return found or None


class _ObjectTracked:
    """A plain Python object (not an NNX module) holding NNX modules or Variables in
    its attributes, directly or in lists, tuples, dicts and further plain objects.

    torch finds such a model's parameters through its tensors. Here the holders found
    are split together (one ``nnx.split`` of their list, so modules shared between
    attributes stay shared), and for the call the object is copied shallowly along the
    paths to them, each holder replaced by its traced copy: the function sees the
    object as it is, with its parameters differentiated. The copies' state after the
    call goes back to the originals as for a module, and so do attributes the function
    rebinds on a copied object (``self.calls += 1``).
    """

    def __init__(self, holder: Any, tree: dict, holders: list, rref: RRef | None = None):
        self.holder = holder
        self.rref = rref
        self._tree = tree
        self._inner = Tracked(list(holders))
        self.variables = self._inner.variables
        self._copies: list[tuple[Any, Any, dict]] = []  # (original, copy, its dict then)
        self._rebound: list = []

    def values(self) -> list:
        return self._inner.values()

    def rebuild(self, traced: Sequence[Any]) -> Any:
        copies = self._inner.rebuild(traced)
        self._copies = []
        value = self._rebuild(self.holder, self._tree, copies)
        return value if self.rref is None else _TrackedRRef(self.rref, value)

    def _rebuild(self, obj: Any, node: Any, copies: list) -> Any:
        if isinstance(node, int):
            return copies[node]
        if isinstance(obj, tuple):
            items = list(obj)
            for (_, i), child in node.items():
                items[i] = self._rebuild(obj[i], child, copies)
            return type(obj)._make(items) if hasattr(type(obj), "_make") else \
                type(obj)(items)
        try:
            new = copy.copy(obj)
        except Exception as e:
            raise _copy_error(self.holder, obj, e) from e
        for (kind, key), child in node.items():
            if kind == "item":
                new[key] = self._rebuild(obj[key], child, copies)
            else:
                vars(new)[key] = self._rebuild(vars(obj)[key], child, copies)
        if _is_plain(obj):
            self._copies.append((obj, new, dict(vars(new))))
        return new

    def state_after(self) -> Any:
        """The holders' state, and the attributes rebound on the copied objects (checked
        here: a traced value cannot outlive the call)."""
        rebound = []
        for orig, new, before in self._copies:
            changed = {k: v for k, v in vars(new).items()
                       if k not in before or before[k] is not v}
            for k, v in changed.items():
                if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(v)):
                    raise DistAutogradError(
                        f"{type(orig).__name__}.{k} was set to a value computed from the "
                        "differentiated parameters or inputs during a distributed "
                        "autograd call, which cannot outlive the call: return it instead "
                        "(or keep np.asarray of it after dist_autograd.backward)")
            rebound.append((orig, changed))
        self._rebound = rebound
        return self._inner.state_after()

    def write_back(self, state: Any) -> None:
        self._inner.write_back(state)
        for orig, changed in self._rebound:
            vars(orig).update(changed)
        self._rebound = []

    def accumulate(self, ctx: Any, grads: Sequence[Any]) -> None:
        self._inner.accumulate(ctx, grads)

    def rest_state(self) -> Any:
        return self._inner.rest_state()

    def use_rest(self, rest: Any) -> None:
        self._inner.use_rest(rest)

    def signature(self, by_identity: bool = True) -> tuple:
        return ("object", repr(self._tree), self._inner.signature(by_identity))


def _copy_error(holder: Any, obj: Any, e: Exception) -> DistAutogradError:
    return DistAutogradError(
        f"a {type(holder).__name__} holding NNX modules was passed to a distributed "
        f"autograd call, and its {type(obj).__name__} could not be copied to differentiate "
        f"them ({type(e).__name__}: {e}); make {type(holder).__name__} an nnx.Module "
        "(then its modules are found as a module's are), or pass the modules themselves")


def track(value: Any, rref: RRef | None = None) -> Tracked | _ObjectTracked | None:
    """The tracker of one argument value (or an owned RRef's value), or None when it
    holds no parameters."""
    if isinstance(value, (nnx.Module, nnx.Variable)):
        return Tracked(value, rref=rref)
    if _is_plain(value):
        holders: dict = {}
        tree = _search(value, 0, [_MAX_NODES], set(), holders)
        if tree:
            return _ObjectTracked(value, tree, [h for _, h in holders.values()], rref=rref)
    return None


def find_params(leaves: list, me: int) -> list[tuple[int, Any]]:
    """``(position, tracker)`` for every parameter holder among flattened arguments:
    NNX modules and Variables, plain objects holding some (:class:`_ObjectTracked`),
    and those values in RRefs owned by ``me``.

    Args:
      leaves: from :func:`flatten_args`.
      me: the id of the worker running the function (only its own RRefs count).
    """
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, RRef):
            if leaf.owner().id != me:
                continue
            t = track(leaf.local_value(), rref=leaf)
        else:
            t = track(leaf)
        if t is not None:
            out.append((i, t))
    return out


def rebuild_args(leaves: list, tdef: Any, slots: list[int], params: list, xs: list,
                 pvals: list) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from flattened arguments with the arrays ``xs`` put back at
    leaf positions ``slots`` and a traced copy of each ``(position, tracker)`` holder
    in ``params`` (built from ``pvals``)."""
    new = list(leaves)
    for pos, x in zip(slots, xs, strict=True):
        new[pos] = x
    for (pos, tracked), pv in zip(params, pvals, strict=True):
        new[pos] = tracked.rebuild(pv)
    return jax.tree_util.tree_unflatten(tdef, new)
