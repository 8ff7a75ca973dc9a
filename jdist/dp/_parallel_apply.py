"""Run a function on several replicas: compiled programs, dispatched before any is awaited.

:class:`ReplicaProgram` is ``jax.jit(fn)`` made fit for DataParallel: non-array inputs
become compile-time constants, non-array outputs (strings, Python objects) are carried
around the compiled function, and, given a mesh, the program is one SPMD
``jit(shard_map(fn))`` over it (parameters replicated, batch split along ``dim``), so
``m`` equal replicas cost one dispatch instead of ``m``. Compiled programs are cached by
``jax.jit`` per input signature; ``traces`` counts Python traces (tests use it to show
that repeated calls do not recompile).

:func:`parallel_apply` is torch's ``parallel_apply`` over a list of replicas: every
replica's program is dispatched (JAX runs them asynchronously) before any result is
awaited, and an exception in replica ``i`` is re-raised as
``Caught <Type> in replica i on device d`` followed by the original traceback. Given the
unmodified list ``replicate`` returned and inputs placed on the replicas' devices (as
``scatter`` places them), the leading replicas with equal input shapes run as one SPMD
program assembled from their buffers without copies.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jdist.collectives._group import DEFAULT_AXIS
from jdist.dp._replicate import Replicas
from jdist.dp._scatter_gather import (
    dim_spec,
    gather,
    is_array,
    mesh_for,
    resolve_devices,
    split_container,
)

__all__ = [
    "OutputMeta", "ReplicaProgram", "Programs", "partition", "rebuild", "split_output",
    "join_output", "check_same_output", "fold_keys", "nnx_apply", "replica_error", "parallel_apply",
]


def _dynamic(x: Any) -> bool:
    return is_array(x) or isinstance(x, (jax.core.Tracer, np.generic))


class _Dataclass:
    """Pytree stand-in for a dataclass that is not a registered pytree (fields as children)."""

    __slots__ = ("cls", "names", "values")

    def __init__(self, cls: type, names: tuple, values: tuple) -> None:
        self.cls, self.names, self.values = cls, names, values


jax.tree_util.register_pytree_node(
    _Dataclass, lambda d: (d.values, (d.cls, d.names)),
    lambda aux, ch: _Dataclass(aux[0], aux[1], tuple(ch)))


def _plain_dataclass(x: Any) -> bool:
    return (dataclasses.is_dataclass(x) and not isinstance(x, type)
            and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x)))


def _encode(x: Any) -> Any:
    if _plain_dataclass(x):
        names = tuple(f.name for f in dataclasses.fields(x) if f.init)
        return _Dataclass(type(x), names, tuple(_encode(getattr(x, n)) for n in names))
    split = None if is_array(x) else split_container(x)
    return x if split is None else split[1]([_encode(c) for c in split[0]])


def _decode(x: Any) -> Any:
    if isinstance(x, _Dataclass):
        return x.cls(**{n: _decode(v) for n, v in zip(x.names, x.values, strict=True)})
    split = None if is_array(x) else split_container(x)
    return x if split is None else split[1]([_decode(c) for c in split[0]])


def partition(tree: Any) -> tuple[list, tuple]:
    """``(arrays, key)``: the array leaves of ``tree``, and a hashable rest to rebuild it.

    Dataclasses that are not registered pytrees are looked into (their fields), as
    ``scatter`` does.
    """
    encoded = any(_plain_dataclass(x) for x in jax.tree_util.tree_leaves(tree))
    if encoded:
        tree = _encode(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dyn = [x for x in leaves if _dynamic(x)]
    static = tuple((i, x) for i, x in enumerate(leaves) if not _dynamic(x))
    for _, x in static:
        try:
            hash(x)
        except TypeError:
            raise TypeError(
                f"non-array argument {x!r} of type {type(x).__name__} is not hashable; "
                f"replicas receive non-array arguments as compile-time constants, so make "
                f"it hashable (a tuple, a frozen dataclass) or an array") from None
    return dyn, (treedef, static, encoded)


def rebuild(dyn: Sequence, key: tuple) -> Any:
    """Inverse of :func:`partition`."""
    treedef, static = key[0], key[1]
    fixed = dict(static)
    it = iter(dyn)
    leaves = [fixed[i] if i in fixed else next(it) for i in range(treedef.num_leaves)]
    tree = jax.tree_util.tree_unflatten(treedef, leaves)
    return _decode(tree) if len(key) > 2 and key[2] else tree


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def fold_keys(leaves: Sequence, index: Any) -> list:
    """``leaves`` with ``index`` folded into every typed PRNG key array."""
    return [jax.random.fold_in(x, index) if _is_key(x) else x for x in leaves]


class OutputMeta(NamedTuple):
    """How to rebuild a replica's output from the arrays a program returned.

    Attributes:
      treedef: the output's tree structure.
      static: ``(leaf index, value)`` of each non-array leaf (strings, Python objects).
      scalar: per returned array, whether it was a 0-d output unsqueezed to shape (1,).
    """

    treedef: Any
    static: tuple
    scalar: tuple


def split_output(out: Any, expand: bool, dim: int) -> tuple[list, OutputMeta]:
    leaves, treedef = jax.tree_util.tree_flatten(out)
    arrays, static, scalar = [], [], []
    for i, x in enumerate(leaves):
        if not _dynamic(x):
            static.append((i, x))
            continue
        x = jnp.asarray(x)
        if expand and x.ndim == 0:
            if dim != 0:
                raise ValueError(
                    f"a replica returned a scalar, which cannot be gathered along dim {dim}; "
                    f"return arrays with a dimension {dim}, or use dim=0")
            x = jnp.reshape(x, (1,))
            scalar.append(True)
        elif expand and x.ndim <= dim:
            raise ValueError(
                f"a replica returned an array of shape {tuple(x.shape)}, which has no "
                f"dimension {dim} to gather along; return arrays with a dimension {dim}")
        else:
            scalar.append(False)
        arrays.append(x)
    return arrays, OutputMeta(treedef, tuple(static), tuple(scalar))


def join_output(arrays: Sequence, meta: OutputMeta) -> Any:
    """Rebuild an output from its arrays and :class:`OutputMeta`."""
    return rebuild(arrays, (meta.treedef, meta.static))


def check_same_output(meta_a: OutputMeta, meta_b: OutputMeta, m: int) -> None:
    """Raise unless replica ``m``'s output (``meta_b``) is structured like replicas
    0..m-1's (``meta_a``); dicts with other keys get torch's ``gather`` error."""
    if (meta_a.treedef != meta_b.treedef or meta_a.scalar != meta_b.scalar
            or [i for i, _ in meta_a.static] != [i for i, _ in meta_b.static]):
        if meta_a.treedef != meta_b.treedef:  # dicts with other keys: torch's error
            gather([jax.tree_util.tree_unflatten(t, [0] * t.num_leaves)
                    for t in (meta_a.treedef, meta_b.treedef)], "cpu")
        raise ValueError(
            f"replica {m} returned an output structured differently from replicas 0..{m - 1} "
            f"({meta_b.treedef} vs {meta_a.treedef}); every replica must return the same "
            f"structure (dicts with the same keys, arrays in the same places)")


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


def device_label(device: Any) -> str:
    """How torch names a device in replica errors: its index (``0``), here ``Device.id``.

    ``None`` (no device given and no array to find one on) is the default device, as
    torch falls back to the current device; a multi-device sharding lists its ids.
    """
    if device is None:
        device = jax.local_devices()[0]
    if isinstance(device, jax.Device):
        return str(device.id)
    ids = sorted(d.id for d in getattr(device, "device_set", ()))
    return ", ".join(map(str, ids)) if ids else str(device)


def replica_error(exc: BaseException, index: int, device: Any) -> BaseException:
    """``exc`` re-made as torch's ``Caught <Type> in replica i on device d`` + traceback
    (``d`` the device index, as torch prints it: see :func:`device_label`)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    msg = (f"Caught {type(exc).__name__} in replica {index} on device "
           f"{device_label(device)}.\nOriginal {tb}")
    try:
        new = type(exc)(msg)
    except Exception:  # an exception type whose constructor takes other arguments
        new = RuntimeError(msg)
    new.__cause__ = exc
    return new


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


