"""``FunctionalDDP``: DDP for Linen modules and plain parameter pytrees.

The functional entry point holds ``params`` (any pytree of arrays), optional ``buffers``
(e.g. Linen's ``batch_stats``) and an optax state, and runs the same engine as the NNX
wrapper. Loss functions take the arrays explicitly::

    variables = linen_model.init(key, x)
    ddp = FunctionalDDP(variables["params"])
    step = ddp.train_step(
        lambda p, b: loss(linen_model.apply({"params": p}, b["x"]), b["y"]),
        optax.sgd(0.1))
    for batch in loader:
        step(batch)                      # updates ddp.params and ddp.opt_state

With ``buffers``, functions take and return them:
``loss_fn(params, buffers, batch, *args) -> (loss, new_buffers)`` and
``apply_fn(params, buffers, *inputs) -> (outputs, new_buffers)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jdist.collectives.runtime import ProcessGroup
from jdist.ddp._ddp import leaf_infos
from jdist.ddp._shell import EngineShell
from jdist.ddp._untouched import keep_untouched

__all__ = ["FunctionalDDP"]


class FunctionalDDP(EngineShell):
    """DDP over explicit parameter pytrees (Linen, Equinox arrays, hand-written models).

    Args:
      params: the trainable parameters (a pytree of arrays).
      buffers: optional non-trained state threaded through loss and apply functions.
      Other arguments: as :class:`DistributedDataParallel`.
    """

    def __init__(self, params: Any, *, buffers: Any = None,
                 process_group: ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 init_sync: bool = True, comm_hook: Any = None,
                 compiler_options: dict | None = None, flat_buckets: bool | None = None,
                 forward_sync_buffers: bool | None = None,
                 bucket_cap_mb_list: list[float] | None = None):
        self._has_buffers = buffers is not None
        self.params, self.buffers, _ = self._start(
            leaf_infos(params), params, buffers, process_group=process_group,
            bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers, init_sync=init_sync, comm_hook=comm_hook,
            compiler_options=compiler_options, flat_buckets=flat_buckets,
            forward_sync_buffers=forward_sync_buffers, bucket_cap_mb_list=bucket_cap_mb_list)
        self.opt_state: Any = None

    def _model_trees(self) -> tuple[Any, Any]:
        """The parameters and buffers, for the join post-hook."""
        return self.params, self.buffers

    def _load_model_trees(self, params: Any, buffers: Any) -> None:
        """Write the join post-hook's values back (``buffers`` ``None``: kept)."""
        self.params = params
        if buffers is not None:
            self.buffers = buffers

    def _pure(self, loss_fn: Callable, has_aux: bool) -> Callable:
        with_buffers = self._has_buffers

        def pure(params, buffers, batch, extra):
            if with_buffers:
                out, new_buffers = loss_fn(params, buffers, batch, *extra)
            else:
                out, new_buffers = loss_fn(params, batch, *extra), None
            value, aux = out if has_aux else (out, None)
            return value, (aux, new_buffers)

        return pure

    def value_and_grad(self, loss_fn: Callable, has_aux: bool = False) -> Callable:
        """``f(batch, *args) -> (loss, grads)``; see :meth:`DistributedDataParallel.value_and_grad`."""  # noqa: E501

        def f(batch, *args):
            self._engine.remember(f, batch, args)
            out = self._engine.grad_step(("vg", loss_fn, has_aux), self._pure(loss_fn, has_aux),
                                         self.params, self.buffers, batch, args)
            if self._has_buffers:
                self.buffers = out["buffers"]
            value = (out["loss"], out["aux"]) if has_aux else out["loss"]
            return value, out["grads"]

        return self._joinable_step(f)  # numbered for join

    def train_step(self, loss_fn: Callable, tx: optax.GradientTransformation,
                   has_aux: bool = False, donate: bool = True) -> Callable:
        """``step(batch, *args) -> loss`` updating ``self.params`` and ``self.opt_state``.

        ``donate``: as :meth:`DistributedDataParallel.train_step`: a step consumes the
        arrays DDP made that it replaces (``self.params`` and ``self.opt_state`` after
        a step or the init sync); read the new ones from ``self.params``."""

        def update(p, grads, opt_state, buffers, skip=()):
            del buffers
            updates, new_opt = tx.update(grads, opt_state, p)
            # parameters without a gradient: untouched, as torch's optimizers
            return keep_untouched(skip, p, optax.apply_updates(p, updates), opt_state,
                                  new_opt)

        def step(batch, *args):
            self._engine.remember(step, batch, args)
            if self.opt_state is None:
                self.opt_state = tx.init(self.params)
                self._engine.donation.made(self.opt_state)
            out = self._engine.grad_step(("train", loss_fn, tx, has_aux),
                                         self._pure(loss_fn, has_aux), self.params,
                                         self.buffers, batch, args, update=update,
                                         opt_state=self.opt_state, donate=donate)
            if self._has_buffers:
                self.buffers = out["buffers"]
            if self._engine.require_backward_grad_sync:
                self.params, self.opt_state = out["params"], out["opt_state"]
            return (out["loss"], out["aux"]) if has_aux else out["loss"]

        return self._joinable_step(step)  # numbered for join

    def apply(self, apply_fn: Callable) -> Callable:
        """``f(*inputs) -> outputs``: ``apply_fn(params, *inputs)`` over the split batch."""
        with_buffers = self._has_buffers

        def pure(p, b, xs):
            if with_buffers:
                return apply_fn(p, b, *xs)
            return apply_fn(p, *xs), None

        def f(*inputs):
            out, new_buffers = self._engine.forward(("apply", apply_fn), pure, self.params,
                                                    self.buffers, tuple(inputs))
            if with_buffers:
                self.buffers = new_buffers
            return out

        return f
