"""DataParallel: scatter -> replicate -> parallel_apply -> gather, as one compiled step.

The pipeline is torch's, with the same semantics (``torch.chunk`` sizes, possibly fewer
replicas than devices, one direct call for one device or one chunk, outputs gathered on
``output_device``), but not its cost: the replicas that received equal chunks run as ONE
``jit(shard_map)`` program over the sub-mesh of their devices, and only an uneven last
chunk gets a program of its own on its device. Parameter copies and compiled programs
are cached across calls. Every step is a differentiable JAX operation, so ``jax.grad`` /
``nnx.grad`` through a DataParallel forward equals the single-device gradient of the same
loss; gradients land where the parameters live (``device_ids[0]`` by default, as in
torch, whose backward reduce-adds them there).

State updates (BatchNorm statistics, RNG counts, sown values) follow torch: every
replica computes its own from its chunk, and replica 0's update is written back to the
module (torch keeps it because only the device-0 replica shares the module's buffers).
Use ``jdist.ddp.convert_sync_batchnorm`` for statistics over the whole batch.

Inside your own ``jax.jit`` (or ``vmap``) the same semantics hold (each replica's forward
sees exactly its chunk), computed as a ``vmap`` over replicas; placement across devices is
then the outer ``jit``'s (use it eagerly, or ``jdist.ddp``, for device parallelism).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jdist.dp._fused import value_and_grad as fused_value_and_grad
from jdist.dp._parallel_apply import (
    Programs,
    ReplicaProgram,
    check_same_output,
    fold_keys,
    nnx_apply,
    partition,
    rebuild,
    replica_error,
    split_output,
)
from jdist.dp._replicate import ReplicaCache, default_cache
from jdist.dp._scatter_gather import (
    SCALAR_WARNING,
    batch_size,
    chunk_sizes,
    dim_spec,
    is_array,
    mesh_for,
    resolve_devices,
    resolve_target,
)

__all__ = ["DataParallel", "data_parallel", "Runtime", "apply_data_parallel"]


class Runtime:
    """The caches of one DataParallel: parameter copies and compiled programs."""

    def __init__(self, replicas: ReplicaCache | None = None) -> None:
        self.replicas = ReplicaCache() if replicas is None else replicas
        self.programs = Programs()
        self.fused: dict = {}  # (loss_fn, has_aux) -> FusedValueAndGrad

    def program(self, key: Any, fn: Callable, mesh, dim: int) -> ReplicaProgram:
        return self.programs.get((key, mesh, dim), lambda: ReplicaProgram(
            fn, mesh=mesh, dim=dim, expand_scalars=True, fold_rng=True))


_default_runtime = Runtime(default_cache)


def _is_concrete(x: Any) -> bool:
    """True for arrays and for tracers with known values (``jax.grad`` run eagerly)."""
    if not isinstance(x, jax.core.Tracer):
        return True
    try:
        return bool(jax._src.core.is_concrete(x))
    except AttributeError:  # private API moved: treat as traced (correct, just unplaced)
        return False


def _concrete(tree: Any) -> bool:
    return all(_is_concrete(x) for x in jax.tree_util.tree_leaves(tree))


@jax.jit
def _take_first(tree):
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def _split_at(arrays: list, cut: int, dim: int) -> tuple[list, list]:
    return ([lax.slice_in_dim(a, 0, cut, axis=dim) for a in arrays],
            [lax.slice_in_dim(a, cut, a.shape[dim], axis=dim) for a in arrays])


_split_jit = jax.jit(_split_at, static_argnums=(1, 2))
_concat_jit = jax.jit(lambda a, b, dim: [jnp.concatenate([x, y], axis=dim)
                                         for x, y in zip(a, b, strict=True)],
                      static_argnums=2)


def _append_static(static_lists: list, meta) -> list:
    return [vals + [v] for vals, (_, v) in zip(static_lists, meta.static, strict=True)]


def _finish(arrays: list, meta, static_lists: list, aux) -> tuple:
    if any(meta.scalar):
        warnings.warn(SCALAR_WARNING, UserWarning, stacklevel=4)
    static = tuple((i, vals) for (i, _), vals in zip(meta.static, static_lists, strict=True))
    return rebuild(arrays, (meta.treedef, static)), aux


def _apply_vmapped(fn, params, a_dyn, akey, sizes, dim) -> tuple:
    """Replica semantics inside a trace (jit/vmap): vmap over equal chunks + the tail."""
    c, k = sizes[0], len(sizes)
    m = k if sizes[-1] == c else k - 1
    main, tail = _split_at(a_dyn, m * c, dim)
    stacked = [jnp.moveaxis(jnp.reshape(a, a.shape[:dim] + (m, c) + a.shape[dim + 1:]), dim, 0)
               for a in main]
    metas = []
    p_dyn, pkey = partition(params)

    def one(dyn, index):
        args, kwargs = rebuild(dyn, akey)
        out, aux = fn(rebuild(fold_keys(p_dyn, index), pkey), args, kwargs)
        arrays, meta = split_output(out, True, dim)
        metas.append(meta)
        return arrays, aux

    arrays, aux = jax.vmap(one)(stacked, jnp.arange(m, dtype=jnp.int32))
    arrays = [jnp.reshape(jnp.moveaxis(a, 0, dim),
                          a.shape[1:dim + 1] + (m * a.shape[dim + 1],) + a.shape[dim + 2:])
              for a in arrays]
    meta = metas[-1]
    static_lists = [[v] * m for _, v in meta.static]
    if m < k:
        args, kwargs = rebuild(tail, akey)
        out_t, _ = fn(rebuild(fold_keys(p_dyn, m), pkey), args, kwargs)
        arrays_t, meta_t = split_output(out_t, True, dim)
        check_same_output(meta, meta_t, m)
        arrays = [jnp.concatenate([a, b], axis=dim) for a, b in zip(arrays, arrays_t, strict=True)]
        static_lists = _append_static(static_lists, meta_t)
    return _finish(arrays, meta, static_lists, jax.tree_util.tree_map(lambda a: a[0], aux))


def _dispatch(runtime, key, fn, params, a_dyn, akey, devices, m, sizes, dim):
    """Dispatch the equal-chunk program and the tail program; raise replica errors."""
    k = len(sizes)
    cut = m * sizes[0]
    main, tail = _split_jit(a_dyn, cut, dim) if m < k else (a_dyn, None)
    results, errors = [], {}
    mesh = mesh_for(devices[:m])
    jobs = [(devices[0], NamedSharding(mesh, PartitionSpec()), mesh, main)]
    if m < k:
        jobs.append((devices[m], SingleDeviceSharding(devices[m]), None, tail))
    for idx, (dev, placement, prog_mesh, part) in enumerate(jobs):
        try:
            p = runtime.replicas.put(params, placement, home=devices[0])
            sharding = NamedSharding(mesh, dim_spec(dim)) if prog_mesh is not None else placement
            args, kwargs = rebuild(jax.device_put(part, sharding), akey)
            results.append(runtime.program(key, fn, prog_mesh, dim)(p, args, kwargs, idx * m))
        except Exception as e:  # noqa: BLE001 - re-raised below, after all are dispatched
            errors[idx * m] = replica_error(e, idx * m, dev)
    if errors:
        raise errors[min(errors)]
    return results


def apply_data_parallel(fn: Callable, key: Any, params: Any, args: tuple, kwargs: dict,
                        devices: tuple, output_device, dim: int,
                        runtime: Runtime | None = None):
    """The DataParallel pipeline for ``fn(params, args, kwargs) -> (out, aux)``.

    Returns ``(out, aux_of_replica_0)``, or None when there is one device or one chunk
    (the caller then calls the module directly).
    """
    runtime = _default_runtime if runtime is None else runtime
    n = batch_size((tuple(args), dict(kwargs)), dim)
    if n is not None:
        sizes = chunk_sizes(n, len(devices))
    else:  # no array to split: every replica gets the same inputs; no inputs: one (torch)
        sizes = (1,) * (len(devices) if args or kwargs else 1)
    if len(devices) == 1 or len(sizes) == 1:
        return None
    a_dyn, akey = partition((tuple(args), dict(kwargs)))
    if not _concrete((params, a_dyn)):
        return _apply_vmapped(fn, params, a_dyn, akey, sizes, dim)
    k = len(sizes)
    m = k if sizes[-1] == sizes[0] else k - 1
    results = _dispatch(runtime, key, fn, params, a_dyn, akey, devices, m, sizes, dim)
    arrays, aux, meta = results[0]
    arrays = jax.device_put(arrays, output_device)
    static_lists = [[v] * m for _, v in meta.static]
    if m < k:
        arrays_t, _, meta_t = results[1]
        check_same_output(meta, meta_t, m)
        arrays = _concat_jit(arrays, jax.device_put(arrays_t, output_device), dim)
        static_lists = _append_static(static_lists, meta_t)
    if jax.tree_util.tree_leaves(aux):
        aux = jax.device_put(_take_first(aux), devices[0])
    return _finish(arrays, meta, static_lists, aux)


def _unpack(module: Any) -> tuple[Callable, Any]:
    if isinstance(module, tuple) and len(module) == 2 and callable(module[0]):
        return module
    raise TypeError(
        f"DataParallel wraps a flax.nnx.Module or an (apply_fn, params) pair with "
        f"apply_fn(params, *inputs, **kwargs); got {type(module).__name__}: {module!r:.200}")


def _direct(call: Callable, args: tuple, kwargs: dict, devices: tuple, output_device):
    """One device or one chunk: call the module itself (inputs on ``device_ids[0]``)."""
    if not _concrete((args, kwargs)):
        return call(*args, **kwargs)
    args, kwargs = _move_arrays((tuple(args), dict(kwargs)), devices[0])
    out = call(*args, **kwargs)
    return _move_arrays(out, output_device) if _concrete(out) else out


def _move_arrays(tree: Any, device) -> Any:
    """``tree`` with its array leaves put on ``device`` (one batched transfer)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    idx = [i for i, x in enumerate(leaves) if is_array(x)]
    moved = jax.device_put([leaves[i] for i in idx], device)
    for i, x in zip(idx, moved, strict=True):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _forward(module: Any, args: tuple, kwargs: dict, devices: tuple, output_device, dim: int,
             runtime: Runtime, params: Any = None):
    if isinstance(module, nnx.Module):
        graphdef, state = nnx.split(module)
        res = apply_data_parallel(nnx_apply(graphdef), ("nnx", graphdef), state, args, kwargs,
                                  devices, output_device, dim, runtime)
        if res is None:
            return _direct(module, args, kwargs, devices, output_device)
        out, aux = res
        if jax.tree_util.tree_leaves(aux):
            nnx.update(module, aux)
        return out
    apply_fn = module
    res = apply_data_parallel(lambda p, a, k: (apply_fn(p, *a, **k), None), ("fn", apply_fn),
                              params, args, kwargs, devices, output_device, dim, runtime)
    if res is None:
        return _direct(lambda *a, **k: apply_fn(params, *a, **k), args, kwargs, devices,
                       output_device)
    return res[0]


