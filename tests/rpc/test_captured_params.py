"""A parameter that a differentiated function reads other than through its arguments
(a closure, a global, a default, a module's own method) would get no gradient under
JAX, where torch trains it: refused, naming the value, on the caller and on a callee.
Each way of capturing is generated against the same three shapes of module/Variable/
RRef; passing the holder as an argument (captured too, or not) is the control."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.errors import DistAutogradError
from jdist.rpc import dist_autograd
from tests.rpc.conftest import make_agents, stop_all

X = np.linspace(-1.0, 1.0, 3).astype(np.float32)
GLOBAL_MODEL = nnx.Linear(3, 1, rngs=nnx.Rngs(0))


def _linear():
    return nnx.Linear(3, 1, rngs=nnx.Rngs(1))


def _holder(kind, agent):
    model = _linear()
    if kind == "module":
        return model, lambda m: m(X)
    if kind == "variable":
        return model.kernel, lambda v: X @ v[...]
    return agent.remote("w0", _linear, ()), lambda r: r.local_value()(X)


def _captured_loss(how, holder, use):
    """A loss function of no arguments that reaches ``holder`` as ``how`` says."""
    if how == "closure":
        return lambda: jnp.sum(use(holder))
    if how == "default":
        def loss(h=holder):
            return jnp.sum(use(h))
        return loss
    if how == "partial":
        return functools.partial(lambda h: jnp.sum(use(h)), holder)
    raise AssertionError(how)


@pytest.fixture(scope="module")
def agents():
    agents = make_agents(2)
    yield agents
    stop_all(agents, graceful=False)


@pytest.mark.parametrize("kind", ["module", "variable", "rref"])
@pytest.mark.parametrize("how", ["closure", "default", "partial"])
def test_a_captured_parameter_is_refused_on_the_caller(agents, how, kind):
    holder, use = _holder(kind, agents[0])
    with dist_autograd.context(agents[0]) as cid, pytest.raises(
            DistAutogradError, match="reads .* parameter.* not through its arguments"):
        dist_autograd.backward(cid, _captured_loss(how, holder, use), agent=agents[0])


@pytest.mark.parametrize("kind", ["module", "variable", "rref"])
def test_the_same_holder_passed_as_an_argument_is_differentiated(agents, kind):
    holder, use = _holder(kind, agents[0])
    with dist_autograd.context(agents[0]) as cid:
        # captured *and* passed: fine, the argument is what is differentiated
        dist_autograd.backward(cid, lambda h: jnp.sum(use(h)) + 0 * jnp.sum(use(holder)),
                               holder, agent=agents[0])
        grads = dist_autograd.get_gradients(cid, agent=agents[0])
        assert len(grads) >= 1


def test_a_global_module_and_a_modules_own_method_are_refused(agents):
    with dist_autograd.context(agents[0]) as cid:
        with pytest.raises(DistAutogradError, match="global 'GLOBAL_MODEL'"):
            dist_autograd.backward(cid, lambda: jnp.sum(GLOBAL_MODEL(X)), agent=agents[0])
        with pytest.raises(DistAutogradError, match="the function itself"):
            dist_autograd.backward(cid, GLOBAL_MODEL.__call__.__self__, X,
                                   agent=agents[0])


def _reads_the_callees_global(x):
    return GLOBAL_MODEL(x)


def test_a_function_sent_by_rpc_that_reads_a_global_module_is_refused(agents):
    a0 = agents[0]
    with dist_autograd.context(a0) as cid, pytest.raises(
            DistAutogradError, match="global 'GLOBAL_MODEL'"):
        dist_autograd.backward(
            cid, lambda x: jnp.sum(a0.rpc_async("w1", _reads_the_callees_global,
                                                (x * 1.0,)).wait()),
            nnx.Param(jnp.asarray(X)), agent=a0)