_programs = Programs()


def _device_of(tree: Any) -> Any:
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            devs = leaf.devices()
            return next(iter(devs)) if len(devs) == 1 else leaf.sharding
    return None


def _prepare(fn: Callable | None, replica: Any):
    """``(params, program, graphdef)`` for one replica."""
    if isinstance(replica, nnx.Module):
        graphdef, state = nnx.split(replica)
        return state, _programs.get(("nnx", fn, graphdef),
                                    lambda: ReplicaProgram(nnx_apply(graphdef, fn))), graphdef
    if fn is None:
        raise TypeError(
            f"parallel_apply got fn=None and a replica of type {type(replica).__name__}; "
            f"pass fn(replica, *inputs, **kwargs), or NNX modules as replicas")
    prog = _programs.get(("fn", fn), lambda: ReplicaProgram(
        lambda p, a, k: (fn(p, *a, **k), None)))
    return replica, prog, None


def _await(arrays: list, timeout: float | None, index: int, where: Any) -> None:
    if timeout is None:
        jax.block_until_ready(arrays)
        return
    deadline = time.monotonic() + timeout
    pending = [a for a in jax.tree_util.tree_leaves(arrays) if hasattr(a, "is_ready")]
    while pending:
        pending = [a for a in pending if not a.is_ready()]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"parallel_apply: replica {index} on device {where} did not finish within "
                f"{timeout} s; raise timeout= or look for a hung computation on that device")
        if pending:
            time.sleep(0.001)
    jax.block_until_ready(arrays)  # surfaces a runtime error of a finished computation


