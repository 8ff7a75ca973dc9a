"""Distributed autograd on three in-process agents: gradients equal plain jax.grad."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.errors import DistAutogradError
from jdist.rpc import RRef, dist_autograd
from jdist.rpc.autograd import _context as C
from tests.rpc.conftest import make_agents, stop_all

X = np.linspace(-1.0, 1.0, 5).astype(np.float32)
W0 = np.linspace(0.5, 1.5, 5).astype(np.float32)
W1 = np.linspace(-0.7, 0.9, 5).astype(np.float32)
W2 = np.float32(1.3)


def me():
    """The agent running this remote function (from the context it runs in)."""
    return C.current().agent


def call(to, fn, *args):
    return me().rpc_async(to, fn, args).wait()


# ---- remote functions (module level: they pickle by reference) ----
def make_param(value):
    return nnx.Param(jnp.asarray(value))


def f0(c, w0_rref):  # runs on w0 (the root's worker, another thread)
    return c * w0_rref.local_value()[...]


def f2(a, w2_rref, w0_rref):  # runs on w2, calls back to w0
    c = jnp.cos(a) * w2_rref.local_value()[...]
    d = call("w0", f0, c, w0_rref)
    return {"d2": d ** 2, "tag": "f2"}


def f1(x0, w1_rref, w2_rref, w0_rref):  # runs on w1, calls w2
    w1 = w1_rref.local_value()[...]
    a = jnp.sin(x0 * w1)
    out = call("w2", f2, a, w2_rref, w0_rref)
    assert out["tag"] == "f2"
    return out["d2"] * w1 + a, 7


def square_plus(y, k):  # called twice in one context
    return y * y + k


def grad_of(rref):
    return np.asarray(dist_autograd.get_gradients(C.current().context_id)[rref])


def n_contexts():
    return len(C.registry(me()).contexts)


def reference(w0, w1, w2):
    x0 = jnp.tanh(X * w0)
    a = jnp.sin(x0 * w1)
    d = (jnp.cos(a) * w2) * w0
    y = d ** 2 * w1 + a
    z = (y * y + 1.0) + (y * y + 2.0)
    return jnp.sum(y) + jnp.sum(z * x0)


def distributed_loss(w0_ref, w1_ref, w2_ref):
    agent = w0_ref._agent
    w0 = w0_ref.local_value()[...]
    x0 = jnp.tanh(X * w0)
    y, seven = agent.rpc_async("w1", f1, (x0, w1_ref, w2_ref, w0_ref)).wait()
    assert seven == 7
    z = (agent.rpc_async("w2", square_plus, (y, 1.0)).wait()
         + agent.rpc_async("w1", square_plus, (y, 2.0)).wait())
    return jnp.sum(y) + jnp.sum(z * x0)


@pytest.fixture(scope="module")
def agents():
    agents = make_agents(3)
    yield agents
    stop_all(agents, graceful=False)


def test_chain_across_workers_matches_jax_grad(agents):
    a0 = agents[0]
    refs = {"w0": a0.remote("w0", make_param, (W0,)), "w1": a0.remote("w1", make_param, (W1,)),
            "w2": a0.remote("w2", make_param, (W2,))}
    want_loss, want = jax.value_and_grad(reference, argnums=(0, 1, 2))(W0, W1, W2)
    with dist_autograd.context(a0) as cid:
        assert cid >> 48 == 0
        loss = dist_autograd.backward(cid, distributed_loss, refs["w0"], refs["w1"],
                                      refs["w2"])
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        got = [dist_autograd.get_gradients(cid)[refs["w0"]]]
        got += [a0.rpc_async(w, grad_of, (refs[w],)).wait() for w in ("w1", "w2")]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        # a second backward in the same context accumulates (the forward runs again)
        dist_autograd.backward(cid, distributed_loss, refs["w0"], refs["w1"], refs["w2"])
        g1 = a0.rpc_async("w1", grad_of, (refs["w1"],)).wait()
        np.testing.assert_allclose(g1, 2 * np.asarray(want[1]), rtol=1e-6, atol=1e-6)
    # parameters themselves never change
    np.testing.assert_array_equal(refs["w1"].to_here()[...], W1)
    # released everywhere (asynchronously on the others)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            C.registry(a).contexts for a in agents):
        time.sleep(0.01)
    assert not any(C.registry(a).contexts for a in agents)
    assert not any(C.registry(a).contexts.get(cid) for a in agents)
    with pytest.raises(DistAutogradError, match=f"Could not find autograd context with id: {cid}"):
        dist_autograd.get_gradients(cid, agent=a0)


def test_context_errors(agents):
    a0 = agents[0]
    with dist_autograd.context(a0) as cid:
        with pytest.raises(DistAutogradError,
                           match="Already have an autograd context id for this thread."):
            with dist_autograd.context(a0):
                pass
        with pytest.raises(TypeError, match="float scalar"):
            dist_autograd.backward(cid, lambda: jnp.ones(3))
        with pytest.raises(TypeError, match="pass the function that computes the loss"):
            dist_autograd.backward(cid, [jnp.ones(())])
        with pytest.raises(TypeError, match="must be callable"):
            dist_autograd.backward(cid, jnp.ones(()))
    with pytest.raises(DistAutogradError, match=f"Could not find autograd context with id: {cid}"):
        dist_autograd.backward(cid, lambda: jnp.ones(()), agent=a0)
    with dist_autograd.context(a0) as cid2:
        assert cid2 != cid


# ---- a worker dying in the middle of the backward pass ----
@jax.custom_vjp
def _dies_in_backward(x):
    return x * 3.0


def _dies_fwd(x):
    return x * 3.0, None


def _dies_bwd(_, ct):
    import threading

    agent = me()
    threading.Thread(target=agent.close).start()  # the worker goes away mid-backward
    time.sleep(2.0)
    return (ct * 3.0,)


_dies_in_backward.defvjp(_dies_fwd, _dies_bwd)


def leaf_dies(a):  # on w2
    return _dies_in_backward(a)


def middle(x):  # on w1: forwards to w2
    return call("w2", leaf_dies, jnp.sin(x))


def test_worker_dying_mid_backward_fails_with_named_error():
    from jdist.errors import WorkerUnavailableError

    agents = make_agents(3)
    try:
        a0 = agents[0]
        w = owned_param(a0)
        with dist_autograd.context(a0) as cid:
            t0 = time.monotonic()
            with pytest.raises(WorkerUnavailableError, match=r"WorkerInfo\(id=2, name=w2\)") as ei:
                dist_autograd.backward(
                    cid, lambda r: jnp.sum(a0.rpc_async("w1", middle, (r.local_value()[...],))
                                           .wait()), w)
            assert time.monotonic() - t0 < 15
            assert "_callee_backward was pending" in str(ei.value)
    finally:
        stop_all(agents, graceful=False)


def owned_param(agent):

    return RRef.owned_by(agent, nnx.Param(jnp.asarray(X)))


def test_rpc_inside_jit_is_refused_and_gradient_map(agents):
    a0 = agents[0]
    w = owned_param(a0)

    def jitted_rpc(r):
        return jax.jit(lambda v: jnp.sum(a0.rpc_async("w1", square_plus, (v, 1.0)).wait()))(
            r.local_value()[...])

    def local_only(r, module):
        return jnp.sum(r.local_value()[...] ** 2) + jnp.sum(module(jnp.ones((1, 2))))

    module = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    with dist_autograd.context(a0) as cid:
        with pytest.raises(DistAutogradError, match="inside jax.jit"):
            dist_autograd.backward(cid, jitted_rpc, w)
        loss, aux = dist_autograd.backward(cid, lambda r, m: (local_only(r, m), 5), w, module,
                                           has_aux=True)
        assert aux == 5
        grads = dist_autograd.get_gradients(cid)
        assert len(grads) == 3 and module.kernel in grads and w.local_value() in grads
        np.testing.assert_allclose(grads[w], 2 * X, rtol=1e-6)
        np.testing.assert_allclose(grads[module]["kernel"][...], np.ones((2, 1)))
        np.testing.assert_allclose(grads[module.bias], np.ones(1))
        with pytest.raises(KeyError, match="keyed by nnx.Variable"):
            grads["kernel"]


def add_scaled(x, w_rref, k):  # remote() target on w1: uses w1's own parameter
    return {"y": x * w_rref.local_value()[...] + k, "k": k}


def test_remote_and_to_here_are_differentiable(agents):
    """torch's DistributedOptimizer example shape: remote(...), then to_here() twice."""
    a0 = agents[0]
    w1 = a0.remote("w1", make_param, (W1,))
    w0 = owned_param(a0)

    def loss_fn(r):
        x = jnp.tanh(r.local_value()[...])
        rref = a0.remote("w1", add_scaled, (x, w1, 3.0))
        first = rref.to_here()
        assert first["k"] == 3.0
        return jnp.sum(first["y"] ** 2) + jnp.sum(rref.to_here()["y"])

    def ref(v0, v1):
        y = jnp.tanh(v0) * v1 + 3.0
        return jnp.sum(y ** 2) + jnp.sum(y)

    want = jax.grad(ref, argnums=(0, 1))(X, W1)
    with dist_autograd.context(a0) as cid:
        dist_autograd.backward(cid, loss_fn, w0)
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[w0], want[0], rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(a0.rpc_async("w1", grad_of, (w1,)).wait(), want[1],
                                   rtol=1e-6, atol=1e-6)
        with pytest.raises(DistAutogradError, match="to this worker"):
            dist_autograd.backward(cid, lambda r: jnp.sum(
                a0.remote("w0", add_scaled, (r.local_value()[...], w1, 1.0)).to_here()["y"]),
                w0)