def _check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"dim must be a non-negative int, got {dim!r}")
    return dim


class DataParallel(nnx.Module):
    """Runs a module on several devices of this process, splitting the batch.

    Args:
      module: a ``flax.nnx.Module``, or ``(apply_fn, params)`` with
        ``apply_fn(params, *inputs, **kwargs)``.
      device_ids: jax devices or ints indexing ``jax.local_devices()``; None: all.
      output_device: where outputs are gathered (a device, an int or ``"cpu"``);
        default ``device_ids[0]``.
      dim: the batch dimension of inputs and outputs.

    ``dp(*inputs, **kwargs)`` runs the forward; for ``(apply_fn, params)``,
    ``dp.apply(params, *inputs, **kwargs)`` takes the parameters explicitly (for
    ``jax.grad``). For an NNX module, ``nnx.grad(loss)(dp, x)`` differentiates through it
    (and ``nnx.Optimizer(dp, tx, wrt=nnx.Param)`` updates it); ``dp.module`` is the
    wrapped module.

    Semantics, as torch: the batch is split with ``torch.chunk`` sizes (so fewer
    replicas than devices when it is small); one device or one chunk calls the module
    directly; outputs are gathered on ``output_device``; gradients land where the
    parameters live. Each replica computes its own BatchNorm statistics from its chunk and
    replica 0's update is written back (torch keeps device 0's buffers); the same holds for
    other state updates (RNG counts, sown values). Replica ``i`` folds ``i`` into the
    module's PRNG keys, so replicas draw independent dropout masks (torch draws per
    device); one device or one chunk uses the keys unchanged.
    Unlike torch: inputs with different batch sizes raise ``ValueError`` instead of
    dropping samples, parameters need not be on ``device_ids[0]`` first, and a CPU-only
    machine runs over its (virtual) CPU devices instead of unwrapping the module.

    Examples:
      >>> from flax import nnx
      >>> import jax.numpy as jnp
      >>> dp = DataParallel(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), device_ids=[0, 1, 2])
      >>> dp(jnp.ones((10, 4))).shape
      (10, 2)
    """

    def __init__(self, module: Any, device_ids: Sequence | None = None,
                 output_device: Any = None, dim: int = 0) -> None:
        self.device_ids = resolve_devices(device_ids)
        self.output_device = (self.device_ids[0] if output_device is None
                              else resolve_target(output_device))
        self.dim = _check_dim(dim)
        self._runtime = Runtime()
        if isinstance(module, nnx.Module):
            self.module = module
            self.apply_fn = None
        else:
            apply_fn, params = _unpack(module)
            self.apply_fn = apply_fn
            self.params = nnx.data(params)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.apply_fn is not None:
            return self.apply(self.params, *inputs, **kwargs)
        return _forward(self.module, inputs, kwargs, self.device_ids, self.output_device,
                        self.dim, self._runtime)

    def apply(self, params: Any, *inputs: Any, **kwargs: Any) -> Any:
        """The forward of an ``(apply_fn, params)`` DataParallel with explicit params."""
        if self.apply_fn is None:
            raise TypeError("apply(params, ...) is for (apply_fn, params) DataParallels; "
                            "call an NNX-module DataParallel as dp(*inputs) instead")
        return _forward(self.apply_fn, inputs, kwargs, self.device_ids, self.output_device,
                        self.dim, self._runtime, params=params)

    def value_and_grad(self, loss_fn: Callable, has_aux: bool = False) -> Callable:
        """Forward, loss and backward through this DataParallel as ONE compiled program.

        The training step ``loss = criterion(dp(x), y); loss.backward()`` of torch, fused:
        a ``jit`` over the sub-mesh of the devices that receive chunks, with each replica's
        forward in a ``shard_map`` (the same chunks, PRNG folding and replica-0 state
        updates as calling the DataParallel), the loss on the gathered outputs, and the
        replicas' gradients summed inside the program. Compiled once per input signature.

        Args:
          loss_fn: ``loss_fn(outputs, *loss_args) -> scalar`` (or ``(scalar, aux)`` with
            ``has_aux``), where ``outputs`` is the gathered forward output.
          has_aux: as in ``jax.value_and_grad``.

        Returns:
          For an ``(apply_fn, params)`` DataParallel, ``f(params, inputs, *loss_args,
          **module_kwargs)``; for an NNX module, ``f(inputs, *loss_args, **module_kwargs)``
          (gradients as an ``nnx.State`` shaped like ``nnx.state(dp, nnx.Param)``, ready
          for ``nnx.Optimizer(dp, tx, wrt=nnx.Param).update(dp, grads)``). ``inputs`` is
          the module's input array or a tuple of its inputs. ``f`` returns ``(loss,
          grads)`` (``((loss, aux), grads)`` with ``has_aux``): the loss on
          ``output_device``, the gradients on ``device_ids[0]``.

        Examples:
          >>> import jax.numpy as jnp
          >>> dp = DataParallel((lambda p, x: x * p, 2.0), device_ids=[0, 1])
          >>> f = dp.value_and_grad(lambda out, y: jnp.sum((out - y) ** 2))
          >>> loss, g = f(2.0, jnp.arange(4.0), jnp.zeros(4))
          >>> float(loss), float(g)
          (56.0, 56.0)
        """
        return fused_value_and_grad(self, loss_fn, has_aux, self._runtime.fused)


