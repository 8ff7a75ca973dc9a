"""A compilation cache shared by the jobs these tests launch.

The kill test starts its two ranks four times and compiles the same DDP programs in
every attempt (and once more for the uninterrupted reference run); with JAX's
persistent cache each program is compiled once per test session, and the later
attempts load it. The cached executables are the ones a fresh compile makes, so the
results the tests compare are unchanged.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def compile_cache_env(tmp_path_factory) -> dict:
    """Environment variables that give a launched job the session's compilation cache."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
