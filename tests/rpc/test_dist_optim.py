"""RPC DistributedOptimizer and RemoteModule on three in-process agents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.errors import DistAutogradError
from jdist.rpc import DistributedOptimizer, RemoteModule, RRef, dist_autograd
from tests.rpc.conftest import make_agents, stop_all


def make_param(value):
    return nnx.Param(jnp.asarray(value, jnp.float32))


def times(rref, k):
    return rref.local_value()[...] * k


class Lin(nnx.Module):
    def __init__(self, din, dout, seed):
        self.lin = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class NotAModule:
    def __init__(self):
        pass


@pytest.fixture(scope="module")
def agents():
    agents = make_agents(3)
    yield agents
    stop_all(agents, graceful=False)


def test_sgd_matches_torch_reference(agents):
    """torch 2.13 [V]: SGD lr 0.5, remote param 1 -> 0 (grad 2), local 0 -> -1.5 (grad 3)."""
    a0 = agents[0]
    remote_p = a0.remote("w1", make_param, (1.0,))
    local_p = RRef.owned_by(a0, make_param(0.0))
    opt = DistributedOptimizer(optax.sgd, [remote_p, local_p], learning_rate=0.5)
    assert [w.name for w in opt.owners] == ["w0", "w1"]

    def loss_fn(local_ref):
        r = a0.rpc_async("w1", times, (remote_p, 2.0)).wait()
        return jnp.sum(r) + 3.0 * local_ref.local_value()[...]

    sent = []  # where step sends its calls: the remote owner only
    real_rpc = a0.rpc_async

    def spy(to, func, *rest, **kw):
        sent.append((a0.worker_info(to).name, getattr(func, "__name__", func)))
        return real_rpc(to, func, *rest, **kw)

    with dist_autograd.context(a0) as cid:
        dist_autograd.backward(cid, loss_fn, local_p)
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[local_p], 3.0)
        np.testing.assert_allclose(remote_p.to_here()[...], 1.0)  # grads never touch params
        a0.rpc_async = spy
        try:
            opt.step(cid)
        finally:
            del a0.rpc_async
    assert sent == [("w1", "_local_step")]  # this worker's own step ran here, no RPC
    np.testing.assert_allclose(remote_p.to_here()[...], 0.0)
    np.testing.assert_allclose(local_p.local_value()[...], -1.5)
    # the context is gone afterwards: the step fails on every owner, naming them
    with pytest.raises(DistAutogradError, match=f"Could not find autograd context with id: {cid}"
                       ) as info:
        opt.step(cid)
    assert "WorkerInfo(id=0, name=w0)" in str(info.value.__notes__)
    assert "WorkerInfo(id=1, name=w1)" in str(info.value.__notes__)


def test_remote_module_adam_matches_single_process(agents):
    a0 = agents[0]
    rm = RemoteModule("w2/cpu", Lin, (3, 2), {"seed": 0}, agent=a0)
    assert rm.owner.name == "w2"
    local = Lin(2, 1, seed=1)
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    ref_remote, ref_local = Lin(3, 2, seed=0), Lin(2, 1, seed=1)
    np.testing.assert_allclose(rm.forward(x), ref_remote(x), rtol=1e-6)
    np.testing.assert_allclose(rm.forward_async(x).wait(), ref_remote(x), rtol=1e-6)
    params = rm.remote_parameters()
    assert len(params) == 2 and all(p.owner().name == "w2" for p in params)
    local_ref = RRef.owned_by(a0, local)
    opt = DistributedOptimizer(optax.adam, params + [local_ref], learning_rate=0.1)

    def loss_fn(local_ref):
        h = rm(x) * 2.0
        h = h + rm(x)  # the remote module called twice in one context
        return jnp.mean(local_ref.local_value()(h) ** 2)

    def ref_loss(p_remote, p_local):
        m_r = nnx.merge(gd_r, p_remote)
        m_l = nnx.merge(gd_l, p_local)
        h = m_r(x) * 2.0 + m_r(x)
        return jnp.mean(m_l(h) ** 2)

    gd_r, p_r = nnx.split(ref_remote)
    gd_l, p_l = nnx.split(ref_local)
    tx = optax.adam(0.1)
    s_r, s_l = tx.init(p_r), tx.init(p_l)
    ref_grad = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))

    @jax.jit
    def ref_update(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    for _ in range(3):
        with dist_autograd.context(a0) as cid:
            loss = dist_autograd.backward(cid, loss_fn, local_ref)
            opt.step(cid)
        want, (g_r, g_l) = ref_grad(p_r, p_l)
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        p_r, s_r = ref_update(g_r, s_r, p_r)
        p_l, s_l = ref_update(g_l, s_l, p_l)
    got_remote = [p.to_here()[...] for p in params]
    want_remote = [p_r["lin"]["bias"][...], p_r["lin"]["kernel"][...]]
    for g, w in zip(got_remote, want_remote, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(local.lin.kernel[...], p_l["lin"]["kernel"][...], rtol=1e-5,
                               atol=1e-6)


def test_bad_inputs(agents):
    a0 = agents[0]
    remote_p = a0.remote("w1", make_param, (1.0,))
    with pytest.raises(TypeError, match=r"learning_rate=, not torch's lr=.*learning_rate=0.1"):
        DistributedOptimizer(optax.sgd, [RRef.owned_by(a0, make_param(1.0))], lr=0.1)
    with pytest.raises(TypeError, match="pass the factory"):
        DistributedOptimizer(optax.sgd(0.1), [remote_p])
    with pytest.raises(TypeError, match="wrap local parameters in RRef"):
        DistributedOptimizer(optax.sgd, [nnx.Param(jnp.ones(()))], learning_rate=0.1)
    with pytest.raises(ValueError, match="empty"):
        DistributedOptimizer(optax.sgd, [], learning_rate=0.1)
    with pytest.raises(ValueError, match="nnx.Module class"):
        RemoteModule("w1", NotAModule, agent=a0)
    with pytest.raises(ValueError, match="unknown worker name 'nope'"):
        RemoteModule("nope/cpu", Lin, (1, 1, 0), agent=a0)
    # an optax instance is fine for a local owner (nothing to pickle)
    opt = DistributedOptimizer(optax.sgd(0.1), [RRef.owned_by(a0, make_param(1.0))])
    with dist_autograd.context(a0) as cid:
        opt.step(cid)  # no gradients in this context: nothing changes


class Clipped(nnx.Param):
    """A Variable type with its own set_value: the optimizer must write through it."""

    def set_value(self, value, **kw):
        super().set_value(jnp.clip(value, -0.25, 10.0), **kw)


def test_variables_with_their_own_setter_are_written_through_it(agents):
    """The optimizer writes plain Variables' raw values directly (fast path) and goes
    through set_value for a type that overrides it: both end where optax says, the
    overriding one clipped by its own setter."""
    a0 = agents[0]
    plain, clipped = make_param(1.0), Clipped(jnp.asarray(1.0, jnp.float32))
    opt = DistributedOptimizer(optax.sgd, [RRef.owned_by(a0, plain),
                                           RRef.owned_by(a0, clipped)], learning_rate=0.5)

    def loss_fn(p, c):
        return 3.0 * p[...] + 3.0 * c[...]

    with dist_autograd.context(a0) as cid:
        dist_autograd.backward(cid, loss_fn, plain, clipped, agent=a0)
        opt.step(cid)
    np.testing.assert_allclose(plain[...], 1.0 - 0.5 * 3.0)  # -0.5
    np.testing.assert_allclose(clipped[...], -0.25)  # -0.5 through Clipped.set_value
    assert isinstance(plain.get_raw_value(), jax.Array)
