"""jdist's ZeroRedundancyOptimizer vs torch's optimizers of the same maths.

Generated: the optimizer family and its hyperparameters, parameter groups (each with its
own overrides), parameter shapes (scalars included), the number of replicas (devices of
one process; ZeRO splits every parameter over them), the gradients of each step, and a
state_dict round trip at a random step in one of two directions: ZeRO's consolidated
state loaded into a plain optax optimizer, or a plain optax state loaded into ZeRO over
another number of replicas. The rest of the steps continue from the loaded state. The
oracle is torch's optimizer over the same parameter groups, fed the same gradients
(torch's ZeroRedundancyOptimizer computes exactly its local optimizer's update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.optim import ParamGroups, ZeroRedundancyOptimizer
from tests.differential import replayed, scaled
from tests.optim.test_zero import group_of


def sgd(learning_rate, momentum, weight_decay, nesterov=False):
    """torch.optim.SGD: coupled weight decay, then momentum (dampening 0)."""
    return optax.chain(optax.add_decayed_weights(weight_decay),
                       optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov))


def adam(learning_rate, b1, b2, weight_decay):
    """torch.optim.Adam: coupled weight decay."""
    return optax.chain(optax.add_decayed_weights(weight_decay),
                       optax.adam(learning_rate, b1=b1, b2=b2, eps=1e-8))


def adamw(learning_rate, b1, b2, weight_decay):
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=1e-8, weight_decay=weight_decay)


def rmsprop(learning_rate, decay, momentum):
    """torch.optim.RMSprop: eps outside the square root, no initial scale."""
    return optax.rmsprop(learning_rate, decay=decay, eps=1e-8, initial_scale=0.0,
                         momentum=momentum, eps_in_sqrt=False)


FAMILIES = {
    "sgd": (sgd, {"learning_rate": st.sampled_from([0.1, 0.01]),
                  "momentum": st.sampled_from([0.0, 0.9]),
                  "weight_decay": st.sampled_from([0.0, 0.05])}),
    "adam": (adam, {"learning_rate": st.sampled_from([0.1, 0.01]),
                    "b1": st.sampled_from([0.9, 0.5]), "b2": st.sampled_from([0.999, 0.9]),
                    "weight_decay": st.sampled_from([0.0, 0.05])}),
    "adamw": (adamw, {"learning_rate": st.sampled_from([0.1, 0.01]),
                      "b1": st.sampled_from([0.9, 0.5]), "b2": st.sampled_from([0.999, 0.9]),
                      "weight_decay": st.sampled_from([0.0, 0.05])}),
    "rmsprop": (rmsprop, {"learning_rate": st.sampled_from([0.01, 0.001]),
                          "decay": st.sampled_from([0.99, 0.9]),
                          "momentum": st.sampled_from([0.0, 0.9])}),
}


def torch_optimizer(family, groups):
    def kw(h):
        if family == "sgd":
            return dict(lr=h["learning_rate"], momentum=h["momentum"],
                        weight_decay=h["weight_decay"])
        if family in ("adam", "adamw"):
            return dict(lr=h["learning_rate"], betas=(h["b1"], h["b2"]), eps=1e-8,
                        weight_decay=h["weight_decay"])
        return dict(lr=h["learning_rate"], alpha=h["decay"], eps=1e-8,
                    momentum=h["momentum"])

    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
           "rmsprop": torch.optim.RMSprop}[family]
    return lambda params: cls([{"params": p, **kw(h)} for p, h in zip(params, groups,
                                                                          strict=True)])


@st.composite
def cases(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    hp = FAMILIES[family][1]
    n_groups = draw(st.integers(1, 2))
    groups = [{k: draw(s) for k, s in hp.items()} for _ in range(n_groups)]
    shapes = [draw(st.lists(st.lists(st.integers(1, 5), max_size=2), min_size=1, max_size=3))
              for _ in range(n_groups)]
    steps = draw(st.integers(1, 4))
    return {"family": family, "groups": groups, "shapes": shapes, "steps": steps,
            "replicas": draw(st.sampled_from([1, 2, 3, 4, 8])),
            "reload_at": draw(st.integers(0, steps)),
            "reload_into": draw(st.sampled_from(["plain", "zero"])),
            "replicas_after": draw(st.sampled_from([1, 2, 5])),
            "seed": draw(st.integers(0, 2**16))}


def arrays(case):
    rng = np.random.default_rng(case["seed"])
    params = [[rng.standard_normal(s).astype(np.float32) for s in group]
              for group in case["shapes"]]
    grads = [[[rng.standard_normal(s).astype(np.float32) for s in group]
              for group in case["shapes"]] for _ in range(case["steps"])]
    return params, grads


def torch_run(case):
    params, grads = arrays(case)
    tparams = [[torch.tensor(p, requires_grad=True) for p in group] for group in params]
    opt = torch_optimizer(case["family"], case["groups"])(tparams)
    for step in grads:
        for group, gs in zip(tparams, step, strict=True):
            for p, g in zip(group, gs, strict=True):
                p.grad = torch.from_numpy(g.copy())
        opt.step()
    return [[p.detach().numpy() for p in group] for group in tparams]


def jdist_run(case):
    params, grads = arrays(case)
    factory = FAMILIES[case["family"]][0]
    tx = ParamGroups(factory, case["groups"])
    zero = ZeroRedundancyOptimizer(tx, group=group_of(case["replicas"]))
    x = [[jnp.asarray(p) for p in group] for group in params]
    state = zero.init(x)
    plain = None
    for i, step in enumerate(grads):
        if i == case["reload_at"]:
            zero.consolidate_state_dict(state, to=0)
            saved = zero.state_dict()["state"]
            if case["reload_into"] == "plain":  # ZeRO -> a plain optax optimizer
                plain, pstate = tx, jax.tree.map(jnp.asarray, saved)
            else:  # plain optax state -> ZeRO over another number of replicas
                zero = ZeroRedundancyOptimizer(tx, group=group_of(case["replicas_after"]))
                zero.init(x)
                state = zero.load_state_dict(saved)
        g = [[jnp.asarray(a) for a in group] for group in step]
        if plain is not None:
            updates, pstate = plain.update(g, pstate, x)
            x = optax.apply_updates(x, updates)
        else:
            x, state = zero.step(x, g, state)
    return [[np.asarray(p) for p in group] for group in x]


@given(case=cases())
@settings(max_examples=scaled(20))
@replayed("zero")
def test_zero_matches_torch_optimizers_with_state_dict_round_trips(case):
    expected, got = torch_run(case), jdist_run(case)
    for gi, (eg, jg) in enumerate(zip(expected, got, strict=True)):
        for pi, (e, j) in enumerate(zip(eg, jg, strict=True)):
            assert e.shape == j.shape
            np.testing.assert_allclose(j, e, rtol=2e-5, atol=2e-6,
                                       err_msg=f"group {gi} param {pi}")
