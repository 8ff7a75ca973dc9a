"""``DataParallel.value_and_grad``: forward, loss and backward as ONE compiled program.

torch's DataParallel training step is ``loss = criterion(dp(x), y); loss.backward()``:
scatter, replicate, parallel forward, gather, the loss on the output device, then the
backward pass in reverse (cotangents scattered back, each replica's parameter gradients
reduce-added onto ``device_ids[0]``). ``jax.value_and_grad`` through an eager
DataParallel does the same, as a few programs plus JAX's eager autodiff. This module
compiles the whole step instead: one ``jit`` over the sub-mesh of the devices that
receive chunks, whose forward is a ``shard_map`` (parameters replicated, the batch split
with ``torch.chunk`` sizes, each replica seeing exactly its chunk), whose gathered
outputs feed the loss, and whose backward sums the replicas' gradients inside the
program. Only the inputs are placed (one transfer each); the parameter copies are cached
as in the eager path.

Semantics are DataParallel's: the same chunks (an uneven last chunk is a replica of its
own, computed in the same program), replica ``i`` folds ``i`` into its PRNG keys (one
chunk: keys unchanged), replica 0's state updates (BatchNorm statistics, RNG counts) are
written back to an NNX module, gradients land on ``device_ids[0]`` and the loss on
``output_device``.

``value_and_grad`` is a method torch's DataParallel does not have: the JAX-native
counterpart of DDP's ``ddp.value_and_grad``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jdist.collectives.runtime import DEFAULT_AXIS
from jdist.dp._programs import nnx_apply
from jdist.dp._scatter_gather import SCALAR_WARNING, batch_size, chunk_sizes, dim_spec, mesh_for
from jdist.dp._trees import check_same_output, fold_keys, partition, rebuild, split_output

__all__ = ["FusedValueAndGrad"]


def _forward(fn: Callable, params: Any, a_dyn: list, akey: tuple, sizes: tuple, dim: int,
             mesh) -> tuple[Any, Any]:
    """Replica semantics in a trace: ``shard_map`` over ``mesh`` for the equal chunks, the
    uneven tail (if any) as a replica of its own. Returns ``(gathered output, aux of 0)``."""
    c, k, m = sizes[0], len(sizes), mesh.size
    p_dyn, pkey = partition(params)
    if k == 1:  # one chunk: the module itself, keys unchanged
        args, kwargs = rebuild(a_dyn, akey)
        return fn(rebuild(p_dyn, pkey), args, kwargs)
    main = [lax.slice_in_dim(a, 0, m * c, axis=dim) for a in a_dyn]
    metas = []

    def replica(p, dyn):
        index = lax.axis_index(DEFAULT_AXIS)
        args, kwargs = rebuild(dyn, akey)
        out, aux = fn(rebuild(fold_keys(p, index), pkey), args, kwargs)
        arrays, meta = split_output(out, True, dim)
        metas.append(meta)
        return arrays, jax.tree_util.tree_map(lambda a: a[None], aux)

    arrays, aux = jax.shard_map(
        replica, mesh=mesh, in_specs=(PartitionSpec(), dim_spec(dim)),
        out_specs=(dim_spec(dim), PartitionSpec(DEFAULT_AXIS)), check_vma=False)(p_dyn, main)
    meta = metas[-1]
    if m < k:
        tail = [lax.slice_in_dim(a, m * c, a.shape[dim], axis=dim) for a in a_dyn]
        args, kwargs = rebuild(tail, akey)
        out_t, _ = fn(rebuild(fold_keys(p_dyn, m), pkey), args, kwargs)
        arrays_t, meta_t = split_output(out_t, True, dim)
        check_same_output(meta, meta_t, m)
        arrays = [jnp.concatenate([a, b], axis=dim) for a, b in zip(arrays, arrays_t,
                                                                      strict=True)]
    if meta.static:
        raise TypeError(
            f"DataParallel.value_and_grad needs array outputs (they feed the loss), but the "
            f"module returned non-array leaves {[v for _, v in meta.static]!r}; return arrays "
            f"only, or use jax.value_and_grad through the eager DataParallel")
    if any(meta.scalar):
        warnings.warn(SCALAR_WARNING, UserWarning, stacklevel=2)
    out = jax.tree_util.tree_unflatten(meta.treedef, arrays)
    return out, jax.tree_util.tree_map(lambda a: a[0], aux)


def _first(tree: Any) -> Any:
    """The copy on the mesh's first device (``device_ids[0]``) of each replicated array of
    ``tree``: a view of that shard, no transfer."""
    return jax.tree_util.tree_map(lambda a: a.addressable_data(0), tree)


class FusedValueAndGrad:
    """``loss_fn(module(*inputs), *loss_args)`` and its parameter gradients, one program.

    Built by :meth:`jdist.dp.DataParallel.value_and_grad`; see there.
    """

    def __init__(self, dp: Any, loss_fn: Callable, has_aux: bool = False) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
        self._dp = dp
        self._loss_fn = loss_fn
        self._has_aux = has_aux
        self._jitted = jax.jit(self._step, static_argnums=(4,))
        self.traces = 0

    # ---------------------------------------------------------------- the traced step
    def _step(self, p_dyn, r_dyn, a_dyn, l_dyn, static):
        self.traces += 1
        pkey, rkey, akey, lkey, sizes, mesh_devices, kind = static
        mesh = mesh_for(mesh_devices)
        fn = self._apply_fn(kind)
        rest = rebuild(r_dyn, rkey)

        def loss_of(p):
            params = rebuild(p, pkey)
            out, aux = _forward(fn, (params, rest), a_dyn, akey, sizes, self._dp.dim, mesh)
            res = self._loss_fn(out, *rebuild(l_dyn, lkey))
            loss, extra = res if self._has_aux else (res, None)
            return loss, (extra, aux)

        (loss, (extra, aux)), grads = jax.value_and_grad(loss_of, has_aux=True)(p_dyn)
        # every result replicated, so each device (device_ids[0] included) has all of it
        return jax.lax.with_sharding_constraint(
            (loss, extra, rebuild(grads, pkey), aux), NamedSharding(mesh, PartitionSpec()))

    def _apply_fn(self, kind) -> Callable:
        if kind[0] == "nnx":
            call = nnx_apply(kind[1])
            return lambda pr, args, kwargs: call(nnx.merge_state(*pr), args, kwargs)
        apply_fn = self._dp.apply_fn
        return lambda pr, args, kwargs: (apply_fn(pr[0], *args, **kwargs), None)

    # ---------------------------------------------------------------- the call
    def __call__(self, *call_args: Any, **kwargs: Any) -> Any:
        dp = self._dp
        if dp.apply_fn is None:
            if not call_args:
                raise TypeError("value_and_grad(loss_fn)(inputs, *loss_args): inputs missing")
            graphdef, params, rest = nnx.split(dp.module, nnx.Param, ...)
            kind = ("nnx", graphdef)
            inputs, loss_args = call_args[0], call_args[1:]
        else:
            if len(call_args) < 2:
                raise TypeError(
                    "value_and_grad(loss_fn)(params, inputs, *loss_args) for an "
                    f"(apply_fn, params) DataParallel; got {len(call_args)} positional "
                    f"argument(s)")
            params, inputs, loss_args = call_args[0], call_args[1], call_args[2:]
            params = jax.tree_util.tree_map(  # Python numbers are parameters here too
                lambda v: jnp.asarray(v) if isinstance(v, (int, float, complex)) else v,
                params)
            rest, kind = None, ("fn",)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        devices = dp.device_ids
        n = batch_size((inputs, kwargs), dp.dim)
        sizes = chunk_sizes(n, len(devices)) if n is not None else (1,)
        m = len(sizes) if sizes[-1] == sizes[0] else len(sizes) - 1
        mesh = mesh_for(tuple(devices[:m]))
        replicated = NamedSharding(mesh, PartitionSpec())
        p_dyn, pkey = partition(params)
        r_dyn, rkey = partition(rest)
        a_dyn, akey = partition((inputs, dict(kwargs)))
        l_dyn, lkey = partition(tuple(loss_args))
        p_dyn = dp._runtime.replicas.put(p_dyn, replicated, home=devices[0])
        r_dyn = jax.device_put(r_dyn, replicated)
        split = m == len(sizes) and m > 1
        a_dyn = jax.device_put(a_dyn, NamedSharding(mesh, dim_spec(dp.dim)) if split
                               else replicated)
        l_dyn = jax.device_put(l_dyn, replicated)
        static = (pkey, rkey, akey, lkey, sizes, tuple(devices[:m]), kind)
        loss, extra, grads, aux = self._jitted(p_dyn, r_dyn, a_dyn, l_dyn, static)
        loss, extra = jax.device_put(_first((loss, extra)), dp.output_device)
        grads = _first(grads)
        if kind[0] == "nnx":
            if jax.tree_util.tree_leaves(aux):
                nnx.update(dp.module, _first(aux))
            grads = nnx.State({"module": grads})
        return ((loss, extra) if self._has_aux else loss), grads


def value_and_grad(dp: Any, loss_fn: Callable, has_aux: bool = False,
                   cache: dict | None = None) -> FusedValueAndGrad:
    """The cached :class:`FusedValueAndGrad` of ``dp`` for ``loss_fn``."""
    key = (loss_fn, bool(has_aux))
    if cache is None:
        return FusedValueAndGrad(dp, loss_fn, has_aux)
    if key not in cache:
        cache[key] = FusedValueAndGrad(dp, loss_fn, has_aux)
    return cache[key]
