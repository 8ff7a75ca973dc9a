"""RemoteModule forwards under distributed autograd run as compiled programs, with the
calls of a module that opts into ``bucket_call`` in shape buckets (EmbeddingBag and a
user module): values and gradients equal plain jax.grad (and the generic eager path),
and new batch sizes do not compile again. A module that breaks the protocol is named."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.rpc import RemoteModule, RRef, dist_autograd
from jdist.rpc import _remote_module as RM
from jdist.rpc._buckets import next_bucket, padded_call
from jdist.rpc.autograd import _compiled
from jdist.rpc.autograd import _context as C
from jdist.testing import EmbeddingBag
from jdist.testing._embedding_bag import embedding_bag
from tests.differential import scaled
from tests.rpc.conftest import make_agents, stop_all

NUM, DIM = 30, 4


def make_bag(mode, last):
    return EmbeddingBag(NUM, DIM, mode=mode, include_last_offset=last, rngs=nnx.Rngs(3))


def table_and_grad(module_rref):
    ctx = C.current()
    emb = module_rref.local_value()
    g = dist_autograd.get_gradients(ctx.context_id, agent=ctx.agent)[emb.embedding]
    return np.asarray(emb.embedding[...]), np.asarray(g)


def batch(rng, last):
    """Variable-size bags (some empty) as the HybridModel makes them."""
    b = int(rng.integers(1, 20))
    lens = rng.integers(0, 5, b)
    idx = rng.integers(0, NUM, int(lens.sum())).astype(np.int64)
    off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    if last:
        off = np.concatenate([off, [len(idx)]]).astype(np.int64)
    return idx, off


@pytest.fixture(scope="module")
def agents():
    agents = make_agents(2)
    yield agents
    stop_all(agents, graceful=False)


def _run(a0, emb, head, scale, idx, off, mode):
    def loss_fn(head_ref, scale_ref):
        args = (idx, off)
        if mode == "sum":  # per-sample weights traced on the caller: a differentiable input
            args += (jnp.full(idx.shape, 1.0, jnp.float32) * scale_ref.local_value()[...],)
        out = emb(*args)
        return jnp.sum(jnp.tanh(out @ head_ref.local_value()[...]))

    with dist_autograd.context(a0) as cid:
        loss = dist_autograd.backward(cid, loss_fn, head, scale, agent=a0)
        grads = dist_autograd.get_gradients(cid, agent=a0)
        g_head, g_scale = np.asarray(grads[head]), np.asarray(grads[scale])
        table, g_table = a0.rpc_async("w1", table_and_grad, (emb.get_module_rref(),)).wait()
    return float(loss), table, g_table, g_head, g_scale


@pytest.mark.parametrize("mode,last", [("sum", False), ("mean", True), ("max", False)])
def test_bucketed_lookup_matches_jax_grad_and_compiles_once(agents, mode, last):
    a0 = agents[0]
    emb = RemoteModule("w1", make_bag, (mode, last), agent=a0)
    head = RRef.owned_by(a0, nnx.Param(
        jnp.linspace(-1, 1, DIM * 3, dtype=jnp.float32).reshape(DIM, 3)))
    scale = RRef.owned_by(a0, nnx.Param(jnp.asarray(0.7, jnp.float32)))
    rng = np.random.default_rng(0)
    before = dict(_compiled.TRACES)
    for _ in range(4):
        idx, off = batch(rng, last)
        loss, table, g_table, g_head, g_scale = _run(a0, emb, head, scale, idx, off, mode)

        def ref(tab, h, s, idx, off):
            psw = jnp.full(idx.shape, 1.0, jnp.float32) * s if mode == "sum" else None
            out = embedding_bag(tab, idx, off, mode=mode, per_sample_weights=psw,
                                include_last_offset=last)
            return jnp.sum(jnp.tanh(out @ h))

        h = head.local_value()[...]
        s = scale.local_value()[...]
        # one compiled reference per batch shape (eagerly, each of its ops compiles)
        want, wg = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2)))(table, h, s, idx, off)
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g_table, wg[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g_head, wg[1], rtol=1e-5, atol=1e-6)
        if mode == "sum":
            np.testing.assert_allclose(g_scale, wg[2], rtol=1e-5, atol=1e-6)
    # four batch sizes, one bucket: one forward and one backward program traced
    assert _compiled.TRACES["forward"] - before.get("forward", 0) == 1
    assert _compiled.TRACES["backward"] - before.get("backward", 0) == 1

    # the generic eager path gives the same numbers
    idx, off = batch(rng, last)
    got = _run(a0, emb, head, scale, idx, off, mode)
    RM._forward._jdist_compiled_forward = False
    try:
        eager = _run(a0, emb, head, scale, idx, off, mode)
    finally:
        RM._forward._jdist_compiled_forward = True
    for g, e in zip(got, eager, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # plain (non-autograd) forward: bucketed too, exact
    plain = np.asarray(emb(idx, off))
    want = embedding_bag(jnp.asarray(got[1]), idx, off, mode=mode, include_last_offset=last)
    np.testing.assert_allclose(plain, want, rtol=1e-6, atol=1e-6)


def test_bucket_sizes_and_unbucketed_inputs(agents):
    assert [next_bucket(n) for n in (0, 1, 64, 65, 200)] == [64, 64, 64, 128, 256]
    a0 = agents[0]
    emb = RemoteModule("w1", make_bag, ("mean", False), agent=a0)
    table = a0.rpc_async("w1", table_and_grad_plain, (emb.get_module_rref(),)).wait()
    idx2d = np.arange(12).reshape(3, 4) % NUM  # 2-D bags: not padded, still exact
    np.testing.assert_allclose(np.asarray(emb(idx2d)),
                               embedding_bag(table, idx2d, mode="mean"), rtol=1e-6)
    args = (np.arange(5), np.array([0, 2]))
    assert padded_call(make_bag("mean", False), args).args[0].shape == (64,)
    assert padded_call(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), args) is None


def table_and_grad_plain(module_rref):
    return np.asarray(module_rref.local_value().embedding[...])


class _DropoutNet(nnx.Module):
    """A Linear and a Dropout: the compiled forward must advance the owner's RNG."""

    def __init__(self):
        rngs = nnx.Rngs(5)
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


