"""Horovod's ``DistributedOptimizer`` as an optax transformation (usable in ``shard_map``).

**Not torch's ``DistributedOptimizer``.** Two different things share that name:

- :func:`AllReduceOptimizer` (this module; also importable as
  ``jdist.optim.DistributedOptimizer``, Horovod's name) wraps an optax transformation so
  that ``update`` first averages the gradients over the replicas of a mesh axis
  (all-reduce), inside ``jax.shard_map``; it is data parallelism without DDP.
- :class:`jdist.rpc.DistributedOptimizer` is torch's
  ``torch.distributed.optim.DistributedOptimizer``: it steps parameters held in RRefs
  on their owners with the gradients of a distributed-autograd context
  (``step(context_id)``); nothing is all-reduced.

``AllReduceOptimizer(tx)`` averages the gradients across the replicas of ``group``
and then runs ``tx``. The average is fused per dtype (after compression) by
:func:`jdist.collectives.all_reduce_flat`, which picks the form the backend runs fastest
(Horovod's tensor fusion, done in the compiled program; no background negotiation, since
the program is static):

- CPU across processes (gloo runs a multi-operand all-reduce as one collective per
  operand): each dtype's gradients are copied into one flat buffer and reduced by one
  all-reduce, as DDP's ``flat_buckets`` are;
- elsewhere (one process, GPU): one ``psum`` over all leaves of a dtype, which XLA's
  all-reduce combiner compiles into one variadic all-reduce with no copy (on GPU in
  chunks of ``xla_gpu_all_reduce_combine_threshold_bytes``).

``flat=True``/``False`` forces either form; the results are the same bits.

Semantics follow Horovod's torch frontend:

- ``backward_passes_per_step=k``: gradients are *summed* locally over ``k`` calls
  (torch's ``.grad`` accumulation); the ``k``-th call reduces and steps, the others
  return zero updates. ``average_aggregated_gradients=True`` divides the sum by ``k``
  (Horovod's TensorFlow option; ``optax.MultiSteps`` always averages).
- ``gradient_predivide_factor=f``: multiply by ``1/f`` before the sum and by
  ``f/size`` after it (only with ``op=ReduceOp.AVG``, Horovod's error otherwise).
- ``compression``: ``Compression.fp16`` (or ``bf16``) casts floating leaves before
  the all-reduce and restores their dtype after.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdist.collectives import ReduceOp, all_reduce_flat, invariant_leaves
from jdist.collectives.runtime import axis_of, bound_size
from jdist.optim._compression import Compression, Compressor

__all__ = ["AllReduceOptimizer", "DistributedOptimizer", "DistributedOptimizerState",
           "fused_allreduce"]


class DistributedOptimizerState(NamedTuple):
    """``mini_step``: calls since the last reduction; ``acc``: summed local gradients
    (``()`` when ``backward_passes_per_step == 1``); ``inner``: the wrapped tx's state."""

    mini_step: jax.Array
    acc: Any
    inner: Any


