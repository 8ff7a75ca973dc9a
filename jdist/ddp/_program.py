"""The jitted ``shard_map`` programs that DDP runs: grad step, train step, forward.

A program is built from pure pieces supplied by the shell (NNX or functional):

- ``loss(params, buffers, batch, extra) -> (scalar, (aux, new_buffers))`` for one replica;
- ``apply(params, buffers, inputs) -> (outputs, new_buffers)`` for the forward;
- ``update(params, grads, opt_state, buffers, skip) -> (params, opt_state)`` for the train
  step (``skip``: leaf indices of the parameters without a gradient, left untouched).

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
from jdist.ddp._reducer import local_value_and_grad, reduced_value_and_grad, to_varying

__all__ = ["Config", "JoinMode", "broadcast_from_first", "grad_program", "forward_program",
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
    flat_buckets: bool = False


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def broadcast_from_first(tree: Any, axis: str) -> Any:
    """Inside ``shard_map``: every replica takes replica 0's value (any dtype)."""
    return _broadcast_from(tree, axis, 0)


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _expand(tree, axis):
    return jax.tree.map(lambda x: to_varying(x, axis)[None], tree)


def _broadcast_from(tree: Any, axis: str, src) -> Any:
    """Every replica takes replica ``src``'s value (``src`` replicated int)."""
    mine = jax.lax.axis_index(axis) == src

    def one(x):
        if _is_key(x):
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(one(jax.random.key_data(x)), impl=impl)
        v = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
        return jax.lax.psum(jnp.where(mine, v, jnp.zeros_like(v)), axis).astype(x.dtype)

    return jax.tree.map(one, tree)


def _keep_where(ok, new, old):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


class JoinMode(NamedTuple):
    """Static join() settings of a program (see :mod:`jdist.ddp._join`)."""

    divide_by_initial_world_size: bool
    throw_on_early_termination: bool


