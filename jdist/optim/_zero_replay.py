"""Run a transformation traced on the full parameter tree over one replica's shards.

ZeRO must give exactly the result of the unsharded optax transformation, whatever it
does with the parameter *tree* (masks given as pytrees or callables, ``multi_transform``
labels, per-leaf hyperparameters, global norms). So the wrapped transformation is never
shown a tree of shards: it is traced (abstractly, no memory) on the real tree, where its
masks, labels and callables see the real leaves, and that program is then *replayed*
on this replica's shards, one equation at a time:

- gradients, parameters and the rank >= 1 state leaves are *flat shards*: the
  row-major flattening of the full value, zero-padded to ``N * L`` elements
  (``L = ceil(numel / N)``), of which replica ``i`` holds ``[i*L, (i+1)*L)``; a value
  computed from replicated values only (step counts, learning rates, constants, a
  ``zeros_like``) stays replicated and any operation runs on it as it is;
- element-wise operations on shards run on the shards (operands of one shape share one
  split; a replicated operand is sliced to this replica's piece); reshapes keep the
  row-major order, so they are free;
- reductions over a *whole* value (a leaf's norm, ``clip_by_global_norm``'s global
  norm, LAMB's and LARS's trust ratios, ``normalize_by_update_norm``) reduce the shard
  with the padding masked and finish with a collective (``psum``/``pmax``/``pmin``),
  as does a dot product over all axes;
- control flow (``jit``, custom derivatives, ``cond`` on a scalar) is replayed inside.

Anything else that touches a rank >= 1 value (a reduction over some axes only, as
Adafactor's factored second moments; a matrix product; a transpose, slice or gather;
random numbers of a parameter's shape, as ``add_noise``) mixes elements across the
split: :class:`NonSeparableTransformError` names the operation and the fix, so the
sharded optimizer is exact or refuses, never silently different.

The element-wise set below is a list of JAX primitives (not of optax transformations):
JAX does not mark its primitives element-wise, and a primitive missing from the list
raises the named error, it is never run on shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

__all__ = ["NonSeparableTransformError", "ShardReplayer"]


class NonSeparableTransformError(ValueError):
    """The wrapped transformation mixes elements of a parameter in a way ZeRO cannot split.

    Cause: an operation over part of a leaf (e.g. Adafactor's factored moments, a matrix
    product, a transpose, per-leaf random noise) in the transformation's update or init.
    Fix: use it without ZeRO (``nnx.Optimizer(model, tx)`` with DDP), or a
    configuration that is element-wise or uses whole-leaf norms only (e.g.
    ``optax.adafactor(..., factored=False)``).
    """


_ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp
complex conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp
exp2 expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p
logistic lt max min mul ne neg nextafter not or polygamma population_count pow real
reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
shift_right_logical sign sin sinh sqrt square sub tan tanh xor zeta
""".split())