def fused_allreduce(tree, axis, *, op=ReduceOp.AVG, compression: Compressor = Compression.none,
                    prescale: float = 1.0, postscale: float = 1.0, flat: bool | None = None):
    """Sum (or average) a pytree over ``axis``, fused per (compressed) dtype (see module doc).

    The sum is :func:`jdist.collectives.all_reduce_flat`: one flat buffer per dtype on
    CPU across processes (gloo), one combined all-reduce elsewhere; ``flat`` forces
    either form. Must run inside ``shard_map`` (or any context where ``axis`` is bound).
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    size = bound_size(
        axis, "DistributedOptimizer.update",
        f"It must run inside jax.shard_map over the group's mesh axis {axis!r}; wrap the "
        "train step in jax.shard_map (or use DDP, which averages itself)")
    summed = invariant_leaves(tree, axis)
    if summed:
        raise ValueError(
            f"DistributedOptimizer.update: the gradients at {summed[:4]} are typed invariant "
            f"over mesh axis {axis!r}: under jax.shard_map(check_vma=True), jax.grad of "
            f"replicated (P()) parameters already sums them over the replicas, and reducing "
            f"them again would count each replica {size} times. Use "
            f"jax.shard_map(..., check_vma=False), or differentiate with respect to "
            f"jax.lax.pcast(params, {axis!r}, to='varying')")
    packed = [compression.compress(x) for x in leaves]
    parts = []
    for y, _ in packed:
        if prescale != 1.0 and jnp.issubdtype(y.dtype, jnp.floating):
            y = y * jnp.asarray(prescale, y.dtype)
        parts.append(y)
    parts = all_reduce_flat(parts, ReduceOp.SUM, axis, flat=flat)
    post = postscale / size if op == ReduceOp.AVG else postscale
    out = []
    for y, (_, ctx) in zip(parts, packed, strict=True):
        if not jnp.issubdtype(y.dtype, jnp.floating):
            y = y // size if op == ReduceOp.AVG else y  # integer leaves: floor mean
        elif post != 1.0:
            y = y * jnp.asarray(post, y.dtype)
        out.append(compression.decompress(y, ctx))
    return jax.tree.unflatten(treedef, out)


def AllReduceOptimizer(tx: optax.GradientTransformation, *, group=None, compression=None,
                       backward_passes_per_step: int = 1,
                       gradient_predivide_factor: float = 1.0, op: ReduceOp = ReduceOp.AVG,
                       average_aggregated_gradients: bool = False,
                       flat: bool | None = None) -> optax.GradientTransformationExtraArgs:
    """Wrap ``tx`` so gradients are averaged across replicas first (Horovod semantics).

    Horovod's ``hvd.DistributedOptimizer``; ``jdist.optim.DistributedOptimizer`` is the
    same function under Horovod's name. For torch's RPC ``DistributedOptimizer`` (RRefs,
    ``step(context_id)``) use :class:`jdist.rpc.DistributedOptimizer`.

    Args:
      tx: the optax transformation to run on the averaged gradients.
      group: ProcessGroup, mesh axis name, or None (the default group's axis, ``"dp"``).
      compression: ``None``/``Compression.none``, ``Compression.fp16`` or ``.bf16``.
      backward_passes_per_step: local gradient sums per reduction (>= 1).
      gradient_predivide_factor: Horovod's pre/post scaling split (> 0).
      op: ``ReduceOp.AVG`` (default) or ``ReduceOp.SUM``.
      average_aggregated_gradients: divide the ``k``-pass sum by ``k``.
      flat: reduce each dtype's gradients as one flat buffer (True), per leaf (False),
        or as the backend prefers (None; see :func:`jdist.collectives.prefers_flat`).

    Returns:
      An optax ``GradientTransformationExtraArgs``; call ``update`` inside ``shard_map``
      over the group's axis (or any context binding it).

    Raises:
      ValueError / TypeError: bad arguments, with the value and the fix.
    """
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        hint = (" (for torch's RPC DistributedOptimizer, which takes an optax factory and "
                "RRefs, use jdist.rpc.DistributedOptimizer)" if callable(tx) else "")
        raise TypeError(f"AllReduceOptimizer (jdist.optim.DistributedOptimizer) expects an "
                        f"optax GradientTransformation, got {type(tx).__name__}; pass e.g. "
                        f"optax.sgd(0.1){hint}")
    k = backward_passes_per_step
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {k!r}")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got "
                         f"{gradient_predivide_factor!r}")
    if op not in (ReduceOp.AVG, ReduceOp.SUM):
        raise ValueError(f"op must be ReduceOp.AVG or ReduceOp.SUM, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVG:
        raise ValueError("gradient_predivide_factor not supported with op != Average "
                         f"(got op={op!r}); use op=ReduceOp.AVG or factor 1.0")
    compression = Compression.none if compression is None else compression
    if not isinstance(compression, Compressor):
        raise TypeError(f"compression must be None or a jdist.optim.Compression member "
                        f"(none, fp16, bf16), got {compression!r}")
    axis = axis_of(group)
    tx = optax.with_extra_args_support(tx)
    f = float(gradient_predivide_factor)

    def reduce(grads):
        return fused_allreduce(grads, axis, op=op, compression=compression,
                               prescale=1.0 / f, postscale=f, flat=flat)

    def init_fn(params):
        acc = () if k == 1 else jax.tree.map(jnp.zeros_like, params)
        return DistributedOptimizerState(jnp.zeros((), jnp.int32), acc, tx.init(params))

    def update_fn(updates, state, params=None, **extra):
        if k == 1:
            new, inner = tx.update(reduce(updates), state.inner, params, **extra)
            return new, DistributedOptimizerState(state.mini_step, (), inner)
        acc = jax.tree.map(jnp.add, state.acc, updates)
        step = state.mini_step + 1

        def emit(_):
            summed = jax.tree.map(lambda a: a / k, acc) if average_aggregated_gradients else acc
            new, inner = tx.update(reduce(summed), state.inner, params, **extra)
            return new, jax.tree.map(jnp.zeros_like, acc), inner, jnp.zeros((), jnp.int32)

        def hold(_):
            zeros = jax.tree.map(jnp.zeros_like, updates)
            return zeros, acc, state.inner, step

        new, acc, inner, step = jax.lax.cond(step >= k, emit, hold, None)
        return new, DistributedOptimizerState(step, acc, inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DistributedOptimizer = AllReduceOptimizer  # Horovod's name (not torch's RPC one: see above)
