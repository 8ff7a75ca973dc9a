"""Comm hooks through a small test-local reducer on the 8 virtual devices.

The reducer here is deliberately independent of jdist.ddp (it is the oracle's
plumbing): it cuts a gradient pytree into fixed buckets (reverse leaf order, like
torch), builds :class:`GradBucket` values, threads the hook state bucket by bucket and
stacks per-replica state outside ``shard_map`` (the contract of
``jdist.ddp.hooks._state``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.collectives._group import make_mesh
from jdist.ddp import hooks as H
from jdist.errors import BucketLayoutError

N = 8
AXIS = "dp"


def bucket_layout(leaves, cap_elems):
    """Reverse leaf order, close a bucket once it holds >= cap elements (torch's rule)."""
    layout, cur, size = [], [], 0
    for i in reversed(range(len(leaves))):
        cur.append(i)
        size += leaves[i].size
        if size >= cap_elems:
            layout.append(cur)
            cur, size = [], 0
    if cur:
        layout.append(cur)
    return layout


def make_buckets(leaves, layout, n=N):
    out = []
    for bi, idxs in enumerate(layout):
        gs = tuple(leaves[j] for j in idxs)
        if isinstance(gs[0], jax.ShapeDtypeStruct):
            buf = jax.ShapeDtypeStruct((sum(g.size for g in gs),), gs[0].dtype)
        else:
            buf = jnp.concatenate([g.reshape(-1) for g in gs])
        out.append(H.GradBucket(bi, buf, gs, tuple(f"leaf{j}" for j in idxs),
                                bi == len(layout) - 1, AXIS, n))
    return out


def reduce_tree(hook, state, grads, layout, n=N):
    """Inside shard_map: run the hook on every bucket, return (reduced grads, state)."""
    leaves, tree = jax.tree.flatten(grads)
    new = list(leaves)
    for b in make_buckets(leaves, layout, n):
        out, state = hook(state, b)
        assert out.shape == b.buffer.shape and out.dtype == b.buffer.dtype
        pos = 0
        for j, g in zip(layout[b.index], b.gradients, strict=True):
            new[j] = out[pos:pos + g.size].reshape(g.shape)
            pos += g.size
    return jax.tree.unflatten(tree, new), state


def make_reducer(hook, layout, mesh=None):
    """jit(shard_map) step: stacked per-replica grads + stacked state -> same."""
    mesh = mesh or make_mesh(jax.devices()[:N], AXIS)
    n = mesh.devices.size

    def body(grads, state):
        g = jax.tree.map(lambda x: x[0], grads)
        out, st = reduce_tree(hook, H.unstack_local(state), g, layout, n)
        return jax.tree.map(lambda x: x[None], out), H.stack_local(st)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                                 out_specs=(P(AXIS), P(AXIS)), check_vma=False))


def run_hook(hook, state, grads_stacked, cap=10**9, init=True):
    """Init + stack the state, run one reduction, return (reduced stacked grads, state)."""
    leaves = jax.tree.leaves(jax.tree.map(lambda x: x[0], grads_stacked))
    layout = bucket_layout(leaves, cap)
    arrays, static = H.split_static(state)
    if init and arrays is not None:
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        state = H.init_hook_state(hook, state, make_buckets(specs, layout))
        arrays, static = H.split_static(state)
    step = make_reducer(lambda s, b: _static_hook(hook, s, b, static), layout)
    sharding = NamedSharding(make_mesh(jax.devices()[:N], AXIS), P(AXIS))
    return step, jax.device_put(H.stack_hook_state(arrays, N), sharding), static


def _static_hook(hook, arrays, bucket, static):
    out, st = hook(H.merge_static(arrays, static), bucket)
    return out, H.split_static(st)[0]


def random_grads(key, shapes, n=N, dtype=jnp.float32):
    keys = jax.random.split(key, len(shapes))
    return {f"p{i:02d}": jax.random.normal(k, (n,) + s, dtype) for i, (k, s) in
            enumerate(zip(keys, shapes, strict=True))}


SHAPES = [(16, 8), (8,), (8, 4, 3), (4,), (32, 32)]


def _mean(g):
    return jax.tree.map(lambda x: jnp.broadcast_to(x.astype(jnp.float32).mean(0), x.shape), g)