def grad_program(cfg: Config, loss: Callable, update: Callable | None, *, sync: bool,
                 sync_buffers: bool, has_acc: bool, join: JoinMode | None = None,
                 opt_specs: Any = None, had_grad: frozenset = frozenset(),
                 record: dict | None = None, donate: bool = False) -> Callable:
    """``f(params, buffers, hstate, acc, opt_state, batch, extra, active) -> outputs``.

    Outputs ``(loss, aux, grads, buffers, hstate, acc, params, opt_state, n_active)``:
    ``loss`` is the replica mean when ``sync`` else per replica; ``grads`` reduced (``None``
    when not ``sync`` or when ``update`` consumed them); ``acc`` the local accumulated
    gradients when not ``sync`` (else ``None``); ``params``/``opt_state`` updated when
    ``update`` is given and ``sync`` (else ``None``). Under ``join``, ``active`` holds 1.0
    for replicas that still have inputs (0.0 for the others, whose gradients count as zeros
    and whose buffers are kept) and ``n_active`` is their number; otherwise both are
    ``None``. ``opt_specs`` (PartitionSpecs, e.g. a ZeRO optimizer's) shard ``opt_state``
    in and out instead of replicating it.

    Parameters without a gradient (the loss does not reach them: symbolic zeros) are
    found at trace time and written to ``record["unused"]`` (leaf indices). ``donate``
    (with ``update`` and ``sync``): ``params``, ``hstate`` and ``opt_state`` are donated
    to the outputs replacing them; ``acc`` is donated whenever given. The update
    leaves those untouched (``_untouched.py``, torch's ``grad is None``) unless they are
    in ``had_grad``: the parameters that got gradients in the accumulated ``no_sync``
    steps.
    """
    ax, nrep = cfg.axis, cfg.num_replicas
    record = {} if record is None else record

    def body(params, buffers, hstate, acc, opt_state, batch, extra, active):
        buffers, hstate = _squeeze(buffers), _squeeze(hstate)
        acc = _squeeze(acc) if has_acc else None
        scale = post = n_active = None
        if join is not None:
            scale = active[0]
            n_active = jax.lax.psum(scale, ax)
            if not join.divide_by_initial_world_size:
                post = nrep / jnp.maximum(n_active, 1.0)
        if sync_buffers:
            if join is None:
                buffers = broadcast_from_first(buffers, ax)
            else:  # torch: the highest replica that still has inputs is the source
                idx = jnp.where(scale > 0, jax.lax.axis_index(ax), -1)
                buffers = _broadcast_from(buffers, ax, jnp.maximum(jax.lax.pmax(idx, ax), 0))
        old_buffers = buffers

        unused: list[int] = []
        if sync:
            (value, (aux, new_buffers)), grads, hstate = reduced_value_and_grad(
                loss, params, (buffers, batch, extra), layout=cfg.layout, hook=cfg.hook,
                hook_state=hstate, acc=acc, axis=ax, num_replicas=nrep,
                find_unused=cfg.find_unused, scale=scale, post=post, flat=cfg.flat_buckets,
                mean_loss=join is None,  # the mean rides in the last bucket's all-reduce
                unused_out=unused)
            record["unused"] = tuple(unused)
            if join is not None:
                value = jax.lax.psum(value * scale, ax) / jnp.maximum(n_active, 1.0)
            new_acc = None
            if update is not None:
                skip = tuple(j for j in unused if j not in had_grad)
                new_params, new_opt = update(params, grads, opt_state, buffers, skip)
                if join is not None:
                    ok = n_active > 0
                    if join.throw_on_early_termination:
                        ok = n_active >= nrep
                    new_params = _keep_where(ok, new_params, params)
                    new_opt = _keep_where(ok, new_opt, opt_state)
                params, opt_state = new_params, new_opt
        else:
            pv = to_varying(params, ax)
            (value, (aux, new_buffers)), local = local_value_and_grad(
                lambda p: loss(p, buffers, batch, extra), pv, ax, unused)
            record["unused"] = tuple(unused)
            if scale is not None:
                local = jax.tree.map(lambda g: g * scale.astype(g.dtype), local)
            new_acc = local if acc is None else jax.tree.map(jnp.add, acc, local)
            grads = None
            value = to_varying(value, ax)[None]
        if join is not None:
            new_buffers = _keep_where(scale > 0, new_buffers, old_buffers)
        if update is None or not sync:
            params = opt_state = None  # unchanged: do not copy them out
        else:
            grads = None  # consumed by the update: do not copy them out
        return (value, _expand(aux, ax), grads, _expand(new_buffers, ax),
                _expand(hstate, ax), None if new_acc is None else _expand(new_acc, ax),
                params, opt_state, n_active)

    rep, row = P(), P(ax)
    ospec = rep if opt_specs is None else opt_specs
    in_specs = (rep, row, row, row, ospec, row, rep, row)
    out_ospec = ospec if update is not None and sync else rep  # else the output is None
    out_specs = (rep if sync else row, row, rep, row, row, row, rep, out_ospec, rep)
    donated = ((0, 2, 4) if donate and update is not None and sync else ()) + \
        ((3,) if has_acc else ())
    return jax.jit(jax.shard_map(body, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=True), compiler_options=cfg.compiler_options or None,
                   donate_argnums=donated)


def forward_program(cfg: Config, apply: Callable, *, sync_buffers: bool) -> Callable:
    """``f(params, buffers, inputs) -> (outputs, buffers)`` (jitted, batch split).

    Output leaves are concatenated over replicas along their first axis; a scalar output
    (one replica's loss, torch's ``(logits, loss)`` modules) gets a leading axis of one
    entry per replica first. The returned function's ``scalars`` attribute, set when it
    is traced, lists which output leaves were scalars.
    """
    ax = cfg.axis
    scalars: list[bool] = []

    def body(params, buffers, inputs):
        buffers = _squeeze(buffers)
        if sync_buffers:
            buffers = broadcast_from_first(buffers, ax)
        out, new_buffers = apply(params, buffers, inputs)
        scalars[:] = [jnp.ndim(x) == 0 for x in jax.tree.leaves(out)]
        out = jax.tree.map(lambda x: x[None] if jnp.ndim(x) == 0 else x, to_varying(out, ax))
        return out, _expand(new_buffers, ax)

    row = P(ax)
    prog = jax.jit(jax.shard_map(body, mesh=cfg.mesh, in_specs=(P(), row, row),
                                 out_specs=(row, row), check_vma=True),
                   compiler_options=cfg.compiler_options or None)

    def run(*args):
        return prog(*args)

    run.scalars = scalars
    return run


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
