"""PyTorch's own DataParallel test cases (``test/distributed/test_data_parallel.py``),
written for jdist: the same inputs and assertions, with torch's CUDA devices mapped to
this process's (virtual CPU) devices and tensors to arrays."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
import torch
from flax import nnx

from jdist.dp import DataParallel, data_parallel, gather, parallel_apply

DEVS = jax.local_devices()


def test_data_parallel_module_zero_inputs():
    """A module called with no inputs runs once (torch: one replica), output on device 0."""

    class TestModule(nnx.Module):
        def __call__(self):
            t = jnp.eye(2, 3)
            return t + (1 - t)

    def check(output, expected):
        assert output.devices() == {DEVS[0]}  # torch: output.get_device() == 0
        np.testing.assert_array_equal(np.asarray(output), expected)

    expected = np.ones((2, 3), np.float32)
    model = TestModule()
    check(DataParallel(model, [0])(), expected)
    check(DataParallel(model, [0, 1])(), expected)
    check(data_parallel(model, None, [0]), expected)
    check(data_parallel(model, (), [0, 1]), expected)


def _check_gather(output_device):
    torch.manual_seed(0)
    x = (torch.randn(2, 4).numpy(), torch.randn(2, 4).numpy())
    inputs = (jax.device_put(x[0], DEVS[0]), jax.device_put(x[1], DEVS[1]))
    result = gather(inputs, output_device)
    assert result.shape == (4, 4)
    np.testing.assert_array_equal(np.asarray(result[:2]), x[0])
    np.testing.assert_array_equal(np.asarray(result[2:]), x[1])
    where = jax.devices("cpu")[0] if output_device == -1 else DEVS[output_device]
    assert result.devices() == {where}  # torch: not is_cuda for -1, else get_device()
    grad = torch.randn(4, 4).numpy()
    _, vjp = jax.vjp(lambda a, b: gather((a, b), output_device), *inputs)
    g0, g1 = vjp(jnp.asarray(grad))
    np.testing.assert_array_equal(np.asarray(g0), grad[:2])
    np.testing.assert_array_equal(np.asarray(g1), grad[2:])
    jax.test_util.check_grads(lambda a, b: gather((a, b), output_device), inputs, order=2,
                              modes=["rev"])

    # scalar inputs are stacked into a vector (with torch's warning)
    s = (torch.randn(()).double().numpy(), torch.randn(()).double().numpy())
    scalars = (jax.device_put(np.float32(s[0]), DEVS[0]),
               jax.device_put(np.float32(s[1]), DEVS[1]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = gather(scalars, output_device)
        _, vjp = jax.vjp(lambda a, b: gather((a, b), output_device), *scalars)
    assert any("scalars" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert result.shape == (2,) and result.devices() == {where}
    np.testing.assert_allclose(np.asarray(result), np.float32(s), rtol=0)
    grad = np.asarray([0.5, -2.0], np.float32)
    g0, g1 = vjp(jnp.asarray(grad))
    assert float(g0) == grad[0] and float(g1) == grad[1]


def test_gather_cpu():
    """``target_device=-1`` is torch's CPU: the host's CPU device."""
    _check_gather(-1)


def test_gather_gpu():
    _check_gather(0)


def test_parallel_apply_passes_exception():
    class TestModule(nnx.Module):
        def __call__(self, *args):
            return {}["wonderful"]

    l1 = TestModule()
    # torch's regex, verbatim: the device is named by its index, as torch prints it
    pattern = "Caught KeyError in replica \\d on device 0.\nOriginal Traceback[\\s\\S]+wonderful"
    with pytest.raises(KeyError) as info:
        parallel_apply(None, (l1, l1), (None, None))
    assert re.search(pattern, str(info.value.args[0])), info.value