def parallel_apply(fn: Callable | None, replicas: Sequence, inputs: Sequence,
                   kwargs: Sequence | None = None, devices: Sequence | None = None,
                   timeout: float | None = None) -> list:
    """Apply ``fn(replica_i, *inputs_i, **kwargs_i)`` on every replica; outputs in order.

    Every replica's compiled program is dispatched before any result is awaited, so the
    devices work concurrently; then all results are awaited. When ``replicas`` is the
    unmodified list from :func:`replicate` and the inputs sit on the replicas' devices
    (as from :func:`scatter`), the leading replicas with equal input shapes run as ONE
    SPMD program (an error there is reported for the first of them).

    Args:
      fn: ``fn(replica, *args, **kwargs)``; None when ``replicas`` are NNX modules, which
        are then called. Programs are compiled once per ``fn`` and input signature.
      replicas: per-replica parameters (pytrees) or NNX modules (as from ``replicate``);
        an NNX replica's state updates (batch statistics) are written back to it.
      inputs: per-replica positional arguments (a tuple, or one value).
      kwargs: per-replica keyword-argument dicts, or None.
      devices: per-replica devices; when given, each replica's arguments are put there.
      timeout: seconds to wait for all results (None: no limit); on expiry a
        ``TimeoutError`` names the first unfinished replica and its device.

    Returns:
      The list of outputs, each on its replica's device.

    Raises:
      The first failing replica's exception type, as
      ``Caught <Type> in replica i on device d`` with the original traceback.
    """
    n = len(replicas)
    kwargs = [{} for _ in range(n)] if kwargs is None else list(kwargs)
    if len(inputs) != n or len(kwargs) != n:
        raise ValueError(
            f"parallel_apply needs one input and one kwargs dict per replica; got "
            f"{n} replicas, {len(inputs)} inputs and {len(kwargs)} kwargs")
    devs = resolve_devices(devices) if devices is not None else None
    if devs is not None and len(devs) != n:
        raise ValueError(f"parallel_apply got {n} replicas but {len(devs)} devices")
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout}")
    deadline = None if timeout is None else time.monotonic() + timeout
    arg_list = [tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in inputs]
    pending, errors = [], {}  # pending: (first replica, count, device, result, graphdef)
    m = _fusable(fn, replicas, arg_list, kwargs, devs)
    if m:
        where = replicas.devices[0]
        try:
            pending.append((0, m, where, _apply_fused(fn, replicas, arg_list[:m], kwargs[:m]),
                            None))
        except Exception as e:  # noqa: BLE001 - re-raised below, after all are dispatched
            errors[0] = replica_error(e, 0, where)
            pending.append((0, m, where, None, None))
    for i in range(m, n):
        rep, args, kw = replicas[i], arg_list[i], kwargs[i]
        where = devs[i] if devs is not None else (_device_of(rep) or _device_of(args))
        try:
            params, prog, graphdef = _prepare(fn, rep)
            if devs is not None:
                params, args, kw = jax.device_put((params, args, dict(kw)), devs[i])
            pending.append((i, 1, where, prog(params, args, kw), graphdef))
        except Exception as e:  # noqa: BLE001 - re-raised below, after all are dispatched
            errors[i] = replica_error(e, i, where)
            pending.append((i, 1, where, None, None))
    outs = []
    for i, count, where, result, graphdef in pending:
        if result is None:
            outs.extend([None] * count)
            continue
        arrays, aux, meta = result
        remaining = None if timeout is None else max(0.0, deadline - time.monotonic())
        try:
            _await(arrays, remaining, i, where)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001
            errors.setdefault(i, replica_error(e, i, where))
        if count > 1:
            outs.extend(_split_fused(arrays, meta, replicas.devices[:count]))
            continue
        if graphdef is not None and aux is not None:
            nnx.update(replicas[i], aux)
        outs.append(join_output(arrays, meta))
    if errors:
        raise errors[min(errors)]
    return outs


