"""The reducer: bucket identities whose backward rules run the comm hook.

Inside the DDP ``shard_map`` program, :func:`reduced_value_and_grad` differentiates the
loss with each bucket's parameters wrapped (by :mod:`jdist.ddp._graph`) in an identity
``jax.custom_vjp`` placed before the bucket's first use. When the backward pass reaches
it, the rule

1. takes the bucket's cotangents (symbolic zeros of unused parameters become zeros, or
   raise :class:`~jdist.errors.UnusedParametersError`) and adds locally accumulated
   gradients from ``no_sync`` steps;
2. without a comm hook and flat buffers (the default on one process), reduces them with
   one mean all-reduce: a ``pmean`` of all the bucket's gradients, lowered per gradient
   and merged into one all-reduce per bucket by XLA's all-reduce combiner, with no copy
   (see :mod:`jdist.ddp._xla`; every bucket's gradients are made to depend on the
   previous bucket's reduced values so that the combiner never merges two buckets);
3. with a comm hook or flat buffers (``flat_buckets``; the default across processes on
   CPU), flattens them into one buffer, calls ``hook(state, GradBucket) -> (buffer,
   new_state)``, threading the hook state from bucket to bucket, and unflattens the
   reduced buffer.

With ``mean_loss`` the step's loss is averaged over replicas too. On the flat path of the
default hook it rides in the last bucket's all-reduce (one more element of its buffer),
so a step makes one collective per bucket and none for the loss: that bucket is the last
to fire, so its reduction waits for the end of the backward pass anyway, and is made
right after it together with the loss (:class:`ReduceRecord` ``.pending``). Across
processes each collective is a round trip between them, which for a small model is most
of the step. Elementwise the result is the same ``pmean``.

Parameters are made *varying* (``lax.pcast(..., to='varying')``) before differentiating:
with ``check_vma=True`` the gradient of a replicated input is otherwise already summed
over replicas by the transpose of the implicit broadcast. The reduced, replicated
(invariant) buffers are kept by the rule in a per-trace :class:`ReduceRecord` and become
the step's gradients, so the step's outputs stay replicated without a second collective.

:func:`record_ready_order` runs the same differentiation with one identity per parameter
whose rules only record the order they run in: the gradient-ready order that buckets are
rebuilt from (JAX knows it at trace time, so no step runs with a temporary layout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jdist.ddp import _graph
from jdist.ddp._buckets import BucketLayout
from jdist.ddp.hooks._base import GradBucket
from jdist.errors import BucketLayoutError, UnusedParametersError

__all__ = [
    "mean_allreduce_hook",
    "to_varying",
    "is_varying",
    "ReduceRecord",
    "reduced_value_and_grad",
    "local_value_and_grad",
    "record_ready_order",
    "unused_message",
]


MAX_COMBINED = 255
"""Most gradients a bucket may have to be reduced without a flat copy: XLA's all-reduce
combiner merges at most 256 arrays into one all-reduce (one is left for the loss mean,
which it may merge into a bucket's); a bucket with more parameters is copied into one
flat buffer, so that it still is one all-reduce."""


def mean_allreduce_hook(state: Any, bucket: GradBucket) -> tuple[jax.Array, Any]:
    """The default reduction: mean over the replica axis (torch: divide, SUM all-reduce)."""
    return jax.lax.pmean(bucket.buffer, bucket.axis_name), state


def is_varying(x: Any, axis: Any) -> bool:
    """Whether ``x`` is typed as differing across ``axis`` inside ``shard_map``."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: manual-axis type
    if mat is not None:
        return axis in mat.varying
    return axis in getattr(aval, "vma", frozenset())


def to_varying(x: Any, axis: Any) -> Any:
    """``lax.pcast(x, axis, to='varying')`` for the leaves that are not varying yet."""

    def one(leaf):
        if leaf is None or is_varying(leaf, axis):
            return leaf
        return jax.lax.pcast(leaf, axis, to="varying")

    return jax.tree.map(one, x)


def unused_message(paths: Sequence[str]) -> str:
    """The :class:`UnusedParametersError` text naming ``paths`` and the fix."""
    shown = ", ".join(repr(p) for p in paths[:20])
    more = f" and {len(paths) - 20} more" if len(paths) > 20 else ""
    return (
        f"DDP found {len(paths)} parameter(s) that received no gradient in the loss: "
        f"[{shown}{more}]. Either pass find_unused_parameters=True to "
        "DistributedDataParallel (their gradients are then reduced as zeros), or make "
        "every parameter take part in computing the loss (check that every output of "
        "the forward pass is used and that no parameter goes through stop_gradient). "
        "torch reports this only at the next iteration as 'Expected to have finished "
        "reduction in the prior iteration'."
    )


class ReduceRecord:
    """What the bucket rules of one trace produced (Python-side, trace time only).

    Attributes:
      state: the hook state, threaded from one bucket's rule to the next.
      reduced: bucket index -> reduced gradients of its parameters (replicated).
      fired: bucket indices in the order their rules ran.
      unused: paths of parameters whose cotangent was a symbolic zero.
      unused_idx: their leaf indices.
      pending: ``(bucket index, gradients)`` of the last bucket to fire when its
        reduction waits to carry the loss mean (``mean_loss``), else ``None``.
    """

    def __init__(self, state: Any):
        self.state = state
        self.reduced: dict[int, jax.Array] = {}
        self.fired: list[int] = []
        self.unused: list[str] = []
        self.unused_idx: list[int] = []
        self.pending: tuple[int, list[jax.Array]] | None = None


def _flat(cts: Sequence[jax.Array], dtype) -> jax.Array:
    """The bucket buffer: the raveled gradients, one after the other.

    Written as in-place ``dynamic_update_slice`` writes into one buffer rather than a
    ``concatenate``: XLA's CPU backend emits the concatenation as a partitioned loop fusion
    that was slower per step (two replicas' copies competing for the same cores), while
    each update is a plain copy of one gradient into place (``benchmarks/ddp.py``).
    """
    n = sum(int(c.size) for c in cts)
    buf = jnp.zeros((n,), dtype)
    pos = 0
    for c in cts:
        buf = jax.lax.dynamic_update_slice(buf, jnp.ravel(c).astype(dtype), (pos,))
        pos += int(c.size)
    return buf


def _after(grads: Sequence[jax.Array], prev: Sequence[jax.Array]) -> list[jax.Array]:
    """``grads`` (same values) made to depend on the previous bucket's reduced ``prev``.

    The first element of each gradient is multiplied by a factor that is always exactly 1
    but computed from one element of every ``prev`` array (``1 - (s > inf)``, which is
    also 1 for NaN), as an in-place one-element update. Every all-reduce of this bucket is
    then reachable from every all-reduce of the previous one: XLA's all-reduce combiner,
    which merges all-reduces that do not depend on each other, merges a bucket's
    gradients into one all-reduce but never two buckets, and the buckets are reduced in
    gradient-ready order.
    """
    firsts = [jnp.ravel(p)[0].astype(jnp.float32) for p in prev if p.size]
    if not firsts:  # only empty parameters before: nothing to depend on
        return list(grads)
    one = 1.0 - (sum(firsts) > jnp.inf).astype(jnp.float32)  # == 1.0, not foldable by XLA
    out = []
    for g in grads:
        f = one.astype(g.dtype)
        if not g.size:
            out.append(g)
        elif g.ndim == 0:
            out.append(g * f)
        else:
            at = (0,) * g.ndim
            first = jax.lax.dynamic_slice(g, at, (1,) * g.ndim)
            out.append(jax.lax.dynamic_update_slice(g, first * f, at))
    return out


def _split(buf: jax.Array, like: Sequence[Any]) -> list[jax.Array]:
    out, pos = [], 0
    for x in like:
        n = int(x.size)
        out.append(jnp.reshape(buf[pos:pos + n], x.shape).astype(x.dtype))
        pos += n
    return out


def _carries_loss(rec: ReduceRecord, hook: Callable, layout: BucketLayout, bi: int,
                  loss_dtype: Any, scale: Any, post: Any, flat: bool) -> bool:
    """Whether bucket ``bi``'s reduction waits to carry the loss mean: the default hook
    on a flat buffer of the loss's dtype, outside ``join()``, and every other bucket
    already fired (``bi`` is the last one the backward pass reaches)."""
    return (loss_dtype is not None and flat and hook is mean_allreduce_hook
            and scale is None and post is None
            and jnp.dtype(layout.buckets[bi].dtype) == jnp.dtype(loss_dtype)
            and len(set(rec.fired)) == len(layout.buckets) - 1 and bi not in rec.fired)


def _reduce_with_loss(rec: ReduceRecord, layout: BucketLayout, bi: int,
                      grads: Sequence[jax.Array], value: jax.Array, axis: Any) -> jax.Array:
    """Reduce bucket ``bi`` with the loss as one more element of its flat buffer (one
    mean all-reduce for both); records the gradients, returns the replicas' mean loss."""
    if rec.fired:
        grads = _after(grads, rec.reduced[rec.fired[-1]])
    out = jax.lax.pmean(_flat([*grads, value], jnp.dtype(layout.buckets[bi].dtype)), axis)
    rec.reduced[bi] = _split(out, grads)
    rec.fired.append(bi)
    return out[-1].astype(value.dtype)


def _run_hook(rec: ReduceRecord, hook: Callable, layout: BucketLayout, bi: int,
              grads: Sequence[jax.Array], axis: Any, num_replicas: int,
              scale: Any = None, post: Any = None, flat: bool = True) -> list[jax.Array]:
    """Reduce one bucket; returns the reduced gradients, one array per parameter."""
    bucket = layout.buckets[bi]
    if scale is not None:  # join(): replicas out of inputs contribute zeros
        grads = [g * scale.astype(g.dtype) for g in grads]
    if rec.fired:  # reduce after the previous bucket (keeps XLA from merging buckets)
        grads = _after(grads, rec.reduced[rec.fired[-1]])
    if not flat and hook is mean_allreduce_hook and len(grads) <= MAX_COMBINED:
        # no flat copy: a pmean of the bucket's gradients, which XLA lowers to one
        # all-reduce per gradient and its combiner merges into one per bucket
        outs = list(jax.lax.pmean(tuple(grads), axis))
        if post is not None:
            outs = [o * post.astype(o.dtype) for o in outs]
        rec.reduced[bi] = outs
        rec.fired.append(bi)
        return outs
    buf = _flat(grads, jnp.dtype(bucket.dtype))
    gb = GradBucket(
        index=bi, buffer=buf, gradients=tuple(grads), parameters=bucket.paths,
        is_last=bi == len(layout.buckets) - 1, axis_name=axis, num_replicas=num_replicas,
    )
    out, rec.state = hook(rec.state, gb)
    if getattr(out, "shape", None) != buf.shape or getattr(out, "dtype", None) != buf.dtype:
        raise BucketLayoutError(
            f"comm hook {getattr(hook, '__name__', hook)!r} returned "
            f"{getattr(out, 'shape', type(out))} {getattr(out, 'dtype', '')} for bucket {bi}, "
            f"expected the bucket buffer's shape {buf.shape} and dtype {buf.dtype}"
        )
    if is_varying(out, axis):
        raise BucketLayoutError(
            f"comm hook {getattr(hook, '__name__', hook)!r} returned a buffer for bucket {bi} "
            f"that differs across replicas (it is varying over axis {axis!r}); DDP keeps one "
            f"replicated copy of the parameters, so the hook must reduce over "
            f"bucket.axis_name (e.g. jax.lax.pmean(bucket.buffer, bucket.axis_name))"
        )
    if post is not None:
        out = out * post.astype(out.dtype)
    outs = _split(out, grads)
    rec.reduced[bi] = outs
    rec.fired.append(bi)
    return outs


def _bucket_identity(rec: ReduceRecord, hook: Callable, layout: BucketLayout, bi: int,
                     acc: Sequence[Any] | None, axis: Any, num_replicas: int,
                     find_unused: bool, scale: Any, post: Any, flat: bool,
                     loss_dtype: Any = None) -> Callable:
    bucket = layout.buckets[bi]

    def bwd(_, cts):
        grads, missing = [], []
        for j, ct in zip(bucket.leaves, cts, strict=False):
            info = layout.leaves[j]
            if isinstance(ct, SymbolicZero):
                missing.append(info.path)
                rec.unused_idx.append(j)
                ct = jnp.zeros(info.shape, info.dtype)
            grads.append(ct if acc is None else ct + acc[j])
        if missing:
            rec.unused.extend(missing)
            if not find_unused:
                raise UnusedParametersError(unused_message(missing))
        if _carries_loss(rec, hook, layout, bi, loss_dtype, scale, post, flat):
            # reduced with the loss once the backward pass is done; these cotangents
            # reach no output (the step's gradients are the reduced ones in ``rec``)
            rec.pending = (bi, grads)
            return (to_varying(grads, axis),)
        out = _run_hook(rec, hook, layout, bi, grads, axis, num_replicas, scale, post, flat)
        return (to_varying(out, axis),)

    return _identity_with(bwd)


def _identity_with(bwd: Callable) -> Callable:
    """The identity on a list of arrays, with the backward rule ``bwd(None, cts)``, which
    sees symbolic zeros: the cotangents of the arrays the loss does not reach."""

    @jax.custom_vjp
    def ident(xs):
        return xs

    def fwd(xs):
        return [x.value for x in xs], None

    ident.defvjp(fwd, bwd, symbolic_zeros=True)
    return ident


def _wrapper(traced: _graph.Traced, groups: Sequence[Sequence[int]],
             make_ident: Callable[[int], Callable]) -> Callable[[int, dict], None]:
    """``before(k, env)`` that wraps group ``g``'s parameters before its first use."""
    uses = _graph.first_uses(traced)
    invars = traced.closed.jaxpr.invars
    at: dict[int, list[int]] = {}
    for gi, g in enumerate(groups):
        used = [uses[j] for j in g if uses[j] is not None]
        if used:
            at.setdefault(min(used), []).append(gi)

    def before(k, env):
        for gi in at.get(k, ()):
            vs = [invars[j] for j in groups[gi]]
            outs = make_ident(gi)([env[v] for v in vs])
            for v, o in zip(vs, outs, strict=False):
                env[v] = o

    return before


def reduced_value_and_grad(
    loss: Callable, params: Any, args: tuple, *, layout: BucketLayout, hook: Callable,
    hook_state: Any, acc: Any, axis: Any, num_replicas: int, find_unused: bool,
    scale: Any = None, post: Any = None, flat: bool = True, mean_loss: bool = False,
    unused_out: list | None = None,
) -> tuple[Any, Any, Any]:
    """Differentiate ``loss(params, *args) -> (scalar, aux)`` with bucketed reduction.

    Must run inside ``shard_map`` over ``axis`` (``check_vma=True``), with ``params``
    replicated. ``acc`` (same tree as ``params``, per replica) is added to each bucket's
    gradients before the hook, or ``None``. ``scale`` (a per-replica scalar) multiplies
    the gradients before the hook and ``post`` (replicated) the reduced buffer after it;
    ``join()`` uses them to zero the contribution of replicas that ran out of inputs.
    ``mean_loss``: return the replicas' mean loss (in the last bucket's all-reduce where
    it can ride there, see the module docstring) instead of this replica's.
    ``unused_out``: a list that gets the indices of the parameters without a gradient
    (symbolic zeros; trace time).

    Returns:
      ``((loss, aux), grads, new_hook_state)``: the loss (local, or the mean with
      ``mean_loss``) and local aux, the reduced (replicated) gradients, and the hook
      state after every bucket.
    """
    leaves, tdef = jax.tree.flatten(params)
    if len(leaves) != len(layout.leaves):
        raise BucketLayoutError(
            f"the model has {len(leaves)} parameters but the bucket layout was built for "
            f"{len(layout.leaves)}; the parameter tree changed after wrapping in DDP"
        )
    acc_leaves = None if acc is None else jax.tree.leaves(acc)
    varying = to_varying(leaves, axis)
    traced = _graph.trace(lambda ls, *a: loss(jax.tree.unflatten(tdef, ls), *a), varying, *args)
    rec = ReduceRecord(hook_state)
    groups = [b.leaves for b in layout.buckets]
    loss_dtype = _scalar_dtype(traced) if mean_loss else None
    before = _wrapper(traced, groups, lambda bi: _bucket_identity(
        rec, hook, layout, bi, acc_leaves, axis, num_replicas, find_unused, scale, post,
        flat, loss_dtype))
    flat_args = list(varying) + jax.tree.leaves(args)

    def scalar_loss(ls):
        out, aux = _graph.evaluate(traced, list(ls) + flat_args[len(ls):], before)
        return out, aux

    (value, aux), _ = jax.value_and_grad(scalar_loss, has_aux=True)(varying)
    if rec.pending is not None:
        bi, grads = rec.pending
        rec.pending = None
        value = _reduce_with_loss(rec, layout, bi, grads, value, axis)
    elif mean_loss:
        value = jax.lax.pmean(value, axis)
    fired = set(rec.fired)
    for bi, b in enumerate(layout.buckets):
        if bi in fired:
            continue
        # no parameter of this bucket reached the loss: reduce zeros (+ accumulated)
        paths = list(b.paths)
        if not find_unused:
            raise UnusedParametersError(unused_message(paths))
        rec.unused.extend(paths)
        rec.unused_idx.extend(b.leaves)
        zeros = [jnp.zeros(layout.leaves[j].shape, layout.leaves[j].dtype) for j in b.leaves]
        if acc_leaves is not None:
            zeros = [z + acc_leaves[j] for z, j in zip(zeros, b.leaves, strict=False)]
        _run_hook(rec, hook, layout, bi, zeros, axis, num_replicas, scale, post, flat)
    if unused_out is not None:
        unused_out.extend(sorted(set(rec.unused_idx)))
    out_leaves: list[Any] = [None] * len(leaves)
    for bi, b in enumerate(layout.buckets):
        for j, g in zip(b.leaves, rec.reduced[bi], strict=True):
            out_leaves[j] = g
    return (value, aux), jax.tree.unflatten(tdef, out_leaves), rec.state


def local_value_and_grad(loss: Callable, params: Any, axis: Any,
                         unused_out: list) -> tuple[Any, Any]:
    """``jax.value_and_grad(loss, has_aux=True)(params)`` of one replica (``no_sync``),
    appending to ``unused_out`` (trace time) the indices of the parameters whose
    gradient is a symbolic zero: the loss does not reach them."""
    leaves, tdef = jax.tree.flatten(params)
    seen: dict = {}

    def bwd(_, cts):
        seen["zero"] = [j for j, ct in enumerate(cts) if isinstance(ct, SymbolicZero)]
        return (to_varying([jnp.zeros(x.shape, x.dtype) if isinstance(ct, SymbolicZero)
                            else ct for x, ct in zip(leaves, cts, strict=True)], axis),)

    ident = _identity_with(bwd)
    out, grads = jax.value_and_grad(
        lambda ls: loss(jax.tree.unflatten(tdef, ident(ls))), has_aux=True)(leaves)
    # no backward rule ran: no parameter reaches the loss
    unused_out.extend(seen.get("zero", range(len(leaves))))
    return out, jax.tree.unflatten(tdef, grads)


def _scalar_dtype(traced: _graph.Traced) -> Any:
    """The dtype of the traced loss when it is a scalar (else ``None``: no fusion)."""
    aval = traced.closed.out_avals[0]
    return aval.dtype if getattr(aval, "shape", None) == () else None


def record_ready_order(loss: Callable, params: Any, args: tuple, axis: Any) -> tuple[
        list[int], list[int]]:
    """Trace the backward pass once; return ``(ready_order, unused)`` parameter indices.

    ``ready_order`` lists parameter indices in the order their gradients become complete
    (the order of the per-parameter identities' backward rules); parameters whose
    gradient is a symbolic zero (or that the loss never reads) are in ``unused``.
    Tracing only: call it under ``jax.eval_shape`` inside the ``shard_map``.
    """
    leaves, tdef = jax.tree.flatten(params)
    varying = to_varying(leaves, axis)
    traced = _graph.trace(lambda ls, *a: loss(jax.tree.unflatten(tdef, ls), *a), varying, *args)
    order: list[int] = []
    zero: set[int] = set()

    def make_ident(j):
        @jax.custom_vjp
        def ident(xs):
            return xs

        def fwd(xs):
            return [x.value for x in xs], None

        def bwd(_, cts):
            if isinstance(cts[0], SymbolicZero):
                zero.add(j)
                return ([None],)
            order.append(j)
            return (list(cts),)

        ident.defvjp(fwd, bwd, symbolic_zeros=True)
        return ident

    before = _wrapper(traced, [[j] for j in range(len(leaves))], make_ident)
    flat_args = list(varying) + jax.tree.leaves(args)

    def scalar_loss(ls):
        return _graph.evaluate(traced, list(ls) + flat_args[len(ls):], before)

    jax.value_and_grad(scalar_loss, has_aux=True)(varying)
    unused = [j for j in range(len(leaves)) if j not in set(order)]
    return order, unused
