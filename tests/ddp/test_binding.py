"""The step's binding to the module (``jdist/ddp/_binding.py``) and its fallbacks.

The fast path (Variables found once, arrays read and written directly), the path without
flax's unchecked setter, and the ``nnx.split``/``nnx.update`` fallback (flax internals
missing) must train identically, matching plain single-device training; a step that adds
a variable to the module rebinds instead of writing into stale Variables.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp import _binding
from tests.ddp.models import MLP, data, max_diff, mse, reference_train


def _train(steps=3):
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = ddp.train_step(mse, opt)
    kernel = model.layers[0].kernel  # the Variable object the binding writes into
    losses = [float(step(data(seed=s))) for s in range(steps)]
    assert model.layers[0].kernel is kernel
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param)), int(opt.step[...])


def _reference(steps=3):
    model = MLP(rngs=nnx.Rngs(0))
    losses = reference_train(model, optax.adam(1e-2), [data(seed=s) for s in range(steps)])
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("mode", ["fast", "checked_setter", "split_update"])
def test_binding_modes_train_like_plain_training(mode, monkeypatch):
    if mode == "checked_setter":
        monkeypatch.setattr(_binding, "_BYPASS", False)
    if mode == "split_update":
        def missing(node, state):
            raise AttributeError("graphlib.flatten is gone in this flax")

        monkeypatch.setattr(_binding, "_find_variables", missing)
    b = _binding.Binding(MLP(rngs=nnx.Rngs(0)))
    assert b.fast == (mode != "split_update")
    losses, params, opt_steps = _train()
    ref_losses, ref_params = _reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_diff(params, ref_params) < 1e-5
    assert opt_steps == 3


def test_flax_version_checked():
    import flax

    assert flax.__version__.startswith(_binding.FLAX_CHECKED), (
        f"jdist/ddp/_binding.py was checked against flax {_binding.FLAX_CHECKED}.x; "
        f"re-check its flax internals for {flax.__version__} and update FLAX_CHECKED")


def test_step_that_adds_a_variable_rebinds():
    class Counting(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

        def __call__(self, x):
            if not hasattr(self, "calls"):
                self.calls = nnx.BatchStat(jnp.zeros(()))  # a new variable, first call only
            self.calls[...] = self.calls[...] + 1
            return x * self.w[...]

    model = Counting()
    ddp = DDP(model)
    step = ddp.train_step(lambda m, x: jnp.mean(m(x)),
                          nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param))
    x = np.ones((8, 2), np.float32)
    for _ in range(3):
        step(x)
    assert float(model.calls[...]) == 3.0  # written after the rebind, counted every step
    np.testing.assert_allclose(np.asarray(model.w[...]), 1 - 3 * 0.5, rtol=1e-6)
