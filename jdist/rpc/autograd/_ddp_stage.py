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
  of ``x`` is returned to whatever produced ``x`` (for example a remote embedding).

The value is this process's loss (the mean over its replicas), as torch's local loss;
DDP's own returned loss is the mean over all replicas. ``rest`` (targets) is not
differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jdist.errors import DistAutogradError
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._params import param_variables

__all__ = ["ddp_stage"]


def ddp_stage(ddp: Any, loss_fn: Callable) -> Callable:
    """``stage(x, *rest) -> loss`` running ``loss_fn(module, x, *rest)`` under DDP.

    Args:
      ddp: a :class:`jdist.ddp.DistributedDataParallel` (its process group may be a
        sub-group, e.g. the trainers of a parameter-server job).
      loss_fn: ``loss_fn(module, x, *rest)`` -> float scalar for one replica's shard.

    Returns:
      ``stage(x, *rest)``; call it inside ``dist_autograd.backward``'s loss function.
    """
    from jdist.ddp import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"ddp_stage needs a jdist.ddp.DistributedDataParallel, got "
                        f"{type(ddp).__name__}")

    def inner(module, batch):
        rest = batch["rest"]

        def local(x):
            return loss_fn(module, x, *rest)

        value, gx = jax.value_and_grad(local)(batch["x"])
        return value, (value, gx)

    vg = ddp.value_and_grad(inner, has_aux=True)
    variables = param_variables(ddp.module)

    def stage(x: Any, *rest: Any) -> Any:
        ctx = C.current()
        token = C.tracing()
        if ctx is None or token is None:
            raise DistAutogradError("a ddp_stage is differentiable only inside a "
                                    "dist_autograd.backward loss function")
        rest_c = tuple(jax.lax.stop_gradient(r) for r in rest)
        box: dict = {}

        def forward(xv):
            (_, (losses, gx)), grads = vg({"x": jnp.asarray(xv), "rest": rest_c})
            losses, gx = _local(losses), _local(gx)
            k = losses.shape[0]  # local replicas
            box["grads"] = [_local(g) for g in jax.tree_util.tree_leaves(grads)]
            box["gx"] = gx.reshape((-1,) + gx.shape[2:]) / k
            return jnp.mean(losses)

        @jax.custom_vjp
        def run(tok, xv):
            del tok
            return forward(xv)

        def fwd(tok, xv):
            del tok
            return forward(xv), None

        def bwd(_, ct):
            grads = box.pop("grads")
            if len(grads) != len(variables):  # pragma: no cover - NNX layout
                raise RuntimeError("DDP gradients and module parameters disagree")
            for var, g in zip(variables, grads, strict=True):
                ctx.accumulate(var, g * _beside(ct, g))
            return jnp.zeros((), token.dtype), (box.pop("gx") * ct).astype(x.dtype)

        run.defvjp(fwd, bwd)
        return run(token, x)

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