def reached_here():
    return sorted(C.current().reached)


def relay(to):
    """On one worker: call ``to`` in the caller's context; what this worker reached."""
    me().rpc_async(to, n_contexts).wait()
    return reached_here()


def test_release_reaches_the_workers_a_context_reached_and_only_those():
    """torch releases a context on the workers it knows (those it sent messages of the
    context to), and each of those passes it on: w0 calls w1, w1 calls w2; w3 hears
    nothing of it."""
    agents = make_agents(4)
    try:
        a0, a3 = agents[0], agents[3]
        released_on = []
        real = C._Registry.release

        def spy(self, cid):
            out = real(self, cid)
            if out and self.agent in agents:  # not another test's agents (their
                released_on.append(self.agent.info.name)  # releases may come late)
            return out

        C._Registry.release = spy
        try:
            with dist_autograd.context(a0) as cid:
                assert a0.rpc_async("w1", relay, ("w2",)).wait() == [2]
                assert sorted(C.current().reached) == [1]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(released_on) < 3:
                time.sleep(0.01)
            time.sleep(0.1)  # a stray release to w3 would have come by now
        finally:
            C._Registry.release = real
        assert sorted(released_on) == ["w0", "w1", "w2"]
        assert not any(C.registry(a).contexts.get(cid) for a in agents)
        assert C.registry(a3).contexts == {}
    finally:
        stop_all(agents, graceful=False)


