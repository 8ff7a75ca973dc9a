"""A DDP-wrapped module as one differentiable stage of a distributed autograd pass.

torch's HybridModel puts a DDP module inside a distributed autograd pass: during
``dist_autograd.backward`` DDP's hooks all-reduce the module's gradients, which land in
the context, while the gradient of the module's input travels on by RPC. Here
:func:`ddp_stage` wraps a :class:`~jdist.ddp.DistributedDataParallel` and a loss
``loss_fn(module, x, *rest)`` into ``stage(x, *rest) -> loss``, usable inside a
``dist_autograd.backward`` loss function:

- forward: one DDP step (``ddp.value_and_grad``): its parameter gradients are reduced
  over the DDP group bucket by bucket inside the backward program, as always; the
  gradient of ``x`` is computed in the same program (per replica, not reduced);
- backward: the parameter gradients (times the incoming cotangent) are added to the
  context on this worker, keyed by the DDP module's ``nnx.Param`` s, and the gradient
  of ``x`` is returned to whatever produced ``x`` (for example a remote embedding); an
  integer ``x`` (indices into an embedding held by the DDP module) has none.

:func:`ddp_layer` is a DDP module anywhere else in the pass (its output not a loss).

The value is this process's loss (the mean over its replicas), as torch's local loss;
DDP's own returned loss is the mean over all replicas. ``rest`` (targets) is not
differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.errors import DistAutogradError
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._params import param_variables
from jdist.rpc.autograd._slots import to_array
from jdist.rpc.autograd._vjp_ops import custom_vjp_of

__all__ = ["ddp_layer", "ddp_stage"]


def _check_ddp(ddp: Any, who: str) -> None:
    from jdist.ddp import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"{who} needs a jdist.ddp.DistributedDataParallel, got "
                        f"{type(ddp).__name__}")


def _pad_sizes(ddp: Any, pad_batch_to: Any) -> Any:
    if pad_batch_to is None:
        return None
    from jdist.ddp.padding import PadSizes

    if not isinstance(pad_batch_to, (int, np.integer)) or isinstance(pad_batch_to, bool):
        raise TypeError(f"ddp_stage(pad_batch_to=) must be one int (the same on every "
                        f"process of the DDP group), got {pad_batch_to!r}")
    g = ddp.process_group
    return PadSizes(int(pad_batch_to), len(g.local_devices), g.size())


def _enter(who: str) -> tuple[Any, Any]:
    """The current context and trace token; a stage runs only inside a backward."""
    ctx, token = C.current(), C.tracing()
    if ctx is None or token is None:
        raise DistAutogradError(f"a {who} is differentiable only inside a "
                                "dist_autograd.backward loss function")
    C.spoil_capture(f"a {who}")  # a compiled loss function runs no DDP stage
    return ctx, token


def _accumulate(ctx: Any, variables: list, grads: list, ct: Any = None) -> None:
    """DDP's reduced gradients (times the cotangent ``ct``) into the context."""
    if len(grads) != len(variables):  # pragma: no cover - NNX layout
        raise RuntimeError("DDP gradients and module parameters disagree")
    for var, g in zip(variables, grads, strict=True):
        ctx.accumulate(var, g if ct is None else g * _beside(ct, g))


def _per_row_loss(ddp: Any, out: Any, batch: dict, count: tuple) -> Any:
    """This replica's share of the process's mean over its real (unpadded) rows."""
    mask = batch["mask"]
    per = jnp.asarray(out)
    if per.shape != mask.shape:
        raise ValueError(
            f"ddp_stage(pad_batch_to=...): loss_fn must return one loss per row "
            f"(shape {tuple(mask.shape)} for this replica's shard), got shape "
            f"{tuple(per.shape)}; return e.g. the per-example cross entropy without .mean()")
    k = jax.lax.axis_size(ddp.process_group.axis_name) / count[1]
    return jnp.sum(per * mask.astype(per.dtype)) * (k / count[0])


