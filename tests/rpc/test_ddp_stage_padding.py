"""``ddp_stage(pad_batch_to=N)``: variable-size batches in one DDP program, exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist import rpc
from jdist.ddp import DistributedDataParallel as DDP
from jdist.launch import free_port
from jdist.rpc import dist_autograd

TRACES = {"n": 0}


def per_example_ce(module, x, y):
    TRACES["n"] += 1  # runs once per trace of the DDP program
    return optax.softmax_cross_entropy_with_integer_labels(module(x), y)


def _ref_loss(k, b, s, x, y):
    logits = (x * s) @ k + b
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# jitted: one program per batch size (op by op, the reference compiled ~150 programs)
_reference = jax.jit(jax.value_and_grad(_ref_loss, argnums=(0, 1, 2)))


def test_padded_stage_matches_jax_grad_and_traces_once():
    opts = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}",
                                 auth_token="test-token")
    rpc.init_rpc("trainer", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        lin = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
        lin.kernel[...] = jax.device_put(np.asarray(lin.kernel[...]), jax.local_devices()[0])
        lin.bias[...] = jax.device_put(np.asarray(lin.bias[...]), jax.local_devices()[0])
        ddp = DDP(lin)
        stage = dist_autograd.ddp_stage(ddp, per_example_ce, pad_batch_to=64)
        scale = nnx.Param(jnp.asarray(1.3, jnp.float32))
        rng = np.random.default_rng(0)
        counts = []
        for n in (5, 17, 3, 40, 64):
            x = rng.normal(size=(n, 4)).astype(np.float32)
            y = rng.integers(0, 3, n)
            want, wg = _reference(np.asarray(lin.kernel[...]), np.asarray(lin.bias[...]),
                                  np.float32(1.3), x, y)
            with dist_autograd.context() as cid:
                loss = dist_autograd.backward(
                    cid, lambda m, s, x=x, y=y: stage(x * s[...], y), lin, scale)
                grads = dist_autograd.get_gradients(cid)
                np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
                np.testing.assert_allclose(np.asarray(grads[lin.kernel]), wg[0],
                                           rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(np.asarray(grads[lin.bias]), wg[1],
                                           rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(np.asarray(grads[scale]), wg[2],
                                           rtol=1e-5, atol=1e-6)
            counts.append(TRACES["n"])
        assert counts[0] >= 1 and counts[-1] == counts[0]  # one program for five sizes
        with pytest.raises(ValueError, match="more than the largest pad_batch_to size 64"):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, lambda m: stage(np.ones((65, 4), np.float32),
                                                            np.zeros(65, int)), lin)
        with pytest.raises(TypeError, match="must be one int"):
            dist_autograd.ddp_stage(ddp, per_example_ce, pad_batch_to=[8, 16])
        bad = dist_autograd.ddp_stage(ddp, lambda m, x, y: per_example_ce(m, x, y).mean(),
                                      pad_batch_to=64)
        with pytest.raises(ValueError, match="one loss per row"):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, lambda m: bad(np.ones((5, 4), np.float32),
                                                          np.zeros(5, int)), lin)
    finally:
        rpc.shutdown()
