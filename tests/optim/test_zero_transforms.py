"""ZeRO over every kind of optax transformation: exact against unsharded optax, or a
named NonSeparableTransformError -- never a silent difference.

Two generated grids:
- ``TREE_CASES``: the tree-dependent transformations (masks as pytrees and callables,
  ``multi_transform`` labels, ``masked``, chains, per-leaf schedules, global norms,
  trust ratios) on 2, 4 and 8 replicas, each required to be exact;
- ``API_CASES``: every public optax function whose required arguments the table
  ``FILL`` can supply and which returns a transformation (optimizers and the
  ``scale_by_*``/``clip*`` building blocks), found by introspection: each must equal
  unsharded optax, raise NonSeparableTransformError, or raise what optax itself raises.
"""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.optim import ZeroRedundancyOptimizer
from jdist.optim._zero_replay import NonSeparableTransformError
from tests.helpers import tree_allclose
from tests.optim.test_zero import group_of

STEPS = 3
SHAPES = {"dense": {"kernel": (13, 7), "bias": (7,)}, "head": {"kernel": (7, 3), "bias": (3,)},
          "scale": ()}


def params0(shapes=SHAPES):
    leaves, tdef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(tdef, [jax.random.normal(k, s)
                                     for k, s in zip(keys, leaves, strict=True)])


def grads_seq(n, params):
    keys = jax.random.split(jax.random.key(1), STEPS)
    return [jax.tree.map(lambda p, kk=kk: jax.random.normal(kk, (n,) + p.shape), params)
            for kk in keys]


def is_matrix(p):
    return jax.tree.map(lambda x: x.ndim > 1, p)


def labels(p):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: "decay" if x.ndim > 1 else "plain", p)


MASK_TREE = {"dense": {"kernel": True, "bias": False}, "head": {"kernel": True, "bias": False},
             "scale": False}
LABEL_TREE = jax.tree.map(lambda m: "decay" if m else "plain", MASK_TREE)


def _multi(label_fn, decay_lr=1e-2, plain_lr=0.05):
    return optax.multi_transform(
        {"decay": optax.adamw(decay_lr, weight_decay=0.1),
         "plain": optax.sgd(plain_lr, momentum=0.9)}, label_fn)


TREE_CASES = {
    "adamw_mask_pytree": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=MASK_TREE),
    "adamw_mask_callable": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=is_matrix),
    "add_decayed_weights_mask": lambda: optax.chain(
        optax.add_decayed_weights(0.1, mask=is_matrix), optax.sgd(0.1)),
    "masked_adam": lambda: optax.masked(optax.adam(1e-2), is_matrix),
    "masked_pytree_sgd": lambda: optax.masked(optax.sgd(0.1, momentum=0.9), MASK_TREE),
    "multi_transform_callable": lambda: _multi(labels),
    "multi_transform_pytree": lambda: _multi(LABEL_TREE),
    "per_leaf_schedules": lambda: _multi(labels, optax.exponential_decay(1e-2, 1, 0.5),
                                         optax.linear_schedule(0.1, 0.0, 3)),
    "chain_clip_global_norm_adamw_mask": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1, mask=is_matrix)),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                               optax.sgd(0.1)),
    "lamb_mask": lambda: optax.lamb(1e-2, weight_decay=0.1, mask=is_matrix),
    "lars_masks": lambda: optax.lars(1e-2, weight_decay=0.1, weight_decay_mask=is_matrix,
                                     trust_ratio_mask=is_matrix),
    "scale_by_trust_ratio": lambda: optax.chain(optax.scale_by_adam(),
                                                optax.scale_by_trust_ratio(), optax.sgd(1e-2)),
    "normalize_by_update_norm": lambda: optax.normalize_by_update_norm(1e-2),
    "adafactor_unfactored_leaves": lambda: optax.adafactor(1e-2),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 2),
    "inject_hyperparams_adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.cosine_decay_schedule(1e-2, 3), weight_decay=0.1, mask=is_matrix),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    "masked_chain_nested": lambda: optax.chain(
        optax.masked(optax.clip_by_global_norm(0.3), is_matrix),
        optax.masked(optax.chain(optax.scale_by_lion(), optax.scale(-1e-2)),
                     lambda p: jax.tree.map(lambda m: not m, is_matrix(p))),
        optax.masked(optax.sgd(1e-2), is_matrix)),
}

BIG = {"w": (128, 160), "b": (160,)}  # factored second moments need two dims >= 128
REFUSED_CASES = {
    "adafactor_factored": (lambda: optax.adafactor(1e-2), BIG, "reduce_sum"),
    "add_noise": (lambda: optax.chain(optax.add_noise(0.1, 0.5, 0), optax.sgd(0.1)),
                  SHAPES, "random"),
    "centralize": (lambda: optax.chain(optax.centralize(), optax.sgd(0.1)), SHAPES,
                   "part of a leaf"),
}


