"""Functions marked ``dist_autograd.pure`` run on the callee as one compiled forward+VJP
program per signature: losses and gradients equal the generic (eager) path and a local
``nnx.value_and_grad``, dropout masks advance per call, a signature traces once, and
calls that do not fit take the generic path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.rpc import dist_autograd
from jdist.rpc.autograd import _compiled
from jdist.rpc.autograd import _context as C
from tests.rpc.conftest import make_agents, stop_all

TRACED = {"pure": 0}  # Python side effects of the marked function: once per trace


class Net(nnx.Module):
    """A Linear, a Dropout and a BatchNorm: parameters, an RNG counter and statistics."""

    def __init__(self, seed: int = 5):
        rngs = nnx.Rngs(seed)
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


def forward(net, x, scale):
    return net(x) * scale


def call_method(method, rref, *args):
    return method(rref.local_value(), *args)


@dist_autograd.pure
def pure_call_method(method, rref, *args):
    TRACED["pure"] += 1
    return method(rref.local_value(), *args)


@dist_autograd.pure
def pure_with_int_output(rref, x):
    return rref.local_value()(x), jnp.argmax(x, axis=1)


def grads_and_stats(rref):
    ctx = C.current()
    m = rref.local_value()
    g = dist_autograd.get_gradients(ctx.context_id, agent=ctx.agent)
    return (np.asarray(g[m.lin.kernel]), np.asarray(g[m.bn.scale]),
            np.asarray(m.bn.mean[...]))


@pytest.fixture(scope="module")
def agents():
    agents = make_agents(2)
    yield agents
    stop_all(agents, graceful=False)


def _steps(a0, fn, rref, xs, w):
    out = []
    for x in xs:
        with dist_autograd.context(a0) as cid:
            def loss_fn(s, x=x):
                y = a0.rpc_async("w1", fn, (forward, rref, jnp.asarray(x) * s, 2.0)).wait()
                return jnp.sum(y * w)

            loss = dist_autograd.backward(cid, loss_fn, jnp.float32(1.0), agent=a0)
            out.append((float(loss), *a0.rpc_async("w1", grads_and_stats, (rref,)).wait()))
    return out


def test_pure_matches_eager_and_local_grad_and_traces_once(agents):
    a0, _ = agents
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(6, 4)).astype(np.float32) for _ in range(4)]
    w = np.arange(18, dtype=np.float32).reshape(6, 3) / 10
    eager = _steps(a0, call_method, a0.remote("w1", Net), xs, w)
    before, traced = dict(_compiled.TRACES), TRACED["pure"]
    pure = _steps(a0, pure_call_method, a0.remote("w1", Net), xs, w)
    assert _compiled.TRACES["pure forward"] - before.get("pure forward", 0) == 1
    assert _compiled.TRACES["pure backward"] - before.get("pure backward", 0) == 1
    assert TRACED["pure"] - traced == 1  # jit's contract: side effects when traced

    ref = Net()
    for x, e, p in zip(xs, eager, pure, strict=True):
        def local(m, x=x):
            return jnp.sum(forward(m, jnp.asarray(x), 2.0) * w)

        want, g = nnx.value_and_grad(local)(ref)
        for got in (e, p):
            np.testing.assert_allclose(got[0], float(want), rtol=1e-5)
            np.testing.assert_allclose(got[1], np.asarray(g.lin.kernel[...]), rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(got[2], np.asarray(g.bn.scale[...]), rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(got[3], np.asarray(ref.bn.mean[...]), rtol=1e-5,
                                       atol=1e-7)  # batch statistics updated per call
    assert len({round(p[0], 6) for p in pure}) == len(xs)  # masks differ per step


def test_calls_that_do_not_fit_take_the_generic_path(agents):
    """An integer output computed inside cannot leave a compiled program as a static
    value: the generic path runs it (same values, no pure trace kept)."""
    a0, _ = agents
    rref = a0.remote("w1", Net)
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4)
    before = dict(_compiled.TRACES)
    for _ in range(2):
        with dist_autograd.context(a0) as cid:
            def loss_fn(s):
                y, idx = a0.rpc_async("w1", pure_with_int_output,
                                      (rref, jnp.asarray(x) * s)).wait()
                assert np.asarray(idx).tolist() == np.argmax(x, axis=1).tolist()
                return jnp.sum(y)

            loss = dist_autograd.backward(cid, loss_fn, jnp.float32(1.0), agent=a0)
            assert np.isfinite(float(loss))
            g = a0.rpc_async("w1", grads_and_stats, (rref,)).wait()
            assert np.abs(g[0]).sum() > 0
    # traced once, refused (the signature then always runs eagerly)
    assert _compiled.TRACES["pure forward"] - before.get("pure forward", 0) == 1


def test_pure_rejects_non_callables():
    with pytest.raises(TypeError, match="marks a function"):
        dist_autograd.pure(3)


# ---- jitted callees are pure by contract: compiled without a marker -----------------
@jax.jit
def jit_scaled(w, x):
    return jnp.tanh(x @ w) * 2.0


def test_jitted_callees_compile_without_a_mark(agents):
    """``rpc_sync(to, jax.jit(f), ...)`` and an ``nnx.jit`` function under dist autograd:
    jit's contract (Python runs once per trace) is ``pure``'s, so each records its
    forward and VJP as one compiled program (traced once over four steps) with the
    gradients and batch statistics of the eager path."""
    a0, _ = agents
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(6, 4)).astype(np.float32) for _ in range(4)]
    w = a0.remote("w1", np.asarray, (rng.normal(size=(4, 3)).astype(np.float32),))
    wv = w.to_here()

    def plain(w, x):  # the same function, unjitted: the eager path
        return jnp.tanh(x @ w) * 2.0

    for fn, ref in ((jit_scaled, plain),):
        before = dict(_compiled.TRACES)
        for x in xs:
            with dist_autograd.context(a0) as cid:
                def loss_fn(s, x=x, fn=fn):
                    y = a0.rpc_async("w1", fn, (wv, jnp.asarray(x) * s)).wait()
                    return jnp.sum(y ** 2)

                loss = dist_autograd.backward(cid, loss_fn, jnp.float32(1.5), agent=a0)
                g = dist_autograd.get_gradients(cid, agent=a0)
            want = jnp.sum(ref(wv, jnp.asarray(x) * 1.5) ** 2)
            np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
            assert g == {}  # no parameter of the caller's
        assert _compiled.TRACES["pure forward"] - before.get("pure forward", 0) == 1

    # a module method under nnx.jit, called through an RRef proxy: compiled as well, with
    # the eager path's losses, gradients and batch statistics
    runs = {}
    for name, cls in (("eager", ProxyNet), ("jitted", JitProxyNet)):
        rref = a0.remote("w1", cls)
        before = dict(_compiled.TRACES)
        out = []
        for x in xs:
            with dist_autograd.context(a0) as cid:
                def loss_fn2(s, x=x, rref=rref):
                    y = rref.rpc_async().forward(jnp.asarray(x) * s).wait()
                    return jnp.sum(y * w_)

                loss = dist_autograd.backward(cid, loss_fn2, jnp.float32(1.0), agent=a0)
                out.append((float(loss), *a0.rpc_async("w1", grads_and_stats, (rref,)).wait()))
        runs[name] = out
        traced = _compiled.TRACES["pure forward"] - before.get("pure forward", 0)
        assert traced == (1 if name == "jitted" else 0), (name, traced)
    for e, j in zip(runs["eager"], runs["jitted"], strict=True):
        for a, b in zip(j, e, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


w_ = np.arange(18, dtype=np.float32).reshape(6, 3) / 10


class ProxyNet(Net):
    def forward(self, x):
        return self(x) * 2.0


class JitProxyNet(Net):
    @nnx.jit
    def forward(self, x):
        return self(x) * 2.0