def _stage_program(ddp: Any, loss_fn: Callable, sizes: Any) -> Callable:
    """DDP's ``value_and_grad`` of the loss, with the gradient of ``x`` as aux."""

    def inner(module, batch, *count):
        def local(x):
            out = loss_fn(module, x, *batch["rest"])
            return out if sizes is None else _per_row_loss(ddp, out, batch, count)

        if not jnp.issubdtype(batch["x"].dtype, jnp.inexact):  # indices: no gradient
            value = local(batch["x"])
            return value, (value, jnp.zeros((), value.dtype))
        value, gx = jax.value_and_grad(local)(batch["x"])
        return value, (value, gx)

    return ddp.value_and_grad(inner, has_aux=True)


def _run_stage(vg: Callable, ddp: Any, sizes: Any, xv: Any, rest: tuple) -> tuple:
    """One DDP step on ``xv``: ``(this process's loss, gradients, gradient of x)``."""
    if sizes is None:
        (_, (losses, gx)), grads = vg({"x": jnp.asarray(xv), "rest": rest})
        n = None
    else:
        from jdist.ddp.padding import pad_batch

        xv = np.asarray(xv)
        n = xv.shape[0]
        padded, mask = pad_batch({"x": xv, "rest": tuple(np.asarray(r) for r in rest)},
                                 sizes)
        padded["mask"] = mask
        (_, (losses, gx)), grads = vg(padded, np.float32(n),
                                      np.float32(ddp.process_group.size()))
    losses, gx = _local(losses), np.asarray(_local(gx))
    k = losses.shape[0]  # local replicas
    gx = gx.reshape((-1,) + gx.shape[2:]) / np.asarray(k, gx.dtype)
    grads = [_local(g) for g in jax.tree_util.tree_leaves(grads)]
    return jnp.mean(losses), grads, gx if n is None else gx[:n]  # numpy: no program per shape


def _x_cotangent(x: Any, token: Any, gx: Any, ct: Any) -> tuple:
    if not jnp.issubdtype(x.dtype, jnp.inexact):  # integer input: float0 cotangent
        return np.zeros((), token.dtype), np.zeros(np.shape(x), jax.dtypes.float0)
    return np.zeros((), token.dtype), to_array((gx * np.asarray(ct, gx.dtype)).astype(x.dtype))


def ddp_stage(ddp: Any, loss_fn: Callable, *, pad_batch_to: int | None = None) -> Callable:
    """``stage(x, *rest) -> loss`` running ``loss_fn(module, x, *rest)`` under DDP.

    Args:
      ddp: a :class:`jdist.ddp.DistributedDataParallel` (its process group may be a
        sub-group, e.g. the trainers of a parameter-server job).
      loss_fn: ``loss_fn(module, x, *rest)`` -> float scalar for one replica's shard.
      pad_batch_to: shape buckets (every new batch size compiles a new DDP program):
        ``x`` and every ``rest`` leaf (same leading size) are padded with zero rows to
        this many rows, and ``loss_fn`` returns one loss per row instead of a scalar;
        the stage's value and gradients are exactly those of the mean over the real
        rows (modules that mix rows, like batch statistics, see the padding). One int,
        the same on every process of the DDP group (their programs must match), a
        multiple of the local devices.

    Returns:
      ``stage(x, *rest)``; call it inside ``dist_autograd.backward``'s loss function.
    """
    _check_ddp(ddp, "ddp_stage")
    sizes = _pad_sizes(ddp, pad_batch_to)
    vg = _stage_program(ddp, loss_fn, sizes)
    variables = param_variables(ddp.module)

    def stage(x: Any, *rest: Any) -> Any:
        ctx, token = _enter("ddp_stage")
        rest_c = tuple(jax.lax.stop_gradient(r) for r in rest)
        box: dict = {}

        def run(tok, xv):
            del tok
            loss, box["grads"], box["gx"] = _run_stage(vg, ddp, sizes, xv, rest_c)
            return loss

        def fwd(tok, xv):
            return run(tok, xv), None

        def bwd(_, ct):
            _accumulate(ctx, variables, box.pop("grads"), ct)
            return _x_cotangent(x, token, box.pop("gx"), ct)

        return custom_vjp_of(run, fwd, bwd)(token, x)

    return stage


