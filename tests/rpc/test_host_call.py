"""``_host.host_call``: a host function inside a compiled program, by JAX's buffer
callback where it exists, equal to ``jax.pure_callback`` (the reference) for a generated
family of operand and result shapes and dtypes, inside ``jit``, ``grad`` (through a
``custom_vjp``) and with operands the host function keeps after it returns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.rpc.autograd import _host
from jdist.rpc.autograd._host import host_call

DTYPES = [np.float32, np.int32, np.float16, np.bool_]


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=1, max_size=3),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=3, max_size=3),
       out_dtype=st.sampled_from([np.float32, np.int32]))
def test_matches_pure_callback(shapes, dtypes, out_dtype):
    rng = np.random.default_rng(0)
    ops = [(rng.standard_normal(s) * 3).astype(d)
           for s, d in zip(shapes, dtypes[:len(shapes)], strict=True)]
    specs = [jax.ShapeDtypeStruct(tuple(s) + (2,), out_dtype) for s in shapes]

    def fn(*xs):  # host numpy: each operand, doubled, with a new last axis
        return tuple(np.stack([x.astype(out_dtype) * 2, x.astype(out_dtype) + 1], -1)
                     for x in xs)

    got = jax.jit(lambda *o: host_call(fn, specs, *o))(*ops)
    want = jax.jit(lambda *o: host_call(fn, specs, *o, use_buffers=False))(*ops)
    for g, w, s in zip(got, want, specs, strict=True):
        assert g.shape == s.shape and g.dtype == s.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_operands_kept_after_the_call_are_copies():
    kept = []

    def fn(x):
        kept.append(x)
        return (x * 0,)

    f = jax.jit(lambda x: host_call(fn, [jax.ShapeDtypeStruct((3,), np.float32)], x * 1))
    for i in range(3):
        jax.block_until_ready(f(jnp.full((3,), float(i))))
    assert [k.tolist() for k in kept] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


def test_under_a_custom_vjp_gradients_flow():
    spec = [jax.ShapeDtypeStruct((4,), np.float32)]

    @jax.custom_vjp
    def square(x):
        return host_call(lambda a: (a * a,), spec, x)[0]

    square.defvjp(lambda x: (square(x), x),
                  lambda x, ct: (host_call(lambda a, c: (2 * a * c,), spec, x, ct)[0],))
    x = jnp.arange(4.0)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: square(x).sum()))(x), 2 * x)


@pytest.mark.skipif(_host._buffer_callback is None, reason="this JAX has no buffer_callback")
@pytest.mark.parametrize("bad", ["count", "shape"])
def test_a_wrong_result_raises_naming_the_fix(bad):
    spec = [jax.ShapeDtypeStruct((2,), np.float32)]
    fn = (lambda x: (x, x)) if bad == "count" else (lambda x: (np.zeros(3, np.float32),))
    with pytest.raises(Exception, match="one array per output spec" if bad == "count"
                       else r"returned shape \(3,\) for an output of shape \(2,\)"):
        jax.jit(lambda x: host_call(fn, spec, x))(jnp.ones(2)).block_until_ready()
