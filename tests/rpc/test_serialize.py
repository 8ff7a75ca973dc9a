"""Serialization: arrays out of band without copies, jax placement, protocol round trips."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.rpc import _protocol as P
from jdist.rpc import _serialize as S


def test_numpy_goes_out_of_band_without_copies():
    arr = np.arange(1 << 16, dtype=np.float64)
    payload, bufs = S.dumps({"a": arr, "n": 3})
    assert len(payload) < 1000  # the array bytes are not in the pickle
    assert len(bufs) == 1 and np.shares_memory(np.frombuffer(bufs[0], np.float64), arr)
    received = bytearray(bufs[0])  # what the transport hands over
    out = S.loads(payload, [received])
    assert np.shares_memory(out["a"], np.frombuffer(received, np.float64))
    assert out["a"].flags.writeable and out["n"] == 3
    np.testing.assert_array_equal(out["a"], arr)


def test_jax_arrays_come_back_as_jax_on_the_default_device():
    x = jnp.arange(8, dtype=jnp.bfloat16).reshape(2, 4)
    payload, bufs = S.dumps([x, np.float32(1.5)])
    assert len(bufs) == 1 and bufs[0].nbytes == 16
    y, f = S.loads(payload, [bytearray(b) for b in bufs])
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16 and y.shape == (2, 4)
    assert y.devices() == {jax.devices()[0]}
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert f == np.float32(1.5)


@pytest.mark.parametrize("arr", [
    np.ones((64, 10), np.float32), np.arange(5), np.array(3.0), np.zeros((0, 3), np.float32),
    np.ones(3, bool), np.ones(4, jnp.bfloat16), np.arange(12, dtype=np.uint8)[1:],
], ids=lambda a: f"{a.dtype}{a.shape}")
def test_a_received_jax_array_is_placed_as_device_put_places_it(arr):
    """rebuild_jax's fast placement gives what jax.device_put gives: dtype (64-bit
    canonicalized), sharding, uncommitted, not weak, same values; and it honours
    jax.default_device."""
    got, ref = S.rebuild_jax(arr), jax.device_put(arr)
    assert (got.dtype, got.shape, got.sharding, got.weak_type, got.committed) == (
        ref.dtype, ref.shape, ref.sharding, ref.weak_type, ref.committed)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(jnp.zeros_like(got) + got), np.asarray(ref))
    other = jax.devices()[-1]
    with jax.default_device(other):
        assert S.rebuild_jax(arr).devices() == jax.device_put(arr).devices() == {other}


def test_rref_payload_cannot_be_unpickled_outside_an_agent():
    payload = pickle.dumps((S.load_hook, ((0, (0, 1), (0, 2), -1),)))
    blob = pickle.dumps(S.load_hook)  # the hook itself pickles by reference
    assert pickle.loads(blob) is S.load_hook
    with pytest.raises(pickle.UnpicklingError, match="RPC agent"):
        S.load_hook((0, (0, 1), (0, 2), -1))
    del payload


@pytest.mark.parametrize("msg", [
    P.Call(5, "mod.fn"), P.Call(6, "f", 123), P.Remote(7, "g", (1, 2), (1, 3)),
    P.Result(8), P.Failure(9), P.Control(10, int(P.ControlOp.USER_DELETE), (0, 1), (2, 3)),
])
def test_protocol_round_trip(msg):
    payload = None if isinstance(msg, P.Control) else b"payload"
    frames = P.encode(msg, payload, [memoryview(b"buf")] if payload else ())
    assert P.decode_header(frames) == msg


def test_describe_and_check_callables():
    assert S.describe_callable(np.add) == "numpy.add"
    with pytest.raises(TypeError, match="must be callable"):
        S.check_callable_picklable(3, "w1")
    with pytest.raises(TypeError, match="lambdas"):
        S.check_callable_picklable(lambda: 0, "w1")
    S.check_callable_picklable(np.add, "w1")


@jax.jit
def _jitted_double(x):
    return x * 2


@nnx.jit
def _nnx_jitted_double(x):
    return x * 2


def _nested():
    @jax.jit
    def inner(x):
        return x
    return inner


@pytest.mark.parametrize("fn", [_jitted_double, _nnx_jitted_double])
def test_jitted_functions_travel_by_reference(fn):
    """``@jax.jit`` / ``@nnx.jit`` module-level functions are sent by name, as plain
    functions are (pickle alone refuses them: the name resolves to the jitted object,
    not the function it wraps); a nested one is refused with the fix named."""
    payload, bufs = S.dumps((fn, np.ones(3)))
    back, x = S.loads(payload, bufs)
    assert back is fn and np.asarray(back(x)).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(TypeError, match="module level"):
        S.check_callable_picklable(_nested(), "w1")