_SAME_ORDER = frozenset({"reshape", "squeeze", "broadcast_in_dim"})
_REDUCE = {"reduce_sum": (lax.psum, jnp.sum), "reduce_max": (lax.pmax, jnp.max),
           "reduce_min": (lax.pmin, jnp.min), "reduce_and": (lax.pmin, jnp.all),
           "reduce_or": (lax.pmax, jnp.any), "reduce_prod": (None, jnp.prod)}
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _varying(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", ()) or ())


def _bind(prim, vals, params):
    """``prim.bind`` with the operands made varying over the same manual axes (under
    ``check_vma`` a shard varies over the axis, a psum result does not)."""
    vmas = [_varying(x) for x in vals]
    axes = frozenset().union(*vmas)
    vals = [lax.pcast(x, tuple(axes - v), to="varying") if axes - v else x
            for x, v in zip(vals, vmas, strict=True)]
    out = prim.bind(*vals, **params)
    return list(out) if prim.multiple_results else out


class _V(NamedTuple):
    """A value during replay: a flat shard (``sharded``) or the full replicated value."""

    x: Any
    sharded: bool


def _numel(aval) -> int:
    return math.prod(aval.shape)


def _identity(name: str, dtype) -> jax.Array:
    """The value a padding element takes so that it does not change the reduction."""
    dtype = jnp.dtype(dtype)
    if name in ("reduce_sum", "reduce_or"):
        return jnp.zeros((), dtype)
    if name in ("reduce_prod", "reduce_and"):
        return jnp.ones((), dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(name == "reduce_min")
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-jnp.inf if name == "reduce_max" else jnp.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if name == "reduce_max" else info.max, dtype)


class ShardReplayer:
    """Replays a closed jaxpr traced on full values over this replica's flat shards.

    Args:
      axis: the mesh axis the shards are split over (bound: inside ``shard_map``).
      n: the number of replicas on it.
      what: the transformation's description, for error messages.
    """

    def __init__(self, axis, n: int, what: str):
        self.axis, self.n, self.what = axis, n, what
        self.index = lax.axis_index(axis)

    # ---- the flat-shard representation --------------------------------------------
    def length(self, shape: Sequence[int]) -> int:
        """``L``: elements per replica of a full value of ``shape`` (at least 1)."""
        return max(1, -(-math.prod(shape) // self.n))

    def valid(self, shape) -> jax.Array:
        """Which of this replica's ``L`` positions hold data (the rest is padding)."""
        length = self.length(shape)
        return self.index * length + jnp.arange(length) < math.prod(shape)

    def shard(self, x) -> jax.Array:
        """This replica's flat shard of a full (replicated) value; rank 0 stays."""
        x = jnp.asarray(x)
        if x.ndim == 0:
            return x
        length = self.length(x.shape)
        flat = jnp.pad(x.reshape(-1), (0, length * self.n - x.size))
        return lax.dynamic_slice_in_dim(flat, self.index * length, length)

    def zero_padding(self, x, shape) -> jax.Array:
        """``x`` (a shard of a ``shape`` value) with its padding set to zero."""
        if len(shape) == 0 or not jnp.issubdtype(x.dtype, jnp.number):
            return x
        return jnp.where(self.valid(shape), x, jnp.zeros((), x.dtype))

    # ---- replay -------------------------------------------------------------------
    def run(self, closed, args: Sequence, sharded: Sequence[bool]) -> list:
        """``closed``'s outputs on ``args``: ``(value, is_shard)`` pairs.

        ``args[i]`` is a flat shard where ``sharded[i]``, else the full (replicated)
        value. A value computed from replicated values only stays replicated (any
        operation runs on it as is); one computed from a shard is a shard.
        """
        return self._eval(closed.jaxpr, [_V(c, False) for c in closed.consts],
                          [_V(x, bool(s)) for x, s in zip(args, sharded, strict=True)])

    def _eval(self, jaxpr, consts, args) -> list:
        env = {}

        def read(v):
            return _V(v.val, False) if isinstance(v, jcore.Literal) else env[v]

        for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args),
                        strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            outs = self._eqn(eqn, [read(v) for v in eqn.invars])
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn, vals) -> list:
        if not any(v.sharded for v in vals):  # replicated values: run as they are
            out = _bind(eqn.primitive, [v.x for v in vals], eqn.params)
            return [_V(o, False) for o in (out if eqn.primitive.multiple_results else [out])]
        handler = self._handler(eqn)
        if handler is None:
            self._refuse(eqn, f"the operation {eqn.primitive.name!r} on a value of shape "
                              f"{self._first_shape(eqn)}")
        out = handler(eqn, vals)
        return list(out) if isinstance(out, list) else [out]

    def _handler(self, eqn) -> Callable | None:
        name = eqn.primitive.name
        if name in _ELEMENTWISE:
            return self._elementwise
        if name in _SAME_ORDER:
            return self._same_order
        if name in _REDUCE:
            return self._reduce
        if name == "dot_general":
            return self._dot
        if name == "cond":
            return self._cond
        if any(k in eqn.params for k in _CALL_PARAMS):
            return self._call
        return None

    def _refuse(self, eqn, what: str):
        raise NonSeparableTransformError(
            f"ZeroRedundancyOptimizer cannot shard {self.what}: its program applies "
            f"{what}, which mixes elements across the shards of a parameter (found at "
            f"{eqn.source_info.name_stack or 'top level'}: {eqn.primitive.name}); running "
            "it on shards would silently differ from the unsharded optimizer. Use this "
            "transformation without ZeRO (e.g. nnx.Optimizer(model, tx) with DDP), or an "
            "element-wise configuration of it (e.g. optax.adafactor(..., factored=False))")

    @staticmethod
    def _first_shape(eqn):
        return next((tuple(v.aval.shape) for v in eqn.invars if getattr(v.aval, "ndim", 0)),
                    tuple(eqn.outvars[0].aval.shape))

    def local(self, v: _V) -> jax.Array:
        """The shard of ``v`` (sliced here if ``v`` is replicated; rank 0 stays)."""
        return v.x if v.sharded else self.shard(v.x)

    # ---- handlers (at least one operand is a shard) ---------------------------------
    def _elementwise(self, eqn, vals):
        out_shape = tuple(eqn.outvars[0].aval.shape)
        # lax broadcasts size-1 operands: such an operand is one number for every element
        vals = [self._one(v) if 0 < v_.aval.ndim and math.prod(v_.aval.shape) == 1
                and tuple(v_.aval.shape) != out_shape else v
                for v, v_ in zip(vals, eqn.invars, strict=True)]
        shapes = {tuple(np.shape(v.x)) if not v.sharded else tuple(v_.aval.shape)
                  for v, v_ in zip(vals, eqn.invars, strict=True) if np.ndim(v.x)}
        shapes |= {tuple(v.aval.shape) for v in eqn.outvars if v.aval.ndim}
        if len(shapes) != 1:
            self._refuse(eqn, f"{eqn.primitive.name!r} on shapes {sorted(shapes)}")
        length = self.length(shapes.pop())
        xs = [jnp.broadcast_to(v.x, (length,)) if jnp.ndim(v.x) == 0 else self.local(v)
              for v in vals]
        out = _bind(eqn.primitive, xs, eqn.params)
        return [_V(o, True) for o in out] if eqn.primitive.multiple_results else _V(out, True)

    def _one(self, v: _V) -> _V:
        """The single element of a size-1 value, replicated (a shard's is on replica 0)."""
        if v.sharded:
            return _V(lax.all_gather(v.x[0], self.axis)[0], False)
        return _V(jnp.reshape(v.x, ()), False)

    def _same_order(self, eqn, vals):
        """Reshape / squeeze / size-preserving broadcast of a shard: row-major order
        (and so the split) is kept."""
        src, dst = eqn.invars[0].aval, eqn.outvars[0].aval
        if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") not in (
                None, tuple(range(src.ndim))):
            self._refuse(eqn, "a transposing reshape")
        if _numel(src) != _numel(dst):
            self._refuse(eqn, f"{eqn.primitive.name!r} from shape {src.shape} to {dst.shape}")
        if dst.ndim == 0:  # the single element lives on replica 0
            return _V(lax.all_gather(vals[0].x[0], self.axis)[0], False)
        return _V(vals[0].x, True)

    def _reduce(self, eqn, vals):
        src = eqn.invars[0].aval
        axes = tuple(sorted(eqn.params["axes"]))
        if axes != tuple(range(src.ndim)):
            self._refuse(eqn, f"{eqn.primitive.name!r} over axes {axes} of shape {src.shape} "
                              "(a reduction over part of a leaf)")
        name = eqn.primitive.name
        collective, local = _REDUCE[name]
        x = jnp.where(self.valid(src.shape), vals[0].x, _identity(name, vals[0].x.dtype))
        part = local(x).astype(eqn.outvars[0].aval.dtype)
        if collective is None:
            return _V(jnp.prod(lax.all_gather(part, self.axis)).astype(part.dtype), False)
        if part.dtype == bool:
            return _V(collective(part.astype(jnp.int32), self.axis).astype(bool), False)
        return _V(collective(part, self.axis), False)

    def _dot(self, eqn, vals):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        a, b = (v.aval for v in eqn.invars)
        full = tuple(range(a.ndim))
        if lb or rb or a.shape != b.shape or tuple(lc) != full or tuple(rc) != full:
            self._refuse(eqn, f"a matrix product of shapes {a.shape} and {b.shape}")
        x = jnp.where(self.valid(a.shape), self.local(vals[0]), jnp.zeros((), a.dtype))
        part = lax.dot_general(x, self.local(vals[1]), (((0,), (0,)), ((), ())),
                               precision=eqn.params.get("precision"),
                               preferred_element_type=eqn.params.get("preferred_element_type"))
        return _V(lax.psum(part, self.axis), False)

    def _call(self, eqn, vals):
        inner = next(eqn.params[k] for k in _CALL_PARAMS if k in eqn.params)
        if isinstance(inner, jcore.ClosedJaxpr):
            return self._eval(inner.jaxpr, [_V(c, False) for c in inner.consts], vals)
        return self._eval(inner, [], vals)

    def _cond(self, eqn, vals):
        """Each branch replayed; rank >= 1 results made shards in all of them, so the
        branches agree on their result types."""
        index, ops = vals[0], vals[1:]
        if index.sharded:
            self._refuse(eqn, "a condition on a non-scalar predicate")
        tags = [v.sharded for v in ops]

        def branch(closed, *xs):
            outs = self._eval(closed.jaxpr, [_V(c, False) for c in closed.consts],
                              [_V(x, t) for x, t in zip(xs, tags, strict=True)])
            return tuple(self.local(o) for o in outs)

        outs = lax.switch(index.x, [lambda *xs, c=c: branch(c, *xs)
                                    for c in eqn.params["branches"]], *[v.x for v in ops])
        return [_V(o, jnp.ndim(o) > 0) for o in outs]