def _placed_signature(args: tuple, kwargs: dict, device: Any):
    """Hashable shapes of a replica's inputs if all its arrays sit on ``device``, else None."""
    try:
        dyn, key = partition((args, dict(kwargs)))
    except TypeError:
        return None
    for x in dyn:
        if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.ndim == 0
                or x.devices() != {device}):
            return None
    return key, tuple((x.shape, x.dtype) for x in dyn)


def _fusable(fn, replicas, arg_list: list, kwargs: list, devs) -> int:
    """How many leading replicas can run as one program (0: none, or fewer than two)."""
    if fn is None or not isinstance(replicas, Replicas) or not replicas.unchanged():
        return 0
    if devs is not None and tuple(devs) != replicas.devices:
        return 0
    first = None
    for i, (args, kw) in enumerate(zip(arg_list, kwargs, strict=True)):
        sig = _placed_signature(args, kw, replicas.devices[i])
        if sig is None or (first is not None and sig != first):
            return i if i >= 2 else 0
        first = sig
    return len(arg_list) if len(arg_list) >= 2 else 0


def _apply_fused(fn, replicas, arg_list: list, kwargs: list):
    """One SPMD program over the replicas' devices, built from their buffers (no copies)."""
    m = len(arg_list)
    mesh = mesh_for(replicas.devices[:m])
    leaves = [jax.tree_util.tree_leaves(r) for r in replicas[:m]]
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(replicas[0]), [
        jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(mesh, PartitionSpec()), [lv[j] for lv in leaves])
        for j, x in enumerate(leaves[0])])
    parts = [partition((args, dict(kw))) for args, kw in zip(arg_list, kwargs, strict=True)]
    glob = [jax.make_array_from_single_device_arrays(
        (m * x.shape[0],) + x.shape[1:], NamedSharding(mesh, dim_spec(0)),
        [p[0][j] for p in parts]) for j, x in enumerate(parts[0][0])]
    args, kw = rebuild(glob, parts[0][1])
    prog = _programs.get(("fused", fn, mesh), lambda: ReplicaProgram(
        lambda p, a, k: (fn(p, *a, **k), None), mesh=mesh))
    return prog(params, args, kw)


def _split_fused(arrays: list, meta: OutputMeta, devices: tuple) -> list:
    """Per-replica outputs (zero-copy shards) of a fused program's global outputs."""
    by_dev = [{s.device: s.data for s in a.addressable_shards} for a in arrays]
    return [join_output([jnp.reshape(bd[d], ()) if scalar else bd[d]
                         for bd, scalar in zip(by_dev, meta.scalar, strict=True)], meta)
            for d in devices]