def _lin_grad(module_rref):
    ctx = C.current()
    m = module_rref.local_value()
    g = dist_autograd.get_gradients(ctx.context_id, agent=ctx.agent)[m.lin.kernel]
    return np.asarray(g)


def test_dropout_module_compiles_once_and_matches_local_grad(agents):
    """A RemoteModule with Dropout (an RngCount in its non-parameter state) runs as one
    compiled program; each step's loss and kernel gradient equal nnx.value_and_grad on
    an identical local module (same masks: the owner's RNG advances once per call)."""
    a0, _ = agents
    net = RemoteModule("w1", _DropoutNet, agent=a0)
    ref = _DropoutNet()
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4)
    w = np.arange(18, dtype=np.float32).reshape(6, 3) / 10
    before = dict(_compiled.TRACES)
    losses = []
    for _ in range(3):
        with dist_autograd.context(a0) as cid:
            loss = dist_autograd.backward(
                cid, lambda s: jnp.sum(net(jnp.asarray(x) * s) * w), jnp.float32(1.0),
                agent=a0)
            g = a0.rpc_async("w1", _lin_grad, (net.get_module_rref(),)).wait()
        want, grads = nnx.value_and_grad(lambda m: jnp.sum(m(jnp.asarray(x)) * w))(ref)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
        np.testing.assert_allclose(g, np.asarray(grads.lin.kernel[...]), rtol=1e-5, atol=1e-6)
        losses.append(float(loss))
    assert len(set(losses)) == 3, f"dropout masks repeated across steps: {losses}"
    assert _compiled.TRACES["forward"] - before.get("forward", 0) == 1
    assert _compiled.TRACES["backward"] - before.get("backward", 0) == 1


