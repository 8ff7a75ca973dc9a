"""DataParallel's pipeline: scatter -> replicate -> parallel_apply -> gather.

:func:`apply_data_parallel` is torch's DataParallel forward, stage by stage, with the
same semantics (``torch.chunk`` sizes, possibly fewer replicas than devices, one direct
call for one device or one chunk, outputs gathered on ``output_device``). What each stage
runs is an implementation choice: the replicas that received equal chunks are handled
*fused*, as one sharded array per input leaf (``scatter``), parameters replicated over
their sub-mesh (``replicate``), ONE ``jit(shard_map)`` program (``parallel_apply``, the
fused form of :class:`~jdist.dp._programs.ReplicaProgram`) and one transfer per output
leaf (``gather``); only an uneven last chunk gets a replica of its own on its device.
Parameter copies and compiled programs are cached across calls (:class:`Runtime`).

Inside a trace (the user's ``jax.jit`` / ``vmap``), the same stages run as a ``vmap``
over the equal chunks plus the tail (:func:`_apply_traced`), placed by the outer ``jit``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jdist.dp._parallel_apply import replica_error
from jdist.dp._programs import Programs, ReplicaProgram
from jdist.dp._replicate import ReplicaCache, default_cache
from jdist.dp._scatter_gather import SCALAR_WARNING, batch_size, chunk_sizes, dim_spec, mesh_for
from jdist.dp._trees import check_same_output, fold_keys, partition, rebuild, split_output

__all__ = ["Runtime", "apply_data_parallel", "default_runtime", "is_concrete_tree"]


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


default_runtime = Runtime(default_cache)


def _is_concrete(x: Any) -> bool:
    """True for arrays and for tracers with known values (``jax.grad`` run eagerly)."""
    if not isinstance(x, jax.core.Tracer):
        return True
    try:
        return bool(jax._src.core.is_concrete(x))
    except AttributeError:  # private API moved: treat as traced (correct, just unplaced)
        return False


def is_concrete_tree(tree: Any) -> bool:
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


def _apply_traced(fn, params, a_dyn, akey, sizes, dim) -> tuple:
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


class _Plan(NamedTuple):
    """How one call splits its batch (the ``scatter`` decision).

    ``sizes``: torch's chunk sizes, one replica per chunk; the first ``m`` replicas got
    equal chunks and run fused, on ``devices[:m]``; a shorter last chunk (``m <
    len(sizes)``) is a replica of its own on ``devices[m]``.
    """

    sizes: tuple
    m: int
    devices: tuple
    dim: int

    @property
    def jobs(self) -> list:
        """``(first replica, device, placement of the parameters, program mesh)`` per job:
        the fused equal-chunk replicas, then the tail (if any)."""
        mesh = mesh_for(self.devices[:self.m])
        jobs = [(0, self.devices[0], NamedSharding(mesh, PartitionSpec()), mesh)]
        if self.m < len(self.sizes):
            dev = self.devices[self.m]
            jobs.append((self.m, dev, SingleDeviceSharding(dev), None))
        return jobs


def _plan(args: tuple, kwargs: dict, devices: tuple, dim: int) -> _Plan | None:
    """The chunks for these inputs, or None for one device or one chunk (direct call)."""
    n = batch_size((tuple(args), dict(kwargs)), dim)
    if n is not None:
        sizes = chunk_sizes(n, len(devices))
    else:  # no array to split: every replica gets the same inputs; no inputs: one (torch)
        sizes = (1,) * (len(devices) if args or kwargs else 1)
    if len(devices) == 1 or len(sizes) == 1:
        return None
    k = len(sizes)
    return _Plan(sizes, k if sizes[-1] == sizes[0] else k - 1, tuple(devices[:k]), dim)


def _each(jobs: list, errors: dict, fn: Callable, *per_job: list) -> list:
    """``fn(job, *values)`` for each job that has not failed yet; a job's exception is
    kept as torch's replica error (raised once every job has been dispatched)."""
    out = []
    for i, job in enumerate(jobs):
        if job[0] in errors:
            out.append(None)
            continue
        try:
            out.append(fn(job, *(v[i] for v in per_job)))
        except Exception as e:  # noqa: BLE001 - re-raised by apply_data_parallel
            errors[job[0]] = replica_error(e, job[0], job[1])
            out.append(None)
    return out


def _scatter(plan: _Plan, a_dyn: list) -> list:
    """The input leaves per job: the equal chunks as one array split over their devices
    (one transfer per leaf), the tail chunk on its own device."""
    cut = plan.m * plan.sizes[0]
    if plan.m < len(plan.sizes):
        return list(_split_jit(a_dyn, cut, plan.dim))
    return [a_dyn]


def _place(job: tuple, part: list, dim: int) -> list:
    _, _, placement, mesh = job
    return jax.device_put(part, NamedSharding(mesh, dim_spec(dim)) if mesh is not None
                          else placement)


def _gather(results: list, plan: _Plan, output_device) -> tuple:
    """Outputs concatenated along ``dim`` on ``output_device``; replica 0's state updates."""
    arrays, aux, meta = results[0]
    arrays = jax.device_put(arrays, output_device)
    static_lists = [[v] * plan.m for _, v in meta.static]
    if plan.m < len(plan.sizes):
        arrays_t, _, meta_t = results[1]
        check_same_output(meta, meta_t, plan.m)
        arrays = _concat_jit(arrays, jax.device_put(arrays_t, output_device), plan.dim)
        static_lists = _append_static(static_lists, meta_t)
    if jax.tree_util.tree_leaves(aux):
        aux = jax.device_put(_take_first(aux), plan.devices[0])
    return _finish(arrays, meta, static_lists, aux)


def apply_data_parallel(fn: Callable, key: Any, params: Any, args: tuple, kwargs: dict,
                        devices: tuple, output_device, dim: int,
                        runtime: Runtime | None = None):
    """scatter -> replicate -> parallel_apply -> gather for ``fn(params, args, kwargs)
    -> (out, aux)``.

    Returns ``(out, aux_of_replica_0)``, or None when there is one device or one chunk
    (the caller then calls the module directly).
    """
    runtime = default_runtime if runtime is None else runtime
    plan = _plan(args, kwargs, devices, dim)
    if plan is None:
        return None
    a_dyn, akey = partition((tuple(args), dict(kwargs)))
    if not is_concrete_tree((params, a_dyn)):
        return _apply_traced(fn, params, a_dyn, akey, plan.sizes, dim)
    jobs, errors = plan.jobs, {}
    inputs = _each(jobs, errors, lambda job, part: rebuild(_place(job, part, dim), akey),
                   _scatter(plan, a_dyn))                                           # scatter
    replicas = _each(jobs, errors, lambda job: runtime.replicas.put(
        params, job[2], home=plan.devices[0]))                                     # replicate
    results = _each(jobs, errors, lambda job, p, ins: runtime.program(
        key, fn, job[3], dim)(p, ins[0], ins[1], job[0]), replicas, inputs)  # parallel_apply
    if errors:
        raise errors[min(errors)]
    return _gather(results, plan, output_device)                                    # gather
