"""``DataParallel`` and ``data_parallel``: torch's API over the pipeline of ``_pipeline``.

The pipeline (scatter -> replicate -> parallel_apply -> gather, the equal chunks fused
into one compiled program) is :func:`jdist.dp._pipeline.apply_data_parallel`; this file
holds the module wrapper and the functional form, the direct call for one device or one
chunk, and writes replica 0's state updates back to an NNX module. Every step is a
differentiable JAX operation, so ``jax.grad`` / ``nnx.grad`` through a DataParallel
forward equals the single-device gradient of the same loss; gradients land where the
parameters live (``device_ids[0]`` by default, as in torch, whose backward reduce-adds
them there).

State updates (BatchNorm statistics, RNG counts, sown values) follow torch: every
replica computes its own from its chunk, and replica 0's update is written back to the
module (torch keeps it because only the device-0 replica shares the module's buffers).
Use ``jdist.ddp.convert_sync_batchnorm`` for statistics over the whole batch.

Inside your own ``jax.jit`` (or ``vmap``) the same semantics hold (each replica's forward
sees exactly its chunk), computed as a ``vmap`` over replicas; placement across devices is
then the outer ``jit``'s (use it eagerly, or ``jdist.ddp``, for device parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jdist.dp._fused import value_and_grad as fused_value_and_grad
from jdist.dp._pipeline import Runtime, apply_data_parallel, default_runtime, is_concrete_tree
from jdist.dp._programs import nnx_apply
from jdist.dp._scatter_gather import (
    is_array,
    resolve_devices,
    resolve_target,
)

__all__ = ["DataParallel", "data_parallel"]


def _unpack(module: Any) -> tuple[Callable, Any]:
    if isinstance(module, tuple) and len(module) == 2 and callable(module[0]):
        return module
    raise TypeError(
        f"DataParallel wraps a flax.nnx.Module or an (apply_fn, params) pair with "
        f"apply_fn(params, *inputs, **kwargs); got {type(module).__name__}: {module!r:.200}")


def _direct(call: Callable, args: tuple, kwargs: dict, devices: tuple, output_device):
    """One device or one chunk: call the module itself (inputs on ``device_ids[0]``)."""
    if not is_concrete_tree((args, kwargs)):
        return call(*args, **kwargs)
    args, kwargs = _move_arrays((tuple(args), dict(kwargs)), devices[0])
    out = call(*args, **kwargs)
    return _move_arrays(out, output_device) if is_concrete_tree(out) else out


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
                        default_runtime)
    apply_fn, params = _unpack(module)
    return _forward(apply_fn, inputs, kwargs, devices, out_dev, _check_dim(dim),
                    default_runtime, params=params)
