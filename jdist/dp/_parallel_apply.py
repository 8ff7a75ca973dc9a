"""torch's ``parallel_apply``: run every replica, dispatched before any is awaited.

:func:`parallel_apply` runs ``fn`` over a list of replicas: every replica's program is
dispatched (JAX runs them asynchronously) before any result is awaited, and an exception
in replica ``i`` is re-raised as ``Caught <Type> in replica i on device d`` followed by
the original traceback (:func:`replica_error`). Given the unmodified list ``replicate``
returned and inputs placed on the replicas' devices (as ``scatter`` places them), the
leading replicas with equal input shapes run as one SPMD program assembled from their
buffers without copies (the fused form of :mod:`jdist.dp._programs`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jdist.dp._programs import Programs, ReplicaProgram, nnx_apply
from jdist.dp._replicate import Replicas
from jdist.dp._scatter_gather import dim_spec, mesh_for, resolve_devices
from jdist.dp._trees import OutputMeta, join_output, partition, rebuild

__all__ = ["device_label", "replica_error", "parallel_apply"]


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
