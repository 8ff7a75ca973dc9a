"""ZeRO over every kind of optax transformation: exact against unsharded optax, or a
named NonSeparableTransformError -- never a silent difference.

Two generated grids:
- ``TREE_CASES``: the tree-dependent transformations (masks as pytrees and callables,
  ``multi_transform`` labels, ``masked``, chains, per-leaf schedules, global norms,
  trust ratios), each on one of 2, 4 and 8 replicas in turn, each required to be exact;
- ``API_CASES``: every public optax function whose required arguments the table
  ``FILL`` can supply and which returns a transformation (optimizers and the
  ``scale_by_*``/``clip*`` building blocks), found by introspection: each must equal
  unsharded optax, raise NonSeparableTransformError, or raise what optax itself raises.

To keep compile time small, each grid point traces every transformation on its own
(refusals surface there) and then runs all the others in one compiled program.
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

from jdist.optim import ZeroRedundancyOptimizer, flat_partition
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
    "sm3": (lambda: optax.sm3(1e-2), {"w": (13, 7), "b": (7,)}, "mixes elements"),
    "centralize": (lambda: optax.chain(optax.centralize(), optax.sgd(0.1)), SHAPES,
                   "part of a leaf"),
}


def stacked(seq):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *seq)


def _steps(update, params, state, seq):
    def one(carry, grads):
        params, state = carry
        u, state = update(grads, state, params)
        return (optax.apply_updates(params, u), state), None

    return jax.lax.scan(one, (params, state), seq)[0]


def _zero_program(zero):
    """One transformation's init and steps inside shard_map (local state)."""
    return lambda params, seq: _steps(zero.update, params, zero.init(params),
                                      jax.tree.map(lambda x: x[:, 0], seq))


def bundle(makes: dict, n: int, params):
    """Every transformation of ``makes`` sharded over ``n`` replicas and unsharded.

    Each is traced first on its own (no compiling): those that raise are returned
    as ``{name: exception}``; the others run in ONE compiled ZeRO program and one
    compiled unsharded program, ``{name: (zero params, consolidated zero state, ref
    params, ref state)}``.
    """
    mesh = group_of(n).mesh
    seq = stacked(grads_seq(n, params))
    seq_sharding = NamedSharding(mesh, P(None, "dp"))
    zeros, specs, raised = {}, {}, {}
    for name, make in makes.items():
        zero = ZeroRedundancyOptimizer(make(), group=group_of(n))
        try:
            tx = make()
            jax.eval_shape(lambda p, s, tx=tx: _steps(tx.update, p, tx.init(p), s),
                           params, jax.tree.map(lambda x: x.mean(1), seq))
        except Exception as e:  # noqa: BLE001 -- optax itself refuses (needs value=...)
            raised[name] = ("optax", e, zero)
            continue
        try:
            local = jax.eval_shape(jax.shard_map(zero.init, mesh=mesh, in_specs=P(),
                                                 out_specs=P(), check_vma=False), params)
            specs[name] = zero.state_partition_specs(local)
            jax.eval_shape(jax.shard_map(_zero_program(zero), mesh=mesh,
                                         in_specs=(P(), P(None, "dp")),
                                         out_specs=(P(), specs[name]), check_vma=False),
                           params, seq)
            zero.layout = flat_partition(params, n)  # as an eager init would remember it
            zeros[name] = zero
        except Exception as e:  # noqa: BLE001 -- checked by the caller
            raised[name] = ("zero", e, zero)

    def sharded(params, seq):
        return {k: _zero_program(z)(params, seq) for k, z in zeros.items()}

    def plain(params, seq):
        txs = {k: makes[k]() for k in zeros}
        return {k: _steps(tx.update, params, tx.init(params),
                          jax.tree.map(lambda x: x.mean(1), seq)) for k, tx in txs.items()}

    f = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(P(), P(None, "dp")),
                              out_specs={k: (P(), specs[k]) for k in zeros}, check_vma=False))
    got = f(params, jax.device_put(seq, seq_sharding))
    want = jax.jit(plain)(params, seq)
    out = {}
    for k, zero in zeros.items():
        zero.consolidate_state_dict(got[k][1])
        out[k] = (got[k][0], zero.state_dict()["state"], want[k][0], want[k][1])
    return out, raised


def _numbers(tree):
    """PRNG key leaves (add_noise's state) as their integer data, for comparing."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, tree)


def compare(results: dict, tol=1e-6) -> list:
    """Names of the transformations whose ZeRO result differs, with the difference."""
    bad = []
    for name, (p_zero, s_zero, p_ref, s_ref) in sorted(results.items()):
        try:
            tree_allclose(p_zero, p_ref, rtol=tol, atol=tol)
            tree_allclose(_numbers(s_zero), jax.device_get(_numbers(s_ref)), rtol=tol,
                          atol=tol)
        except AssertionError as e:
            bad.append(f"{name}: {str(e)[:300]}")
    return bad


REPLICAS = (2, 4, 8)


@pytest.mark.parametrize("n", REPLICAS)
def test_tree_dependent_transformations_equal_unsharded(n):
    """Each case on one of the replica counts (in turn, so every count runs a third of
    the cases and every case runs once): one compiled bundle per count."""
    names = sorted(TREE_CASES)
    mine = {k: TREE_CASES[k] for i, k in enumerate(names)
            if REPLICAS[i % len(REPLICAS)] == n}
    results, raised = bundle(mine, n, params0())
    assert not raised, {k: repr(e) for k, (_, e, _) in raised.items()}
    assert sorted(results) == sorted(mine)
    assert compare(results) == []


def test_non_separable_transformations_are_refused_by_name():
    for name, (make, shapes, what) in REFUSED_CASES.items():
        results, raised = bundle({name: make}, 4, params0(shapes))
        assert not results, name
        where, err, _ = raised[name]
        assert where == "zero" and isinstance(err, NonSeparableTransformError), (name, err)
        assert what in str(err) and "without ZeRO" in str(err), (name, str(err))


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


@pytest.mark.slow(seconds=40)  # a long end-to-end run
def test_every_public_optax_transformation_is_exact_or_refused():
    """Each: equal to unsharded optax, or NonSeparableTransformError, or (when optax
    itself cannot run it here, e.g. it needs ``value=``) an exception too."""
    makes = {k: (lambda k=k: getattr(optax, k)(**API_CASES[k])) for k in API_CASES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results, raised = bundle(makes, 4, params0())
    for name, (where, err, zero) in raised.items():
        if where == "optax":
            with pytest.raises(Exception):  # noqa: B017 -- any error, never a result
                jax.eval_shape(jax.shard_map(_zero_program(zero), mesh=zero.group.mesh,
                                             in_specs=(P(), P(None, "dp")), out_specs=P(),
                                             check_vma=False),
                               params0(), stacked(grads_seq(4, params0())))
        else:
            assert isinstance(err, NonSeparableTransformError), (name, err)
            assert "without ZeRO" in str(err)
    assert compare(results, tol=1e-5) == []
    # the element-wise optimizers and the global-norm ones are exact, not refused
    assert {"adam", "adamw", "sgd", "lamb", "lars", "lion", "adafactor", "rmsprop",
            "clip_by_global_norm", "scale_by_trust_ratio", "add_noise"} <= set(results)
