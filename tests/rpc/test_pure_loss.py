"""A loss function marked ``dist_autograd.pure`` runs as one compiled program per
signature, its RPCs made by host callbacks: losses, gradients and dropout masks equal
the eager path's and a local reference, a signature is recorded once and traced once,
a remote error comes back as itself, and passes the record cannot describe stay eager."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jdist.errors import DistAutogradError
from jdist.rpc import dist_autograd
from jdist.rpc.autograd import _compiled_root
from jdist.rpc.autograd import _context as C
from tests.differential import scaled
from tests.rpc.conftest import make_agents, stop_all


class Stage(nnx.Module):
    """A Linear and a Dropout: parameters and an RNG counter that advances per call."""

    def __init__(self, din: int, dout: int, rate: float, seed: int):
        rngs = nnx.Rngs(seed)
        self.lin = nnx.Linear(din, dout, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.lin(x)))


@dist_autograd.pure
def call_method(method, rref, *args):
    return method(rref.local_value(), *args)


def stage_forward(stage, x):
    return stage(x)


def fails_on_negative(stage, x):
    if float(np.asarray(x).sum()) < 0:  # eager: a remote function that may raise
        raise ValueError(f"negative batch sum {float(np.asarray(x).sum()):.3f}")
    return stage(x)


def first_rows(stage, x):
    n = int(np.asarray(x)[0, 0] > 0) + 3  # a shape that depends on the values
    return stage(x)[:n]


def grads_of(rref):
    ctx = C.current()
    g = dist_autograd.get_gradients(ctx.context_id, agent=ctx.agent)
    m = rref.local_value()
    return np.asarray(g[m.lin.kernel]), np.asarray(g[m.lin.bias])


@jax.jit
def nll(out, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], 1))


class Trainer:
    """Holds the RRefs to the two stages (a plain object: a static leaf of the pass)."""

    def __init__(self, a0, r1, r2):
        self.a0, self.r1, self.r2 = a0, r1, r2

    def __call__(self, x):
        h = self.a0.rpc_async("w1", call_method, (stage_forward, self.r1, x)).wait()
        return self.a0.rpc_async("w2", call_method, (stage_forward, self.r2, h * 2.0)).wait()


def two_stage_loss(net, x, y):
    return nll(net(x), y)


pure_two_stage_loss = dist_autograd.pure(lambda net, x, y: nll(net(x), y))


@pytest.fixture(scope="module")
def agents():
    agents = make_agents(3)
    yield agents
    stop_all(agents, graceful=False)


def _fresh(a0, seed):
    r1 = a0.remote("w1", Stage, (5, 8, 0.3, seed))
    r2 = a0.remote("w2", Stage, (8, 4, 0.2, seed + 1))
    return Trainer(a0, r1, r2)


def _train(a0, net, loss_fn, batches):
    out = []
    for x, y in batches:
        with dist_autograd.context(a0) as cid:
            loss = dist_autograd.backward(cid, loss_fn, net, x, y, agent=a0)
            g1 = a0.rpc_async("w1", grads_of, (net.r1,)).wait()
            g2 = a0.rpc_async("w2", grads_of, (net.r2,)).wait()
        out.append((float(loss), g1, g2))
    return out


def _batches(n, rows=6, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 5)).astype(np.float32),
             rng.integers(0, 4, rows).astype(np.int32)) for _ in range(n)]


def test_compiled_pass_matches_eager_and_a_local_reference(agents):
    a0 = agents[0]
    batches = _batches(5)
    eager = _train(a0, _fresh(a0, 3), two_stage_loss, batches)
    before = dict(_compiled_root.TRACES)
    pure = _train(a0, _fresh(a0, 3), pure_two_stage_loss, batches)
    # the first pass records (eager), the second traces, every later one reuses it
    assert _compiled_root.TRACES["root"] - before.get("root", 0) == 1
    assert _compiled_root.TRACES["root runs"] - before.get("root runs", 0) == 4

    s1, s2 = Stage(5, 8, 0.3, 3), Stage(8, 4, 0.2, 4)  # the same modules, locally
    for (x, y), e, p in zip(batches, eager, pure, strict=True):
        def local(m1, m2, x=x, y=y):
            return nll(m2(m1(jnp.asarray(x)) * 2.0), jnp.asarray(y))

        want, (g1, g2) = nnx.value_and_grad(local, argnums=(0, 1))(s1, s2)
        for got in (e, p):
            np.testing.assert_allclose(got[0], float(want), rtol=1e-5)
            np.testing.assert_allclose(got[1][0], g1.lin.kernel[...], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(got[1][1], g1.lin.bias[...], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(got[2][0], g2.lin.kernel[...], rtol=1e-4, atol=1e-6)
    assert len({round(p[0], 6) for p in pure}) == len(batches)  # masks differ per step


def test_a_new_shape_records_again_and_a_remote_error_comes_back_as_itself(agents):
    a0 = agents[0]
    net = _fresh(a0, 7)
    before = dict(_compiled_root.TRACES)
    _train(a0, net, pure_two_stage_loss, _batches(3, rows=6, seed=1))
    _train(a0, net, pure_two_stage_loss, _batches(3, rows=9, seed=2))
    assert _compiled_root.TRACES["root"] - before.get("root", 0) == 2  # one per shape
    assert _compiled_root.TRACES["root runs"] - before.get("root runs", 0) == 4

    @dist_autograd.pure
    def failing(net, x, y):
        h = net.a0.rpc_async("w1", call_method, (fails_on_negative, net.r1, x)).wait()
        return nll(h[:, :4], y)

    x, y = _batches(1, seed=3)[0]
    for sign in (1, 1, 1):  # record, trace, run compiled
        with dist_autograd.context(a0) as cid:
            dist_autograd.backward(cid, failing, net, np.abs(x) * sign, y, agent=a0)
    runs = _compiled_root.TRACES["root runs"]
    with dist_autograd.context(a0) as cid:
        with pytest.raises(ValueError, match="negative batch sum"):
            dist_autograd.backward(cid, failing, net, -np.abs(x), y, agent=a0)
    assert _compiled_root.TRACES["root runs"] == runs  # it failed inside the program
    with dist_autograd.context(a0) as cid:  # the program stays usable
        dist_autograd.backward(cid, failing, net, np.abs(x), y, agent=a0)
    assert _compiled_root.TRACES["root runs"] == runs + 1


def test_passes_the_record_cannot_describe_stay_eager(agents):
    a0 = agents[0]
    net = _fresh(a0, 11)
    x, y = _batches(1, seed=4)[0]

    @dist_autograd.pure
    def overlapping(net, x, y):  # both calls start before either is waited on
        f1 = net.a0.rpc_async("w1", call_method, (stage_forward, net.r1, x))
        f2 = net.a0.rpc_async("w1", call_method, (stage_forward, net.r1, x * 0.5))
        return nll(f1.wait()[:, :4] + f2.wait()[:, :4], y)

    @dist_autograd.pure
    def with_scalar_reply(net, x, y):  # a reply that is no floating array
        scale = net.a0.rpc_async("w1", np.float32, (2.0,)).wait()
        h = net.a0.rpc_async("w1", call_method, (stage_forward, net.r1, x)).wait()
        return nll(h[:, :4] * scale, y)

    held = a0.remote("w1", np.full, ((), 2.0, np.float32))

    @dist_autograd.pure
    def with_plain_fetch(net, x, y):  # a plain call would be frozen into the program
        h = net.a0.rpc_async("w1", call_method, (stage_forward, net.r1, x)).wait()
        return nll(h[:, :4] * held.to_here(), y)

    for fn in (overlapping, with_scalar_reply, with_plain_fetch):
        before = dict(_compiled_root.TRACES)
        for _ in range(3):
            with dist_autograd.context(a0) as cid:
                loss = dist_autograd.backward(cid, fn, net, x, y, agent=a0)
                assert np.isfinite(float(loss))
                assert np.abs(a0.rpc_async("w1", grads_of, (net.r1,)).wait()[0]).sum() > 0
        assert _compiled_root.TRACES["root"] == before.get("root", 0), fn
        assert _compiled_root.TRACES["root runs"] == before.get("root runs", 0), fn


def test_a_reply_of_another_shape_raises_naming_the_function(agents):
    """A remote function whose reply shape depends on values breaks the contract: the
    compiled pass says so (and how to fix it) instead of training on a wrong shape."""
    a0 = agents[0]
    net = _fresh(a0, 13)

    @dist_autograd.pure
    def loss_fn(net, x, y):
        h = net.a0.rpc_async("w1", call_method, (first_rows, net.r1, x)).wait()
        return jnp.sum(h)

    x, y = _batches(1, seed=5)[0]
    x[0, 0] = 1.0
    for _ in range(2):
        with dist_autograd.context(a0) as cid:
            dist_autograd.backward(cid, loss_fn, net, x, y, agent=a0)
    x[0, 0] = -1.0
    with dist_autograd.context(a0) as cid:
        with pytest.raises(DistAutogradError,
                           match=r"call_method .*call 0 of .*loss_fn.*same shapes.*the mark"):
            dist_autograd.backward(cid, loss_fn, net, x, y, agent=a0)


def test_signatures_are_bounded_and_release_what_they_held(agents, monkeypatch):
    """A new RRef on every pass is a new signature (static by identity): the table keeps
    the newest MAX_SIGNATURES, so the RRefs of older ones are dropped, not kept alive."""
    import gc
    import weakref

    a0 = agents[0]
    monkeypatch.setattr(_compiled_root, "MAX_SIGNATURES", 3)
    x, y = _batches(1, seed=6)[0]
    refs = []
    for k in range(6):
        net = _fresh(a0, 20 + k)
        refs.append(weakref.ref(net))
        _train(a0, net, pure_two_stage_loss, [(x, y)])
        del net
    gc.collect()
    assert len(_compiled_root._table(a0)) == 3
    assert [r() is None for r in refs] == [True, True, True, False, False, False]


# ---- the caller's own parameter holders are part of the compiled program ------------
class Local(nnx.Module):
    """A local layer with a Dropout (its RNG state is an input and an output)."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, h):
        return self.drop(jnp.tanh(self.lin(h)))


