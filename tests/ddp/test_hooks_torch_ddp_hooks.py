"""torch's test/distributed/algorithms/ddp_comm_hooks/test_ddp_hooks.py, translated.

torch runs DDP on 2 ranks of one ``Task`` (``p = randn(40, 20)``, ``forward(x, rank) =
p * x ** (1 + rank)``) and compares the gradient with a built-in hook to the gradient
with none. Here the 2 ranks are 2 replicas on 2 local devices; each replica's batch row
carries its rank, so the forward is the same per-rank function.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp import hooks as H
from jdist.errors import ReplicaDivergenceError

WORLD = 2


def group(n=WORLD, name="torch_ddp_hooks"):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"{name}{n}")


class Task(nnx.Module):
    def __init__(self):
        self.p = nnx.Param(jnp.asarray(np.random.RandomState(0).randn(40, 20), jnp.float32))

    def __call__(self, x):
        return self.p[...] * x


def forward_mean(module, batch):
    """torch's ``model(input, rank).mean()``: ``x ** (1 + rank)`` on this replica."""
    x, rank = batch["x"][0], batch["rank"][0]
    return jnp.mean(module(jnp.where(rank == 0, x, x * x)))


def batch():
    x = np.random.RandomState(2020).randn(40, 20).astype(np.float32)
    return {"x": np.stack([x] * WORLD), "rank": np.arange(WORLD)}


def get_grads(hook_type=None, pg=None):
    pg = pg or group()
    ddp = DDP(Task(), process_group=pg)
    if hook_type is not None:
        H.register_ddp_comm_hook(hook_type, ddp, state=pg)
    _, grads = ddp.value_and_grad(forward_mean)(batch())
    return np.asarray(grads["p"])


@pytest.fixture(scope="module")
def reference():
    ref = get_grads()
    x = batch()["x"][0]
    # the mean of the two ranks' gradients x / 800 and x**2 / 800
    np.testing.assert_allclose(ref, (x + x * x) / (2 * 800), rtol=1e-5, atol=1e-7)
    return ref


def test_ddp_comm_hook_allreduce_hook(reference):
    hook = get_grads(H.DDPCommHookType.ALLREDUCE)
    np.testing.assert_allclose(hook, reference, rtol=1e-5, atol=0)


def test_ddp_comm_hook_fp16compress_hook(reference):
    hook = get_grads(H.DDPCommHookType.FP16_COMPRESS)
    np.testing.assert_allclose(hook, reference, rtol=1e-5, atol=1e-4)


def test_ddp_comm_hook_quantize_per_tensor_hook(reference):
    hook = get_grads(H.DDPCommHookType.QUANTIZE_PER_TENSOR)
    np.testing.assert_allclose(hook, reference, rtol=1e-5, atol=1e-4)


def test_ddp_comm_hook_quantize_per_channel_hook(reference):
    hook = get_grads(H.DDPCommHookType.QUANTIZE_PER_CHANNEL)
    np.testing.assert_allclose(hook, reference, rtol=1e-5, atol=1e-4)


def test_ddp_comm_hook_noop_hook(reference):
    """Departure: torch's noop hook leaves each rank its own gradient (the test then
    all-reduces by hand); DDP keeps one replicated copy of the parameters, so a hook
    whose result differs across replicas raises ReplicaDivergenceError at the step."""

    def noop_hook(state, bucket):
        return bucket.buffer, state

    ddp = DDP(Task(), process_group=group())
    ddp.register_comm_hook(None, noop_hook)
    with pytest.raises(ReplicaDivergenceError, match=re.escape(
            "comm hook 'test_ddp_comm_hook_noop_hook.<locals>.noop_hook' returned a buffer "
            "for bucket 0 that differs across replicas (800 of 800 elements differ")):
        ddp.value_and_grad(forward_mean)(batch())
    # the failure leaves nothing behind: JAX's effects barrier passes
    jax.effects_barrier()
    # what torch's test computes by hand is the hook-free reference
    x = batch()["x"][0]
    summed = (x + x * x) / 800
    np.testing.assert_allclose(summed / WORLD, reference, rtol=1e-5, atol=1e-7)


class Deep(nnx.Module):
    """torch's Linear(2, 4000) + 10 x Linear(4000, 4000) (no bias), at width 40 and
    depth 5 (several buckets all the same)."""

    def __init__(self, width=40, depth=5):
        rngs = nnx.Rngs(0)
        self.first = nnx.Linear(2, width, use_bias=False, rngs=rngs)
        self.rest = nnx.List([nnx.Linear(width, width, use_bias=False, rngs=rngs)
                              for _ in range(depth)])

    def __call__(self, x):
        x = self.first(x)
        for layer in self.rest:
            x = layer(x)
        return x


def test_is_last_hook():
    flags = []

    def hook(flags_state, bucket):
        flags.append(bucket.is_last)  # traced once per bucket, in reduction order
        return H.allreduce_hook(None, bucket)[0], flags_state

    ddp = DDP(Deep(), process_group=group(), bucket_cap_mb=0.01)
    ddp.register_comm_hook(None, hook)
    x = np.random.RandomState(0).randn(10, 2).astype(np.float32)
    ddp.value_and_grad(lambda m, b: jnp.sum(m(b)))(x)
    assert len(flags) == len(ddp.buckets.buckets) > 2
    assert flags[-1]
    assert not any(flags[:-1])


def test_quantization_params_and_codes_match_torch_observers():
    """The hooks' scales, zero points and uint8 codes equal torch's observers' (the
    torch oracle: MinMaxObserver / PerChannelMinMaxObserver and its quantize helper)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as tq

    from jdist.ddp.hooks import _quantization as q

    x = (np.random.RandomState(0).randn(1000) * 1e-3).astype(np.float32)
    obs = torch.ao.quantization.MinMaxObserver()
    obs(torch.from_numpy(x))
    s, z = obs.calculate_qparams()
    ms, mz = q._qparams(jnp.asarray(x))
    assert (float(ms), float(mz)) == (float(s), float(z))
    np.testing.assert_array_equal(np.asarray(q._quantize(jnp.asarray(x), ms, mz)),
                                  tq._quantize_per_tensor_backend(torch.from_numpy(x), s, z))
    chunks = np.pad(x, (0, 24)).reshape(-1, 512)
    pobs = torch.ao.quantization.PerChannelMinMaxObserver()
    pobs(torch.from_numpy(chunks))
    ps, pz = pobs.calculate_qparams()
    mps, mpz = q._qparams(jnp.asarray(chunks), axis=1)
    np.testing.assert_allclose(np.asarray(mps), ps.numpy(), rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(mpz), pz.numpy())
