"""Compiled replica programs: :class:`ReplicaProgram` and its small LRU cache.

:class:`ReplicaProgram` is ``jax.jit(fn)`` made fit for DataParallel: non-array inputs
become compile-time constants, non-array outputs (strings, Python objects) are carried
around the compiled function, and, given a mesh, the program is one SPMD
``jit(shard_map(fn))`` over it (parameters replicated, batch split along ``dim``), so
``m`` equal replicas cost one dispatch instead of ``m``: the fused form that DataParallel
and ``parallel_apply`` choose for replicas with equal chunks. Compiled programs are
cached by ``jax.jit`` per input signature; ``traces`` counts Python traces (tests use
it to show that repeated calls do not recompile). :func:`nnx_apply` turns an NNX
module's graphdef into the pure function a program runs.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jdist.collectives.runtime import DEFAULT_AXIS
from jdist.dp._scatter_gather import dim_spec
from jdist.dp._trees import OutputMeta, fold_keys, partition, rebuild, split_output

__all__ = ["ReplicaProgram", "Programs", "nnx_apply"]


class ReplicaProgram:
    """``fn(params, args, kwargs) -> (out, aux)`` compiled for one device or one mesh.

    Args:
      fn: a pure function. ``out`` is any pytree (arrays are returned, other leaves are
        carried in :class:`OutputMeta`); ``aux`` is a pytree of arrays (state updates).
      mesh: None for a plain ``jit`` (runs where its inputs are); a 1-D ``"dp"`` mesh for
        one ``jit(shard_map)`` program: params replicated, args split along ``dim``,
        outputs concatenated along ``dim`` and ``aux`` stacked on a new leading axis.
      dim: the batch dimension.
      expand_scalars: unsqueeze 0-d outputs to shape (1,) (always on with a mesh).
      fold_rng: fold each replica's index into the typed PRNG keys among the params, so
        replicas draw independent random numbers (dropout), as torch's devices do.
    """

    def __init__(self, fn: Callable, mesh=None, dim: int = 0, expand_scalars: bool = False,
                 fold_rng: bool = False):
        self._fn = fn
        self._mesh = mesh
        self._dim = dim
        self._expand = expand_scalars or mesh is not None
        self._fold = fold_rng
        self._meta: dict = {}
        self._jitted = jax.jit(self._traced, static_argnums=3)
        self.traces = 0

    def _inner(self, p_dyn, a_dyn, index, key):
        if self._fold:
            if self._mesh is not None:
                index = index + jax.lax.axis_index(DEFAULT_AXIS)
            p_dyn = fold_keys(p_dyn, index)
        params = rebuild(p_dyn, key[0])
        args, kwargs = rebuild(a_dyn, key[1])
        out, aux = self._fn(params, args, kwargs)
        arrays, meta = split_output(out, self._expand, self._dim)
        self._meta[key] = meta  # key includes the shapes: one entry per compiled program
        if self._mesh is not None:
            aux = jax.tree_util.tree_map(lambda a: jnp.expand_dims(a, 0), aux)
        return arrays, aux

    def _traced(self, p_dyn, a_dyn, index, key):
        self.traces += 1
        if self._mesh is None:
            return self._inner(p_dyn, a_dyn, index, key)
        body = jax.shard_map(
            functools.partial(self._inner, key=key), mesh=self._mesh,
            in_specs=(PartitionSpec(), dim_spec(self._dim), PartitionSpec()),
            out_specs=(dim_spec(self._dim), PartitionSpec(DEFAULT_AXIS)), check_vma=False)
        return body(p_dyn, a_dyn, index)

    def __call__(self, params: Any, args: tuple, kwargs: dict,
                 index: int = 0) -> tuple[list, Any, OutputMeta]:
        """Returns ``(arrays, aux, meta)``; ``join_output(arrays, meta)`` is the output.

        ``index`` is the (first) replica's index, folded into PRNG keys with ``fold_rng``.
        """
        p_dyn, pkey = partition(params)
        a_dyn, akey = partition((tuple(args), dict(kwargs)))
        shapes = tuple((tuple(x.shape), x.dtype) for x in p_dyn + a_dyn)
        key = (pkey, akey, shapes)  # static; the shapes are in jit's cache key anyway
        arrays, aux = self._jitted(p_dyn, a_dyn, np.int32(index), key)
        return arrays, aux, self._meta[key]


def nnx_apply(graphdef: Any, call: Callable | None = None) -> Callable:
    """A ``fn(state, args, kwargs) -> (out, changed_state)`` for an NNX module's graphdef.

    ``call(module, *args, **kwargs)`` defaults to calling the module. ``changed_state``
    holds the variables the call replaced (batch statistics, RNG counts, sown values).
    """
    def fn(state, args, kwargs):
        # fresh Variables, owned by the current trace (merge would reuse the caller's)
        state = jax.tree_util.tree_map(lambda a: a, state)
        before = {path: v.get_value() for path, v in nnx.to_flat_state(state)}
        module = nnx.merge(graphdef, state)
        out = module(*args, **kwargs) if call is None else call(module, *args, **kwargs)
        after = nnx.to_flat_state(nnx.state(module))
        changed = [(p, v) for p, v in after if before.get(p, None) is not v.get_value()]
        return out, nnx.from_flat_state(changed)
    return fn


class Programs:
    """A small LRU of compiled :class:`ReplicaProgram` s, keyed by function and placement."""

    def __init__(self, maxsize: int = 64) -> None:
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._maxsize = maxsize

    def get(self, key: Hashable, make: Callable[[], ReplicaProgram]) -> ReplicaProgram:
        prog = self._lru.pop(key, None) or make()
        self._lru[key] = prog
        while len(self._lru) > self._maxsize:
            self._lru.popitem(last=False)
        return prog