def _beside(ct: Any, g: Any) -> Any:
    """The cotangent ``ct`` on gradient ``g``'s devices: DDP returns the gradient of a
    parameter committed to one device on that device, while ``ct`` is replicated."""
    if (isinstance(ct, jax.core.Tracer) or isinstance(g, jax.core.Tracer)
            or not isinstance(g, jax.Array) or not isinstance(ct, jax.Array)
            or ct.sharding == g.sharding):
        return ct
    return jax.device_put(ct, g.sharding)


def _local(x: Any) -> Any:
    """This process's copy of a (replicated or per-local-replica) DDP output."""
    if getattr(x, "is_fully_addressable", True):
        return x
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    if len(shards) == 1 or all(s.index == shards[0].index for s in shards):
        return jnp.asarray(shards[0].data)  # replicated: any local copy
    return jnp.concatenate([jnp.asarray(s.data) for s in shards])


def ddp_layer(ddp: Any, fn: Callable | None = None) -> Callable:
    """``layer(x, *rest) -> fn(module, x, *rest)``: a DDP module in the middle of a pass.

    torch's DDP module anywhere in a distributed autograd pass (a HybridModel wrapped
    in DDP as a whole, whose RPCs sit between its local layers): the forward runs the
    module on this process's batch (no collective); the backward, given the cotangent
    of the output, runs one DDP step (``ddp.value_and_grad``) of ``<fn(module, x),
    cotangent>``, so the parameter gradients are reduced over the DDP group (each
    process's gradient averaged over the processes, as torch's), added to the context
    on this worker, and the gradient of ``x`` (this process's, not reduced) goes on to
    whatever produced ``x``. Use :func:`ddp_stage` for the last stage (the loss).

    Every process of the DDP group must run its layers' backward passes in the same
    order (each one is a collective), as in torch. ``rest`` is not differentiated.

    Args:
      ddp: a :class:`jdist.ddp.DistributedDataParallel`.
      fn: ``fn(module, x, *rest)`` -> array with ``x``'s leading size; default
        ``module(x)``.
    """
    _check_ddp(ddp, "ddp_layer")
    call = _module_call if fn is None else fn
    k = len(ddp.process_group.local_devices)

    def inner(module, batch):
        def local(x):  # k times this shard's share: DDP divides by every replica
            return jnp.sum(call(module, x, *batch["rest"]) * batch["ct"]) * k

        value, gx = jax.value_and_grad(local)(batch["x"])
        return value, gx

    vg = ddp.value_and_grad(inner, has_aux=True)
    variables = param_variables(ddp.module)

    def layer(x: Any, *rest: Any) -> Any:
        ctx, token = _enter("ddp_layer")
        rest_c = tuple(jax.lax.stop_gradient(r) for r in rest)
        box: dict = {}

        def run(tok, xv):
            del tok
            return call(ddp.module, jnp.asarray(xv), *rest_c)

        def fwd(tok, xv):
            box["x"] = xv
            return run(tok, xv), None

        def bwd(_, ct):
            (_, gx), grads = vg({"x": jnp.asarray(box.pop("x")), "ct": jnp.asarray(ct),
                                 "rest": rest_c})
            _accumulate(ctx, variables, [_local(g) for g in jax.tree_util.tree_leaves(grads)])
            gx = np.asarray(_local(gx))
            gx = gx.reshape((-1,) + gx.shape[2:]) / np.asarray(k, gx.dtype)
            return np.zeros((), token.dtype), to_array(gx.astype(x.dtype))

        return custom_vjp_of(run, fwd, bwd)(token, x)

    return layer


def _module_call(module: Any, x: Any, *rest: Any) -> Any:
    return module(x, *rest)