class Holder:
    """A plain object holding a module (found as torch finds a model's tensors)."""

    def __init__(self, seed: int):
        self.inner = Local(seed)


def _locals(a0, kinds, seed):
    made = {}
    for i, kind in enumerate(kinds):
        s = seed * 10 + i
        if kind == "module":
            made[kind] = Local(s)
        elif kind == "variable":
            made[kind] = nnx.Param(jnp.linspace(0.5, 1.5, 4, dtype=jnp.float32) * (1 + s % 3))
        elif kind == "object":
            made[kind] = Holder(s)
        else:  # an RRef this worker owns, to a module
            made[kind] = dist_autograd_rref(a0, Local(s))
    return made


def dist_autograd_rref(a0, value):
    from jdist.rpc import RRef

    return RRef.owned_by(a0, value)


def _apply(made, h):
    for kind, holder in made.items():
        if kind == "module":
            h = holder(h)
        elif kind == "variable":
            h = h * holder[...]
        elif kind == "object":
            h = holder.inner(h)
        else:
            h = holder.local_value()(h)
    return h


def _local_vars(made):
    out = []
    for kind, holder in made.items():
        m = {"module": holder, "object": getattr(holder, "inner", None),
             "own_rref": None, "variable": None}[kind]
        if kind == "own_rref":
            m = holder.local_value()
        out += [holder] if kind == "variable" else [m.lin.kernel, m.lin.bias]
    return out


