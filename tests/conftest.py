"""Shared test set-up: 8 virtual CPU devices and low XLA collective timeouts.

Helpers (``run_procs``, ``tree_allclose``) live in ``tests/helpers.py``.

The environment is set before JAX is imported anywhere, and spawned processes inherit
it (with their own device count).
"""

from __future__ import annotations

import os

_FLAGS = [
    "--xla_force_host_platform_device_count=8",
    # a collective whose peer never arrives fails in seconds instead of minutes
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5",
    "--xla_cpu_collective_call_terminate_timeout_seconds=30",
]
_kept = [
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not any(f.split("=")[0] == g.split("=")[0] for g in _FLAGS)
]
os.environ["XLA_FLAGS"] = " ".join(_kept + _FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def mesh8():
    """A 1-D Auto mesh over the 8 virtual devices, axis ``"dp"``."""
    from jdist.collectives._group import make_mesh

    return make_mesh(jax.devices(), "dp")
