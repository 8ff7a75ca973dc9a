"""Shared test set-up: 8 virtual CPU devices, low XLA collective timeouts and one
compilation cache.

Helpers (``run_procs``, ``tree_allclose``) live in ``tests/helpers.py``.

The environment is set before JAX is imported anywhere, and spawned processes inherit
it (with their own device count).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_FLAGS = [
    "--xla_force_host_platform_device_count=8",
    # a collective whose peer never arrives fails in a minute and a half, not after the
    # group's 30 minutes; not sooner: on a loaded 2-core runner a peer may spend tens of
    # seconds compiling its first step while the other waits in a collective, and a
    # 30 s cap failed healthy jobs there (jdist caps the collective timeout 5 s below
    # the abort; tests of timeouts pass their own small group timeout)
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5",
    "--xla_cpu_collective_call_terminate_timeout_seconds=90",
    # LLVM at -O0 instead of XLA's default -O2: compiling is most of the suite's CPU
    # time, and this cuts it by about 40% (a quarter more than -O1); results move by
    # a few float32 ulps, which the tolerances against references allow. Jobs that
    # build their own XLA_FLAGS keep this one (tests.helpers.COMPILE_FLAG)
    "--xla_backend_optimization_level=0",
    # XLA:CPU's older loop emitters instead of its MLIR fusion emitters: another fifth
    # less compile time (tests/optim/test_zero_transforms.py 65 -> 50 s of CPU); the
    # programs compute the same operations
    "--xla_cpu_use_fusion_emitters=false",
]
_kept = [
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not any(f.split("=")[0] == g.split("=")[0] for g in _FLAGS)
]
os.environ["XLA_FLAGS"] = " ".join(_kept + _FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# jdist-run's workers are forked from a server that imported JAX, Flax, Optax, Orbax and
# jdist once per launch (--start-method forkserver), instead of each paying seconds of
# imports; tests/launch, which test the launcher itself, keep jdist-run's default
os.environ.setdefault("JDIST_START_METHOD", "forkserver")
os.environ.setdefault("JDIST_FORKSERVER_PRELOAD", ",".join([
    "jax", "jax.numpy", "numpy", "flax.nnx", "optax", "jdist.collectives", "jdist.ddp",
    "jdist.optim", "jdist.rpc", "jdist.sampler", "jdist.checkpoint"]))
# One JAX compilation cache for the session, this process and every job it starts:
# tests build fresh models and wrappers whose programs are the same, and jobs are
# launched again and again (restarts, twins, doc examples); each program then
# compiles once and later builds load it. The cached executables are the ones a
# compile makes, so no result changes.
# Under xdist the workers are children of the controller, so they name the cache
# after it and share it; the controller (or a plain pytest run) removes it at exit.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_CACHE = os.path.join(tempfile.gettempdir(),
                      f"jdist-tests-jax-cache-{os.getppid() if _WORKER else os.getpid()}")
os.makedirs(_CACHE, exist_ok=True)
if not _WORKER:
    atexit.register(shutil.rmtree, _CACHE, True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis profiles (`--hypothesis-profile=NAME`): "ci", the default, is fixed-seed so a
# run's examples are the same on every submission; "long" is the campaign of
# tests/differential (50x the examples, random seeds; docs/testing.md)
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=5000, deadline=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture
def mesh8():
    """A 1-D Auto mesh over the 8 virtual devices, axis ``"dp"``."""
    from jdist.collectives._group import make_mesh

    return make_mesh(jax.devices(), "dp")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker more than the cores on small machines. Many tests wait on
    real processes (a peer's start, a timeout that is the point of the test) with their
    worker idle; a third worker on two cores runs another file meanwhile."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return cores + 1 if cores <= 4 else cores


def pytest_configure(config):
    # pytest's unraisable-exception check runs gc.collect() 5 times as each worker ends
    # (about 3% of the suite's CPU in a profile, over JAX's heap); once finds the same
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:  # another pytest: its default
        pass
    else:
        config.stash[gc_collect_iterations_key] = 1


# Scheduling: xdist (--dist loadfile) hands out whole files, most tests first (its
# default reorder). Longest files first was measured slower on 2 cores (980 s against
# 650 s for the whole suite): the long files are multi-process jobs, and running them
# side by side puts 8-12 processes on 2 cores, where mixing them with short files does
# not. ``@pytest.mark.slow(seconds=N)`` marks the long end-to-end runs (the fast lane
# is ``-m "not slow"``); ``seconds`` is about what one takes on 2 busy cores.