def _local_loss(net, made, x, y):
    h = net.a0.rpc_async("w1", call_method, (stage_forward, net.r1, x)).wait()
    return nll(_apply(made, h[:, :4]), y)


_pure_local_loss = dist_autograd.pure(_local_loss)


@given(st.lists(st.sampled_from(["module", "variable", "object", "own_rref"]), min_size=1,
                max_size=4, unique=True), st.integers(0, 50))
@example(["module", "variable", "object", "own_rref"], 0)
@settings(max_examples=scaled(3), deadline=None)
def test_local_parameter_holders_compile_and_match_the_eager_path(agents, kinds, seed):
    """A generated family: the caller's own modules, Variables, plain objects holding
    modules and RRefs it owns, in any combination after a remote stage: the compiled
    pass gives the eager path's losses, local and remote gradients and dropout masks
    (the local modules' RNG state goes in and out of the program), pass after pass."""
    a0 = agents[0]
    batches = _batches(3, seed=seed)
    runs = {}
    for name, fn in (("eager", _local_loss), ("pure", _pure_local_loss)):
        net, made = _fresh(a0, seed), _locals(a0, kinds, seed)
        before = dict(_compiled_root.TRACES)
        out = []
        for x, y in batches:
            with dist_autograd.context(a0) as cid:
                loss = dist_autograd.backward(cid, fn, net, made, x, y, agent=a0)
                g = dist_autograd.get_gradients(cid, agent=a0)
                local = [np.asarray(g[v]) for v in _local_vars(made)]
                remote = a0.rpc_async("w1", grads_of, (net.r1,)).wait()
            out.append((float(loss), local, remote))
        runs[name] = out
        if name == "pure":  # recorded, traced once, then compiled passes only
            assert _compiled_root.TRACES["root"] - before.get("root", 0) == 1
            assert _compiled_root.TRACES["root runs"] - before.get("root runs", 0) == 2
    for e, p in zip(runs["eager"], runs["pure"], strict=True):
        np.testing.assert_allclose(p[0], e[0], rtol=1e-5)
        for a, b in zip(p[1] + list(p[2]), e[1] + list(e[2]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
