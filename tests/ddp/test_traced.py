"""DDP called on traced values raises at once, naming ``ddp_stage`` and how to use it.

torch's HybridModel trainer (the DDP + RPC tutorial) computes
``loss = criterion(ddp_model(emb_out), y)`` inside a dist_autograd context; in jdist the
loss function runs under ``jax.vjp``, so the DDP forward gets tracers. It used to fail
deep in ``ddp/_placement.py`` with JAX's "The 'sharding' attribute is not available on
traced array"; it now raises a ``TypeError`` that says what to do instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.ddp import DistributedDataParallel as DDP


def _ddp():
    return DDP(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))


def test_forward_and_steps_under_jax_transformations_name_ddp_stage():
    ddp = _ddp()
    x = np.ones((8, 3), np.float32)
    with pytest.raises(TypeError, match=r"ddp\(x\) got traced values.*ddp_stage\(ddp"):
        jax.grad(lambda v: jnp.sum(ddp(v)))(x)
    with pytest.raises(TypeError, match="ddp_stage"):
        jax.jit(lambda v: ddp(v))(x)
    vg = ddp.value_and_grad(lambda m, b: jnp.mean(m(b) ** 2))
    with pytest.raises(TypeError, match=r"ddp.value_and_grad / ddp.train_step got traced"):
        jax.jit(lambda v: vg(v)[0])(x)
    # outside any transformation the same calls work
    assert ddp(x).shape == (8, 2)
    assert np.isfinite(float(vg(x)[0]))


def test_ddp_forward_inside_dist_autograd_backward_names_ddp_stage():
    from jdist import rpc
    from jdist.launch import free_port
    from jdist.rpc import dist_autograd

    opts = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}",
                                 auth_token="test-token")
    rpc.init_rpc("trainer", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        ddp = _ddp()
        emb = nnx.Param(jnp.ones((8, 3)))  # stands for the remote embedding's output

        def loss_fn(e):
            return jnp.mean(ddp(e[...] * 2.0) ** 2)  # the HybridModel's criterion(ddp(x))

        with dist_autograd.context() as cid:
            with pytest.raises(TypeError, match="jdist.rpc.dist_autograd.ddp_stage"):
                dist_autograd.backward(cid, loss_fn, emb)
        # what the error says to do, with a parameter committed to one device (DDP then
        # returns its gradient on that device): the gradients of the plain loss
        lin = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
        lin.kernel[...] = jax.device_put(np.asarray(lin.kernel[...]), jax.local_devices()[0])
        ref = jax.grad(lambda k: jnp.mean((np.ones((8, 3)) @ k + lin.bias[...]) ** 2))(
            np.asarray(lin.kernel[...]))
        stage = dist_autograd.ddp_stage(DDP(lin), lambda m, x: jnp.mean(m(x) ** 2))
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, lambda m: stage(np.ones((8, 3), np.float32)), lin)
            grads = dist_autograd.get_gradients(cid)
            np.testing.assert_allclose(np.asarray(grads[lin.kernel]), np.asarray(ref),
                                       rtol=1e-5, atol=1e-6)
    finally:
        rpc.shutdown()