# ---- the bucket_call protocol: any module may opt in; nothing keyed on a class ------
class RaggedScale(nnx.Module):
    """A user module (not jdist's): ``w * x`` row by row for ``(n, 3)`` inputs, padded
    to multiples of 8 rows through ``bucket_call``."""

    def __init__(self):
        self.w = nnx.Param(jnp.asarray([0.5, -1.0, 2.0], jnp.float32))

    def bucket_call(self, x):
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            return None
        big = np.zeros((-(-x.shape[0] // 8) * 8, x.shape[1]), x.dtype)
        big[: x.shape[0]] = x
        return (big,), x.shape[0]

    def __call__(self, x):
        return jnp.tanh(x * self.w[...])


def _w_grad(module_rref):
    ctx = C.current()
    m = module_rref.local_value()
    return np.asarray(dist_autograd.get_gradients(ctx.context_id, agent=ctx.agent)[m.w])


def test_a_user_module_opting_in_compiles_once_per_bucket(agents):
    a0, _ = agents
    net = RemoteModule("w1", RaggedScale, agent=a0)
    ref = RaggedScale()
    before = dict(_compiled.TRACES)
    for n in (3, 5, 8, 1):  # one bucket of 8 rows
        x = np.linspace(-1, 1, 3 * n, dtype=np.float32).reshape(n, 3)
        with dist_autograd.context(a0) as cid:
            loss = dist_autograd.backward(
                cid, lambda s, x=x: jnp.sum(net(jnp.asarray(x) * s) ** 2), jnp.float32(1.5),
                agent=a0)
            g = a0.rpc_async("w1", _w_grad, (net.get_module_rref(),)).wait()
        want, grads = nnx.value_and_grad(lambda m, x=x: jnp.sum(m(x * 1.5) ** 2))(ref)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
        np.testing.assert_allclose(g, np.asarray(grads.w[...]), rtol=1e-5, atol=1e-7)
        out = np.asarray(net(x))  # the plain forward: padded too, cut back exactly
        np.testing.assert_allclose(out, np.tanh(x * ref.w[...]), rtol=1e-6)
        assert out.shape == (n, 3)
    assert _compiled.TRACES["forward"] - before.get("forward", 0) == 1
    assert _compiled.TRACES["backward"] - before.get("backward", 0) == 1


class _Bad(nnx.Module):
    def __init__(self, answer):
        self.answer = answer

    def bucket_call(self, x):
        return self.answer(x)

    def __call__(self, x):
        return x


@pytest.mark.parametrize("answer,error,text", [
    (lambda x: x, TypeError, "must return None or (padded_args, rows)"),
    (lambda x: ((x, x), 1), TypeError, "one padded argument per argument"),
    (lambda x: ((x,), -1), TypeError, "rows as an int >= 0"),
    (lambda x: ((x[:1],), 1), ValueError, "padded only at the end"),
    (lambda x: ((x.astype(np.float64),), 1), ValueError, "same dtype and rank"),
])
def test_a_module_breaking_the_protocol_is_named(answer, error, text):
    with pytest.raises(error, match="_Bad.bucket_call") as e:
        padded_call(_Bad(answer), (np.ones((2, 3), np.float32),))
    assert text in str(e.value)


@functools.partial(jax.jit, static_argnames=("mode", "last", "rows"))
def _bag_loss_and_grads(table, idx, off, psw, proj, *, mode, last, rows):
    def loss(tab, w):
        out = embedding_bag(tab, idx, off, mode=mode, include_last_offset=last,
                            per_sample_weights=w)
        return jnp.sum(jnp.sin(out[:rows] @ proj))

    return jax.value_and_grad(loss, argnums=(0, 1))(table, psw)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=30), st.booleans(),
       st.sampled_from(["sum", "mean", "max"]), st.booleans(), st.integers(0, 3))
@settings(max_examples=scaled(12))
def test_embedding_bag_buckets_keep_values_and_gradients(lens, last, mode, weighted, seed):
    """A generated family: bags of any sizes (empty ones too), every mode and offset
    convention, with and without per-sample weights: the padded call's first rows and
    the gradients (table, weights) equal the unpadded call's (each one compiled
    program; the padded shapes fall into a few buckets)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, NUM, sum(lens)).astype(np.int32)
    off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    if last:
        off = np.concatenate([off, [len(idx)]]).astype(np.int32)
    sum_weights = weighted and mode == "sum"
    psw = rng.standard_normal(len(idx)).astype(np.float32) if sum_weights else None
    bag = make_bag(mode, last)
    args = (idx, off) + (() if psw is None else (psw,))
    p = padded_call(bag, args)
    assert p is not None and p.rows == len(lens)
    table, proj = bag.embedding[...], jnp.linspace(-1, 1, DIM)
    kw = {"mode": mode, "last": last, "rows": len(lens)}
    want = _bag_loss_and_grads(table, idx, off, psw, proj, **kw)
    got = _bag_loss_and_grads(table, *p.args[:2], None if psw is None else p.args[2], proj,
                              **kw)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5, atol=1e-6)
    if psw is not None:
        np.testing.assert_allclose(p.cut_argument(2, got[1][1]), want[1][1], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("module", [RaggedScale, _DropoutNet])
def test_concurrent_forwards_of_one_remote_module(agents, module):
    """RPC runs calls on a pool of threads: many callers' forwards of one module at once
    (nnx.jit on one module from two threads corrupted it: "object has no attribute")
    all succeed, with the output a local module gives (Dropout: in eval mode, and its
    RNG state advancing in training mode without an error)."""
    import threading

    a0, _ = agents
    net = RemoteModule("w1", module, agent=a0)
    ref = module()
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4)[:, :3 if module is RaggedScale
                                                                 else 4]
    if module is _DropoutNet:
        net.eval()
        ref.eval()
    want = np.asarray(ref(x))
    errors, outs = [], []

    def caller():
        try:
            for _ in range(60):
                outs.append(np.asarray(net(x)))
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(e)[:500])

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(outs) == 240
    for o in outs:
        np.testing.assert_allclose(o, want, rtol=1e-6, atol=1e-7)
    if module is _DropoutNet:  # training mode: the RNG state is written back, no error
        net.train()
        masks = {np.asarray(net(x)).tobytes() for _ in range(3)}
        assert len(masks) == 3
