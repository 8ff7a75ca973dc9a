"""``uncommitted`` (``jdist/collectives/_result.py``) places a host array as
``jax.device_put(host)`` does: a generated grid of shapes and dtypes gives the same
values, dtype, device and uncommitted placement as ``jax.device_put``; and after JAX
made a new client (``clear_backends``, as a second ``init_process_group`` does) the
arrays land on the new client's device (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jdist.collectives.runtime import uncommitted

DTYPES = ["float32", "int32", "bool", "uint8", "float16", "int64", "float64", "complex64"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 0, 4), (1000,)])
def test_same_placement_as_device_put(shape, dtype):
    rng = np.random.default_rng(len(shape))
    host = (rng.standard_normal(shape) * 10).astype(dtype)
    got, want = uncommitted(host), jax.device_put(host)
    assert not got.committed and got.devices() == want.devices()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_new_client_gets_the_arrays():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import jax.extend.backend as jeb
        from jdist.collectives.runtime import uncommitted
        first = uncommitted(np.ones(3, np.float32))
        jeb.clear_backends()
        again = uncommitted(np.arange(3, dtype=np.float32))
        assert again.devices() == {jax.local_devices()[0]}, (again.devices(), jax.devices())
        print("SUM", float(jnp.sum(again + jnp.ones(3))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SUM 6.0" in out.stdout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 0, 4), (1, 1000)])
def test_aligned_arrays_are_taken_without_a_copy(shape, dtype):
    from jdist._aligned import ALIGN, aligned_empty

    host = aligned_empty(shape, dtype)
    assert host.shape == shape and host.dtype == np.dtype(dtype)
    assert (host.size == 0 or host.ctypes.data % ALIGN == 0) and host.flags.writeable
    host[...] = np.arange(host.size).reshape(shape).astype(dtype)
    placed = uncommitted(host)
    np.testing.assert_array_equal(np.asarray(placed), host)
    if host.size and jax.dtypes.canonicalize_dtype(host.dtype) == host.dtype:
        assert placed.unsafe_buffer_pointer() == host.ctypes.data  # (the mechanism's point)