_W1 = []  # the agent w1 of the test below (its functions run in this process)


def has_context(cid):
    return cid in C.registry(_W1[0]).contexts


def test_release_travels_with_the_next_call_or_its_own_soon_after():
    """A released context reaches each worker in the header of this worker's next call
    there (a training loop's next step: no message of its own), checked by that call
    itself; with no next call, a call of its own tells it within RELEASE_FLUSH_S (plus
    a thread's wake-up)."""
    from jdist.rpc import _client

    agents = make_agents(2)
    a0, a1 = agents
    _W1[:] = [a1]
    sent = []
    real = _client.CallClient._send_notes
    _client.CallClient._send_notes = lambda self, to: sent.append(to) or real(self, to)
    try:
        for _ in range(20):  # a loop of steps: each release rides on the next call
            with dist_autograd.context(a0) as cid:
                assert a0.rpc_async("w1", has_context, (cid,)).wait()
            assert a0.notes.released_to == {1: [cid]}  # told nobody yet
            assert not a0.rpc_async("w1", has_context, (cid,)).wait()
            assert a0.notes.released_to == {}
        assert C.registry(a1).contexts == {}
        assert sent == []  # every release travelled in a call's header
        with dist_autograd.context(a0) as cid:  # the last step: nothing follows
            a0.rpc_async("w1", has_context, (cid,)).wait()
        began = time.monotonic()
        while C.registry(a1).contexts and time.monotonic() - began < 10:
            time.sleep(0.002)
        assert C.registry(a1).contexts == {}
        assert sent == [1] and a0.notes.released_to == {}
        assert time.monotonic() - began < 2.0  # the flush, not the 10 s bound
    finally:
        _client.CallClient._send_notes = real
        stop_all(agents, graceful=False)


def test_a_call_header_carries_released_contexts():
    from jdist.rpc import _protocol as P

    for msg in (P.Call(3, "f", 5, (7, 9)), P.Remote(4, "g", (1, 2), (1, 3), -1, (11,)),
                P.Call(5, "h", -1, (), ((2, 0, 4, 2, 6), (3, 1, 1, 0, 9)))):
        frames = P.encode(msg, b"payload")
        assert P.decode_header(frames) == msg
    assert P.decode_header(P.encode(P.Call(3, "f"), b"p")).released == ()
    assert P.decode_header(P.encode(P.Call(3, "f"), b"p")).controls == ()
    import msgpack

    for bad in ([int(P.Kind.CALL), 1, "f", -1, "x"], [int(P.Kind.CALL), 1, "f", -1, [1, "a"]],
                [int(P.Kind.CALL), 1, "f", -1, [], [[2, 0, 1, 2]]],
                [int(P.Kind.CALL), 1, "f", -1, [], [[2, 0, 1, 2, "x"]]],
                [int(P.Kind.CALL), 1, "f", -1, [], [[1, 0, 1, 2, 3]]]):  # FORK_REQUEST
        with pytest.raises(P.ProtocolError, match="bad call header"):
            P.decode_header([msgpack.packb(bad), b"p"])
