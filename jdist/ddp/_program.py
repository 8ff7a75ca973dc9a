"""The jitted ``shard_map`` programs that DDP runs: grad step, train step, forward.

A program is built from pure pieces supplied by the shell (NNX or functional):

- ``loss(params, buffers, batch, extra) -> (scalar, (aux, new_buffers))`` for one replica;
- ``apply(params, buffers, inputs) -> (outputs, new_buffers)`` for the forward;
- ``update(params, grads, opt_state, buffers) -> (params, opt_state)`` for the train step.

Layouts over the replica axis (see :mod:`jdist.ddp._placement`): params, optimizer state
and extra arguments replicated; batch split; buffers, hook state and accumulated
gradients per replica (leading axis). Static switches: ``sync`` (reduce gradients, else
accumulate them locally with no collective at all, as under ``no_sync()``) and
``sync_buffers`` (take every buffer from replica 0 first, torch's ``broadcast_buffers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jdist.ddp._buckets import BucketLayout
from jdist.ddp._reducer import reduced_value_and_grad, to_varying

__all__ = ["Config", "broadcast_from_first", "grad_program", "forward_program",
           "ready_order_program"]


class Config(NamedTuple):
    """Static settings of a DDP program."""

    mesh: Any
    axis: str
    num_replicas: int
    layout: BucketLayout
    hook: Callable
    find_unused: bool
    compiler_options: dict | None = None


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def broadcast_from_first(tree: Any, axis: str) -> Any:
    """Inside ``shard_map``: every replica takes replica 0's value (any dtype)."""
    first = jax.lax.axis_index(axis) == 0

    def one(x):
        if _is_key(x):
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(one(jax.random.key_data(x)), impl=impl)
        dt = x.dtype
        v = x.astype(jnp.int32) if dt == jnp.bool_ else x
        v = jax.lax.psum(jnp.where(first, v, jnp.zeros_like(v)), axis)
        return v.astype(dt)

    return jax.tree.map(one, tree)


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _expand(tree, axis):
    return jax.tree.map(lambda x: to_varying(x, axis)[None], tree)


def grad_program(cfg: Config, loss: Callable, update: Callable | None, *, sync: bool,
                 sync_buffers: bool, has_acc: bool) -> Callable:
    """``f(params, buffers, hstate, acc, opt_state, batch, extra) -> outputs`` (jitted).

    Outputs ``(loss, aux, grads, buffers, hstate, acc, params, opt_state)``: ``loss`` is
    the replica mean when ``sync`` else per replica; ``grads`` reduced (``None`` when not
    ``sync``); ``acc`` the local accumulated gradients when not ``sync`` (else ``None``);
    ``params``/``opt_state`` updated when ``update`` is given and ``sync``.
    """
    ax = cfg.axis

    def body(params, buffers, hstate, acc, opt_state, batch, extra):
        buffers, hstate = _squeeze(buffers), _squeeze(hstate)
        acc = _squeeze(acc) if has_acc else None
        if sync_buffers:
            buffers = broadcast_from_first(buffers, ax)

        def f(p, b, x, e):
            return loss(p, b, x, e)

        if sync:
            (value, (aux, new_buffers)), grads, hstate = reduced_value_and_grad(
                f, params, (buffers, batch, extra), layout=cfg.layout, hook=cfg.hook,
                hook_state=hstate, acc=acc, axis=ax, num_replicas=cfg.num_replicas,
                find_unused=cfg.find_unused)
            value = jax.lax.pmean(value, ax)
            new_acc = None
            if update is not None:
                params, opt_state = update(params, grads, opt_state, buffers)
        else:
            pv = to_varying(params, ax)
            (value, (aux, new_buffers)), local = jax.value_and_grad(
                lambda p: f(p, buffers, batch, extra), has_aux=True)(pv)
            new_acc = local if acc is None else jax.tree.map(jnp.add, acc, local)
            grads = None
            value = to_varying(value, ax)[None]
        if update is None or not sync:
            params = opt_state = None  # unchanged: do not copy them out
        return (value, _expand(aux, ax), grads, _expand(new_buffers, ax),
                _expand(hstate, ax), None if new_acc is None else _expand(new_acc, ax),
                params, opt_state)

    rep, row = P(), P(ax)
    in_specs = (rep, row, row, row, rep, row, rep)
    out_specs = (rep if sync else row, row, rep, row, row, row, rep, rep)
    return jax.jit(jax.shard_map(body, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=True), compiler_options=cfg.compiler_options or None)


def forward_program(cfg: Config, apply: Callable, *, sync_buffers: bool) -> Callable:
    """``f(params, buffers, inputs) -> (outputs, buffers)`` (jitted, batch split)."""
    ax = cfg.axis

    def body(params, buffers, inputs):
        buffers = _squeeze(buffers)
        if sync_buffers:
            buffers = broadcast_from_first(buffers, ax)
        out, new_buffers = apply(params, buffers, inputs)
        return to_varying(out, ax), _expand(new_buffers, ax)

    row = P(ax)
    return jax.jit(jax.shard_map(body, mesh=cfg.mesh, in_specs=(P(), row, row),
                                 out_specs=(row, row), check_vma=True),
                   compiler_options=cfg.compiler_options or None)


def ready_order_program(cfg: Config, loss: Callable, record: Callable) -> Callable:
    """``f(params, buffers, batch, extra)`` whose *tracing* records the ready order.

    ``record(params, args)`` is called inside the ``shard_map`` at trace time (see
    :func:`jdist.ddp._reducer.record_ready_order`); run it under ``jax.eval_shape``.
    """
    ax = cfg.axis

    def body(params, buffers, batch, extra):
        record(lambda p, b, x, e: loss(p, b, x, e), params, (_squeeze(buffers), batch, extra))
        return jnp.zeros((), jnp.float32)

    row = P(ax)
    return jax.shard_map(body, mesh=cfg.mesh, in_specs=(P(), row, row, P()), out_specs=P(),
                         check_vma=True)