def data_parallel(module: Any, inputs: Any, device_ids: Sequence | None = None,
                  output_device: Any = None, dim: int = 0,
                  module_kwargs: dict | None = None) -> Any:
    """Functional DataParallel: evaluate ``module(*inputs, **module_kwargs)`` over devices.

    ``module`` is an NNX module (replica 0's state updates are written back to it) or an
    ``(apply_fn, params)`` pair. Parameter copies and compiled programs are cached across
    calls (keyed on the module's graph or on ``apply_fn``).

    Examples:
      >>> import jax.numpy as jnp
      >>> data_parallel((lambda p, x: x * p, 2.0), jnp.arange(6.0), [0, 1, 2])
      Array([ 0.,  2.,  4.,  6.,  8., 10.], dtype=float32)
    """
    devices = resolve_devices(device_ids)
    out_dev = devices[0] if output_device is None else resolve_target(output_device)
    inputs = () if inputs is None else inputs if isinstance(inputs, tuple) else (inputs,)
    kwargs = dict(module_kwargs or {})
    if isinstance(module, nnx.Module):
        return _forward(module, inputs, kwargs, devices, out_dev, _check_dim(dim),
                        _default_runtime)
    apply_fn, params = _unpack(module)
    return _forward(apply_fn, inputs, kwargs, devices, out_dev, _check_dim(dim),
                    _default_runtime, params=params)
