"""parallel_apply: results per replica, dispatch before await, torch's error wrapping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.dp import parallel_apply, replicate, scatter
from jdist.dp._parallel_apply import _programs
from jdist.dp._scatter_gather import mesh_for

DEVS = jax.devices()


def _affine(p, x, scale=1.0):
    return (x @ p["w"] + p["b"]) * scale


def _params():
    return {"w": jnp.arange(6.0).reshape(3, 2) / 6, "b": jnp.ones(2)}


def test_outputs_match_each_replica_computed_alone():
    p = _params()
    x = jnp.arange(30.0).reshape(10, 3)
    reps = replicate(p, DEVS[:4])
    ins = scatter(x, DEVS[:4])
    outs = parallel_apply(_affine, reps, ins, [{"scale": 2.0}] * 4, DEVS[:4])
    for i, (o, xi) in enumerate(zip(outs, ins, strict=True)):
        assert o.devices() == {DEVS[i]}
        np.testing.assert_allclose(o, _affine(p, np.asarray(xi), 2.0), rtol=1e-6)
    # replicas 0-2 (equal chunks of 3) ran as one SPMD program over their devices
    assert ("fused", _affine, mesh_for(tuple(DEVS[:3]))) in _programs._lru


def test_fused_replicas_keep_per_replica_scalars_and_objects():
    def stats(p, x):
        return {"sum": jnp.sum(x) * p, "rows": x.shape[0], "tag": "t"}

    ins = scatter(jnp.arange(8.0), DEVS[:4])
    outs = parallel_apply(stats, replicate(2.0, DEVS[:4]), ins)
    assert [float(o["sum"]) for o in outs] == [2.0, 10.0, 18.0, 26.0]
    assert all(o["sum"].shape == () and o["rows"] == 2 and o["tag"] == "t" for o in outs)
    assert outs[3]["sum"].devices() == {DEVS[3]}
    with pytest.raises(ZeroDivisionError, match=f"Caught ZeroDivisionError in replica 0 on "
                                                f"device {DEVS[0].id}\\."):
        parallel_apply(lambda p, x: 1 / 0, replicate(2.0, DEVS[:4]), ins)


def test_all_replicas_dispatched_before_any_is_awaited(monkeypatch):
    events = []

    def fn(p, x):
        events.append(("dispatch", x.shape[0]))  # runs when the replica's program is traced
        return x * p

    real = jax.block_until_ready

    def spy(x):
        events.append(("await",))
        return real(x)

    monkeypatch.setattr(jax, "block_until_ready", spy)
    outs = parallel_apply(fn, [2.0] * 3, [jnp.ones(n) for n in (5, 6, 7)])
    assert [e[0] for e in events] == ["dispatch"] * 3 + ["await"] * 3
    np.testing.assert_array_equal(outs[2], 2 * np.ones(7))


def test_replica_exception_is_wrapped_with_replica_device_and_traceback():
    def fn(p, x):
        if x.shape[0] == 1:
            raise KeyError("boom in the last chunk")
        return x * p

    ins = scatter(jnp.ones(10), DEVS[:4])  # chunks 3, 3, 3, 1
    with pytest.raises(KeyError) as info:
        parallel_apply(fn, replicate(1.0, DEVS[:4]), ins, devices=DEVS[:4])
    msg = str(info.value)
    assert f"Caught KeyError in replica 3 on device {DEVS[3].id}." in msg
    assert "Original Traceback (most recent call last)" in msg
    assert "boom in the last chunk" in msg and "in fn" in msg


def test_wrapped_error_falls_back_to_runtime_error_for_odd_exception_types():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    def fn(p, x):
        raise Odd(1, 2)

    with pytest.raises(RuntimeError, match="Caught Odd in replica 0"):
        parallel_apply(fn, [1.0], [jnp.ones(2)])


def test_nnx_replicas_are_called_and_keep_their_own_batch_stats():
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    reps = replicate(bn, DEVS[:2])
    x = jnp.arange(16.0).reshape(8, 2)
    ins = scatter(x, DEVS[:2])
    outs = parallel_apply(None, reps, ins)
    for r, xi, o in zip(reps, ins, outs, strict=True):
        ref = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
        np.testing.assert_allclose(o, ref(np.asarray(xi)), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r.mean.get_value(), ref.mean.get_value(), rtol=1e-6)


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 replicas, 1 inputs"):
        parallel_apply(_affine, [1, 2], [jnp.ones(1)])


def test_timeout_names_the_unfinished_replica():
    from jdist.dp._parallel_apply import _await

    class NeverReady:  # a result whose computation never finishes
        def is_ready(self):
            return False

    with pytest.raises(TimeoutError, match="replica 2 on device cpu:2 did not finish within 0.05"):
        _await([NeverReady()], 0.05, 2, "cpu:2")
    with pytest.raises(ValueError, match="timeout must be"):
        parallel_apply(_affine, [_params()], [jnp.ones((1, 3))], timeout=-1)
    out = parallel_apply(_affine, [_params()], [jnp.ones((1, 3))], timeout=30.0)
    np.testing.assert_allclose(out[0], _affine(_params(), np.ones((1, 3))), rtol=1e-6)
