"""get_gradients' mapping and plain-object parameter holders, in one process: ParamKey
keys hash and compare by identity (torch's dict idioms), plain objects' modules are
differentiated (shared modules once), and a traced value stored on such an object
raises at once instead of leaking a tracer."""

from __future__ import annotations

import pickle

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.errors import DistAutogradError
from jdist.rpc import dist_autograd
from jdist.rpc.autograd._gradients import GradientMap, ParamKey
from tests.rpc.conftest import make_agents, stop_all


@pytest.fixture
def agent():
    agents = make_agents(1)
    yield agents[0]
    stop_all(agents, graceful=False)


def test_param_key_identity_and_read_through():
    a, b = nnx.Param(jnp.ones(3)), nnx.Param(jnp.ones(3))  # equal values, two params
    ka, kb = ParamKey(a), ParamKey(b)
    assert ka == a and ka == ParamKey(a) and ka != kb and hash(ka) == hash(ParamKey(a))
    assert len({ka, kb, ParamKey(a)}) == 2
    assert ka.shape == (3,) and np.asarray(ka).tolist() == [1, 1, 1] and ka[...].sum() == 3
    assert ka.variable is a and ParamKey(ka).variable is a
    back = pickle.loads(pickle.dumps(ka))  # a host copy of the parameter, as torch's
    assert isinstance(back, ParamKey) and back.shape == (3,) and back != ka  # CPU keys
    assert type(back.variable) is nnx.Param and type(back.variable.get_value()) is np.ndarray
    assert np.asarray(back).tolist() == [1, 1, 1] and back.variable.get_metadata() == (
        a.get_metadata())
    with pytest.raises(TypeError, match="takes an nnx.Variable"):
        ParamKey(np.ones(3))


def test_gradient_map_dict_idioms():
    a, b = nnx.Param(jnp.ones(2)), nnx.Param(jnp.zeros(1))
    grads = GradientMap({id(a): [a, np.full(2, 3.0)], id(b): [b, np.ones(1)]})
    copied = {k: v for k, v in grads.items()}
    plain = dict(grads)
    assert copied[ParamKey(a)].tolist() == [3, 3] and plain[ParamKey(b)].tolist() == [1]
    assert grads[a].tolist() == [3, 3] and grads[ParamKey(b)].tolist() == [1]
    assert a in grads and ParamKey(a) in grads and nnx.Param(jnp.ones(2)) not in grads
    assert grads != {} and grads == copied and not GradientMap({}) != {}
    with pytest.raises(KeyError, match="keyed by nnx.Variable"):
        grads["a"]


class Holder:
    def __init__(self):
        self.net = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        self.both = {"again": self.net, "w": nnx.Param(jnp.float32(2.0))}
        self.seen = 0

    def __call__(self, x):
        self.seen += 1
        return jnp.sum(self.both["again"](x) * self.both["w"][...]) + jnp.sum(self.net(x))


def test_plain_object_holder_gradients_and_rebinding(agent):
    h = Holder()
    x = np.ones((3, 2), np.float32)
    with dist_autograd.context(agent) as cid:
        loss = dist_autograd.backward(cid, lambda obj: obj(x), h, agent=agent)
        grads = dist_autograd.get_gradients(cid, agent=agent)
        assert len(grads) == 3  # kernel, bias, w: the shared Linear counted once
        # d/dkernel of sum(3 * (x @ k + b) * (w + 1)) / per column: 3 rows of ones
        np.testing.assert_allclose(np.asarray(grads[h.net.kernel]), np.full((2, 1), 9.0))
        np.testing.assert_allclose(np.asarray(grads[h.net.bias]), [9.0])
        want_w = float(np.sum(x @ np.asarray(h.net.kernel[...]) + np.asarray(h.net.bias[...])))
        np.testing.assert_allclose(float(grads[h.both["w"]]), want_w, rtol=1e-6)
        assert np.isfinite(float(loss)) and h.seen == 1


class Leaky:
    def __init__(self):
        self.net = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def __call__(self, x):
        self.last = self.net(x)  # a traced value kept on the object
        return jnp.sum(self.last)


def test_plain_object_keeping_a_traced_value_raises(agent):
    with dist_autograd.context(agent) as cid:
        with pytest.raises(DistAutogradError, match="Leaky.last was set to a value"):
            dist_autograd.backward(cid, lambda o: o(np.ones((1, 2), np.float32)), Leaky(),
                                   agent=agent)