def stacked(seq):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *seq)


def zero_run(tx, n, params, seq):
    """ZeRO over ``n`` replicas, the steps in one scan; returns the consolidated state."""
    zero = ZeroRedundancyOptimizer(tx, group=group_of(n))
    state = zero.init(params)
    specs = zero.state_partition_specs(state)

    def body(params, state, seq):
        def one(carry, grads):
            params, state = carry
            u, state = zero.update(grads, state, params)
            return (optax.apply_updates(params, u), state), None

        return jax.lax.scan(one, (params, state), jax.tree.map(lambda x: x[:, 0], seq))[0]

    mesh = zero.group.mesh
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(None, "dp")),
                              out_specs=(P(), specs), check_vma=False))
    params, state = f(params, state, jax.device_put(stacked(seq),
                                                    NamedSharding(mesh, P(None, "dp"))))
    zero.consolidate_state_dict(state, to=0)
    return params, zero.state_dict()["state"]


def plain_run(tx, params, seq):
    """Unsharded optax on the replicas' mean gradients (one jitted scan)."""
    def run(params, seq):
        def one(carry, grads):
            params, state = carry
            u, state = tx.update(jax.tree.map(lambda x: x.mean(0), grads), state, params)
            return (optax.apply_updates(params, u), state), None

        return jax.lax.scan(one, (params, tx.init(params)), seq)[0]

    return jax.jit(run)(params, stacked(seq))


def check_exact(tx, n, params, tol=1e-6):
    seq = grads_seq(n, params)
    p_zero, s_zero = zero_run(tx, n, params, seq)
    p_ref, s_ref = plain_run(tx, params, seq)
    tree_allclose(p_zero, p_ref, rtol=tol, atol=tol)
    tree_allclose(s_zero, jax.device_get(s_ref), rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(TREE_CASES))
def test_tree_dependent_transformation_equals_unsharded(name, n):
    check_exact(TREE_CASES[name](), n, params0())


@pytest.mark.parametrize("name", sorted(REFUSED_CASES))
def test_non_separable_transformation_is_refused_by_name(name):
    make, shapes, what = REFUSED_CASES[name]
    with pytest.raises(NonSeparableTransformError, match=what) as info:
        zero_run(make(), 4, params0(shapes), grads_seq(4, params0(shapes)))
    assert "without ZeRO" in str(info.value)


# ---- every public optax transformation whose arguments FILL supplies ---------------
FILL = {"learning_rate": 1e-2, "max_norm": 0.5, "max_delta": 0.5, "step_size": -1e-2,
        "weight_decay": 0.1, "l2_norm_clip": 1.0, "noise_multiplier": 0.1, "seed": 0,
        "eta": 0.1, "gamma": 0.5, "block_size": 1, "threshold": 0.1, "decay": 0.9,
        "min_scale": 1e-3, "clipping": 0.5, "min_norm": 1e-3, "ord": 2}


def _api_cases():
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(dir(optax)):
            fn = getattr(optax, name)
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            req = [p.name for p in inspect.signature(fn).parameters.values()
                   if p.default is inspect.Parameter.empty
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if not set(req) <= set(FILL):
                continue
            try:
                tx = fn(**{k: FILL[k] for k in req})
            except Exception:  # noqa: BLE001 -- not a transformation factory
                continue
            if hasattr(tx, "init") and hasattr(tx, "update"):
                out[name] = {k: FILL[k] for k in req}
    return out


API_CASES = _api_cases()


def test_the_api_sweep_found_the_optimizers_and_building_blocks():
    for name in ("adam", "adamw", "sgd", "lamb", "lars", "adafactor", "lion", "sm3",
                 "clip_by_global_norm", "scale_by_adam", "scale_by_trust_ratio"):
        assert name in API_CASES
    assert len(API_CASES) >= 60


@pytest.mark.parametrize("name", sorted(API_CASES))
def test_every_public_optax_transformation_is_exact_or_refused(name):
    n = (2, 4, 8)[sorted(API_CASES).index(name) % 3]
    make = lambda: getattr(optax, name)(**API_CASES[name])  # noqa: E731
    params = params0()
    seq = grads_seq(n, params)
    try:
        p_ref, s_ref = plain_run(make(), params, seq)
    except Exception as e:  # noqa: BLE001 -- e.g. needs extra arguments (value=...)
        with pytest.raises(type(e)):
            zero_run(make(), n, params, seq)
        return
    try:
        p_zero, s_zero = zero_run(make(), n, params, seq)
    except NonSeparableTransformError as e:
        assert "without ZeRO" in str(e)
        return
    tree_allclose(p_zero, p_ref, rtol=1e-5, atol=1e-6)
    tree_allclose(s_zero, jax.device_get(s_ref), rtol=1e-5, atol=1e-6)