def _max_err(a, b):
    return max(float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _psgd(**kw):
    kw.setdefault("start_powerSGD_iter", 2)
    return H.PowerSGDState(**kw)


FULL_RANK = dict(matrix_approximation_rank=100, min_compression_rate=0.1)

# (name, hook, state factory, max abs error vs the exact mean (None: lossy), or a pair
# (during PowerSGD's warm-up, after it))
HOOKS = [
    ("allreduce", H.allreduce_hook, lambda: None, 1e-6),
    ("allreduce_group", H.allreduce_hook, lambda: _group(), 1e-6),
    ("fp16", H.fp16_compress_hook, lambda: None, 2e-3),
    ("bf16", H.bf16_compress_hook, lambda: None, 2e-2),
    ("fp16_wrap_allreduce", H.fp16_compress_wrapper(H.allreduce_hook), lambda: None, 2e-3),
    ("bf16_wrap_allreduce", H.bf16_compress_wrapper(H.allreduce_hook), lambda: None, 2e-2),
    ("powerSGD_full_rank", H.powerSGD_hook, lambda: _psgd(**FULL_RANK), 2e-5),
    ("powerSGD_full_rank_no_ef_no_warm", H.powerSGD_hook,
     lambda: _psgd(use_error_feedback=False, warm_start=False, start_powerSGD_iter=0,
                   **FULL_RANK), 2e-5),
    ("powerSGD_rank1", H.powerSGD_hook, lambda: _psgd(), None),
    ("powerSGD_rank3_qr", H.powerSGD_hook, lambda: _psgd(matrix_approximation_rank=3), None),
    ("batched_powerSGD", H.batched_powerSGD_hook, lambda: _psgd(), None),
    ("fp16_wrap_powerSGD", H.fp16_compress_wrapper(H.powerSGD_hook), lambda: _psgd(),
     (2e-3, None)),
]


def _group():
    from jdist.collectives._group import local_group
    return local_group()


@pytest.mark.parametrize("name,hook,make_state,tol", HOOKS, ids=[h[0] for h in HOOKS])
def test_hook_conformance(name, hook, make_state, tol):
    grads = random_grads(jax.random.key(1), SHAPES)
    step, state, static = run_hook(hook, make_state(), grads, cap=300)
    struct = jax.tree.structure(state)
    for it in range(3):  # PowerSGD: 2 warm-up steps, then compressed
        out, state = step(grads, state)
        # state round-trips through jit with one structure; no retrace after the first
        assert jax.tree.structure(state) == struct
        pairs = zip(jax.tree.leaves(out), jax.tree.leaves(grads), strict=True)
        for leaf_out, leaf_in in pairs:
            assert leaf_out.dtype == leaf_in.dtype and leaf_out.shape == leaf_in.shape
            # every replica got the same reduced gradients
            np.testing.assert_array_equal(np.asarray(leaf_out), np.broadcast_to(
                np.asarray(leaf_out[:1]), leaf_out.shape))
        warm_tol, steady_tol = tol if isinstance(tol, tuple) else (tol or 1e-6, tol)
        bound = warm_tol if it < 2 else steady_tol  # PowerSGD warm-up: plain all-reduce
        if bound is not None:
            assert _max_err(out, _mean(grads)) <= bound, (name, it)
        if hasattr(state, "iter") or (isinstance(state, H.PowerSGDState)):
            np.testing.assert_array_equal(np.asarray(state.iter), np.full(N, it + 1))
    assert step._cache_size() == 1
    if name == "fp16_wrap_powerSGD":  # memories in the compressed dtype
        assert hook.__name__ == "fp16_compress_wrapper(powerSGD_hook)"
        assert {x.dtype for x in jax.tree.leaves(state.error_dict)} == {jnp.dtype(jnp.float16)}


def test_lossy_powersgd_differs_from_mean_but_keeps_scale():
    grads = random_grads(jax.random.key(2), SHAPES)
    step, state, _ = run_hook(H.powerSGD_hook, _psgd(), grads, cap=300)
    for _ in range(3):
        out, state = step(grads, state)
    big = out["p04"][0]
    ref = _mean(grads)["p04"][0]
    assert float(jnp.abs(big - ref).max()) > 1e-2  # rank 1 of a random 32x32 is lossy
    # rank-1 approximation = projection of the mean onto span(P): never longer than it
    assert float(jnp.linalg.norm(big)) <= float(jnp.linalg.norm(ref)) * (1 + 1e-5)
    # vectors are never compressed with the default min_compression_rate=2
    np.testing.assert_allclose(out["p01"][0], _mean(grads)["p01"][0], rtol=1e-5, atol=1e-6)


def test_lazy_state_equals_initialized_state():
    grads = random_grads(jax.random.key(3), SHAPES)
    eager, s_e, _ = run_hook(H.powerSGD_hook, _psgd(), grads, cap=300)
    lazy, s_l, _ = run_hook(H.powerSGD_hook, _psgd(), grads, cap=300, init=False)
    assert s_l.error_dict == {} and len(s_e.error_dict) == 2
    for _ in range(4):
        o_e, s_e = eager(grads, s_e)
        o_l, s_l = lazy(grads, s_l)
    assert jax.tree.structure(s_e) == jax.tree.structure(s_l)
    assert _max_err(o_e, o_l) == 0.0 and _max_err(s_e, s_l) == 0.0
    assert lazy._cache_size() == 2  # traced again once the memories exist


def test_powersgd_state_validation_matches_torch():
    msg = "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled"
    for kw in ({}, {"use_error_feedback": False}, {"warm_start": False}):
        with pytest.raises(ValueError, match=msg):
            H.PowerSGDState(start_powerSGD_iter=1, **kw)
    st = H.PowerSGDState(use_error_feedback=False, warm_start=False, start_powerSGD_iter=0)
    assert st.start_powerSGD_iter == 0
    d = H.PowerSGDState()
    assert (d.matrix_approximation_rank, d.start_powerSGD_iter, d.min_compression_rate,
            d.use_error_feedback, d.warm_start, d.orthogonalization_epsilon, d.random_seed,
            d.compression_stats_logging_frequency, d.batch_tensors_with_same_shape) == (
        1, 1000, 2, True, True, 0, 0, 10000, False)
    with pytest.raises(ValueError, match="matrix_approximation_rank must be an int >= 1, got 0"):
        H.PowerSGDState(matrix_approximation_rank=0)


def test_bad_states_raise_clear_errors():
    grads = random_grads(jax.random.key(5), [(4, 4)])
    leaves = jax.tree.leaves(jax.tree.map(lambda x: x[0], grads))
    (bucket,) = make_buckets(leaves, [[0]])
    with pytest.raises(TypeError, match="expects a PowerSGDState as its state, got NoneType"):
        H.powerSGD_hook(None, bucket)
    with pytest.raises(TypeError, match="allreduce_hook expects state=None or a jdist "
                                        "ProcessGroup, got int"):
        H.allreduce_hook(3, bucket)
    with pytest.raises(ValueError, match="reduces over mesh axis 'dp', but DDP reduces this "
                                         "bucket over 'other'"):
        H.fp16_compress_hook(_group(), bucket._replace(axis_name="other"))
    state = H.init_hook_state(H.powerSGD_hook, _psgd(), [bucket])
    bigger = make_buckets([jnp.zeros((5, 4))], [[0]])[0]
    with pytest.raises(BucketLayoutError, match=r"error memory of bucket 0 has shape \(16,\)"):
        H.init_hook_state(H.powerSGD_hook, state, [bigger])
    with pytest.raises(ValueError, match=r"new buffer has shape \(3,\), expected \(16,\)"):
        H.bucket_with_buffer(bucket, jnp.zeros(3))
    for hook, st in ((H.allreduce_hook, None), (H.powerSGD_hook, _psgd())):
        with pytest.raises(ValueError, match="it was called outside .register it with "
                                             r"ddp.register_comm_hook\(state, hook\)"):
            hook(st, bucket)


def test_error_feedback_accumulates_to_true_sum():
    """With EF, the sum of compressed updates tracks the sum of true means (bounded error)."""
    grads = random_grads(jax.random.key(6), [(24, 16)])
    true = _mean(grads)["p00"][0]

    def run(ef, steps):
        st = _psgd(use_error_feedback=ef, start_powerSGD_iter=2 if ef else 0, warm_start=ef)
        step, state, _ = run_hook(H.powerSGD_hook, st, grads)
        total = jnp.zeros_like(true)
        errs = []
        for k in range(steps):
            out, state = step(grads, state)
            total = total + out["p00"][0]
            errs.append(float(jnp.linalg.norm(total / (k + 1) - true) / jnp.linalg.norm(true)))
        return errs

    with_ef = run(True, 60)
    without = run(False, 60)
    # the gap between the sums, k * err_k, stays bounded with error feedback (so the
    # average converges like 1/k) and grows linearly without it
    assert 60 * with_ef[59] <= 1.2 * 30 * with_ef[29]
    assert with_ef[59] < 0.2 and with_ef[59] < with_ef[10] / 3
    assert 60 * without[59] >= 1.9 * 30 * without[29] and without[59] > 0.5


@pytest.mark.parametrize("hook,compressed", [(H.powerSGD_hook, 3), (H.batched_powerSGD_hook, 2)])
def test_powersgd_collectives_per_bucket_as_torch(hook, compressed):
    """One bucket of matrices and vectors: rest + P + Q (batched: P + Q); warm-up: 1."""
    grads = random_grads(jax.random.key(7), [(32, 16), (16,), (16, 8), (8,)])
    step, state, _ = run_hook(hook, _psgd(), grads)  # one bucket (cap 1e9)
    rep = H.comm_report(step, grads, state)
    by_branch = {}
    for c in rep.collectives:
        assert c.op == "all-reduce" and len(c.branch) == 1
        by_branch.setdefault(c.branch[0][1], []).append(c)
    # lax.cond(iter < start, warm, compress): branch 1 = warm-up, branch 0 = compressed
    assert len(by_branch[1]) == 1 and by_branch[1][0].elements == 32 * 16 + 16 + 16 * 8 + 8
    assert len(by_branch[0]) == compressed
    if hook is H.powerSGD_hook:
        assert sorted(c.elements for c in by_branch[0]) == sorted([16 + 8, 32 + 16, 16 + 8])
