"""Test helpers: run a function in real processes, compare pytrees.

Import from here (``from tests.helpers import run_procs``), never from conftest: a
spawned child that unpickles a test function imports its module, and must not re-run
conftest's environment set-up.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jdist.launch import set_forkserver_preload, spawn

# the compile-time and collective-timeout flags tests/conftest.py sets (read back from
# it); jobs that build their own XLA_FLAGS add them
COMPILE_FLAG = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                        if f.startswith(("--xla_backend_optimization_level=",
                                         "--xla_cpu_use_fusion_emitters=",
                                         "--xla_cpu_collective_call_")))

# what the ranks of the suite's jobs import: a fork server imports it once per test
# session, instead of every rank of every job for seconds (tests/launch checks that
# forked ranks behave as fresh ones); torch too, for the ranks that run torch twins
# or build torch references (3 s of imports each), with torch._dynamo, which torch's
# optimizers import at their first step (another 1.4 s per rank)
set_forkserver_preload(["torch", "torch._dynamo", "jax", "jax.numpy", "numpy", "flax.nnx",
                        "optax", "jdist.collectives", "jdist.ddp", "jdist.optim", "jdist.rpc",
                        "jdist.sampler", "tests.helpers"])


def run_procs(fn, nprocs=2, *, args=(), devices_per_proc=1, timeout=120.0, env=None,
              rank_args=None):
    """Run ``fn(*args)`` in ``nprocs`` real processes (free ports, gloo, hard timeout),
    forked from the suite's fork server (``spawn(start_method="forkserver")``).

    Returns each rank's return value; on a failure the test fails with every rank's
    stderr tail (``jdist.launch.SpawnError``). ``fn`` must be a module-level function.
    """
    return spawn(fn, args=args, nprocs=nprocs, devices_per_proc=devices_per_proc,
                 timeout=timeout, env=env, rank_args=rank_args, start_method="forkserver")


def tree_allclose(a, b, rtol=1e-6, atol=1e-6):
    """Assert two pytrees have the same structure and close leaves."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, waiting for its reaper, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
