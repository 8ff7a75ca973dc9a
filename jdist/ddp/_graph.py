"""Find where each parameter is first used in a traced loss, and re-run it with wrappers.

The reducer needs each bucket's parameters to pass through an identity
``jax.custom_vjp`` *just before the first use* of any of them in the forward pass: the
backward rule of that identity then runs exactly when the bucket's gradients are complete,
and its collective can overlap the rest of the backward pass (torch's autograd hooks).

User code (an NNX module, a Linen ``apply``, a plain function) gives no such place to
hook into, so the loss is traced once to a jaxpr (:func:`trace`), the first equation that
reads each parameter is found (:func:`first_uses`), and the jaxpr is evaluated again
equation by equation (:func:`evaluate`), calling ``before(position, env)`` before each
equation so that the caller can replace parameter values by wrapped ones.
Nested calls (``pjit``, ``scan``, ``custom_jvp``) count as one use at their position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, Literal

__all__ = ["Traced", "trace", "first_uses", "evaluate"]


class Traced(NamedTuple):
    """A loss traced to a jaxpr with its first ``num_params`` inputs the parameters."""

    closed: ClosedJaxpr
    num_params: int
    out_tree: Any


def trace(fn: Callable, param_leaves: Sequence[Any], *args: Any) -> Traced:
    """Trace ``fn(param_leaves, *args)`` to a jaxpr (flat inputs: params, then ``args``)."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(list(param_leaves), *args)
    return Traced(closed, len(param_leaves), jax.tree.structure(shapes))


def first_uses(traced: Traced) -> list[int | None]:
    """For each parameter, the index of the first equation that reads it.

    ``len(eqns)`` means it is only returned as an output; ``None`` that it is never used.
    """
    jaxpr = traced.closed.jaxpr
    pos = {v: i for i, v in enumerate(jaxpr.invars[: traced.num_params])}
    out: list[int | None] = [None] * traced.num_params
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal) and v in pos and out[pos[v]] is None:
                out[pos[v]] = k
    for v in jaxpr.outvars:
        if not isinstance(v, Literal) and v in pos and out[pos[v]] is None:
            out[pos[v]] = len(jaxpr.eqns)
    return out


def evaluate(
    traced: Traced,
    flat_args: Sequence[Any],
    before: Callable[[int, dict], None],
) -> Any:
    """Evaluate the traced jaxpr on ``flat_args``, calling ``before(k, env)`` first.

    ``env`` maps the jaxpr's input variables (``traced.closed.jaxpr.invars``) and every
    computed variable to its current value; ``before`` may replace entries of parameters
    that have not been read yet. ``before(len(eqns), env)`` runs before the outputs are
    read. Returns the outputs unflattened with ``traced.out_tree``.
    """
    jaxpr = traced.closed.jaxpr
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, traced.closed.consts, strict=False):
        env[v] = c
    if len(flat_args) != len(jaxpr.invars):
        raise ValueError(
            f"the traced loss takes {len(jaxpr.invars)} inputs but got {len(flat_args)}; "
            "the batch structure changed after tracing"
        )
    for v, a in zip(jaxpr.invars, flat_args, strict=False):
        env[v] = a
    for k, eqn in enumerate(jaxpr.eqns):
        before(k, env)
        params = eqn.primitive.get_bind_params(eqn.params)
        manager = getattr(eqn.ctx, "manager", None) or contextlib.nullcontext()
        with manager:
            ans = eqn.primitive.bind(*map(read, eqn.invars), **params)
        if eqn.primitive.multiple_results:
            for v, a in zip(eqn.outvars, ans, strict=False):
                env[v] = a
        else:
            env[eqn.outvars[0]] = ans
    before(len(jaxpr.eqns), env)
    return jax.tree.unflatten(traced.out_tree, [read(v) for v in jaxpr.outvars])
