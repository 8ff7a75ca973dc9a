"""ZeRO's collectives in buckets (``bucket_cap_mb``): any cap gives the unsharded optax
result, no collective carries more than the cap (a bigger leaf alone), and a step's
temporary memory follows the cap, not the parameters (jdist/optim/_zero_comm.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.ddp.hooks import comm_report
from jdist.optim import ZeroRedundancyOptimizer
from jdist.optim._zero_comm import length
from tests.optim.test_zero import group_of, plain_steps, zero_steps

MIB = 1 << 20
_TOL = {"float32": 1e-6, "bfloat16": 2e-2}


def _tree(shapes, dtypes, seed):
    rng = np.random.default_rng(seed)
    return {f"p{i}": jnp.asarray(rng.standard_normal(s), dtype=d)
            for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))}


def _grads(params, n, steps, seed):
    rng = np.random.default_rng(seed + 1)
    return [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal((n,) + p.shape),
                                               dtype=p.dtype), params)
            for _ in range(steps)]


def _run(params, seq, n, cap_mb, average):
    zero = ZeroRedundancyOptimizer(optax.adam(0.1), group=group_of(n), bucket_cap_mb=cap_mb,
                                   average_gradients=average)
    if not average:  # DDP hands over averaged gradients
        seq = [jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), g) for g in seq]
    f, args = zero_steps(zero, params, zero.init(params), seq)
    return f, args, jax.device_get(f(*args)[0])


def _check_caps(report, params, n, cap_bytes):
    """Every all-gather / reduce-scatter carries at most the cap, or one leaf."""
    one_leaf = {length(np.shape(p), n) * n for p in params.values() if np.ndim(p)}
    for c in report.collectives:
        if c.op in ("all-gather", "reduce-scatter"):
            full = max(c.elements, c.result_elements)
            itemsize = {"f32": 4, "bf16": 2}[c.dtype]
            assert full * itemsize <= cap_bytes or full in one_leaf, (c, cap_bytes)


@settings(max_examples=6, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=2), min_size=1,
                       max_size=5),
       bf16=st.lists(st.booleans(), min_size=5, max_size=5), n=st.sampled_from([2, 3, 4]),
       average=st.booleans(), cap=st.integers(2, 400), seed=st.integers(0, 2**16))
def test_any_cap_gives_the_optax_result(shapes, bf16, n, average, cap, seed):
    """Caps of a few leaves (``cap`` bytes) and of one byte (every leaf alone); one
    bucket per dtype (the default's 25 MiB here) is tests/optim/test_zero.py's."""
    dtypes = ["bfloat16" if b else "float32" for b in bf16[:len(shapes)]]
    params = _tree([tuple(s) for s in shapes], dtypes, seed)
    seq = _grads(params, n, 2, seed)
    ref, _ = jax.jit(plain_steps, static_argnums=0)(optax.adam(0.1), params, seq)
    for cap_mb in (cap / MIB, 1 / MIB):
        f, args, got = _run(params, seq, n, cap_mb, average)
        _check_caps(comm_report(f, *args), params, n, max(1, int(cap_mb * MIB)))
        for k, v in got.items():
            tol = _TOL[str(v.dtype)]
            np.testing.assert_allclose(np.asarray(v, np.float32),
                                       np.asarray(ref[k], np.float32), rtol=tol, atol=tol,
                                       err_msg=f"{k}, cap {cap_mb} MiB")


def test_step_temporaries_follow_the_cap():
    """8 leaves of 1 MiB over 2 replicas: with a 1 MiB cap the collectives' temporaries
    are a couple of leaves; with one bucket they are 1.5x all the parameters."""
    params = {f"w{i}": jnp.ones((512, 512)) for i in range(8)}  # 8 MiB of float32
    seq = _grads(params, 2, 1, 0)
    temps = {}
    for cap_mb in (1, 1e9):
        for average in (False, True):
            f, args, _ = _run(params, seq, 2, cap_mb, average)
            temps[cap_mb, average] = f.lower(*args).compile().memory_analysis() \
                .temp_size_in_bytes
    for average in (False, True):
        assert temps[1e9, average] >= 12 * MIB, temps  # the gathered buffer and its pieces
        assert temps[1, average] <= 5 * MIB, temps


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "25", True])
def test_bad_caps_are_refused_by_value(bad):
    with pytest.raises(ValueError, match=f"bucket_cap_mb must be a positive number of MiB, "
                                         f"got {bad!r}"):
        ZeroRedundancyOptimizer(optax.sgd(0.1), group=group_of(2), bucket_cap_mb=bad)
