"""examples/hybrid_ddp_rpc.py (3 real processes) equals the same maths in one process,
and torch's HybridModel (torch RPC + DDP + dist_autograd + DistributedOptimizer) run
from the same weights and batches in the same processes.

The single-process reference is float64 numpy with the gradients written out (not JAX:
it is the independent check). torch runs with its trainers' optimizer steps under one
lock (``benchmarks.hybrid`` ``locked_steps``): torch's default TorchScript SGD steps
race on the shared table."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.hybrid import both
from jdist.launch._spawn import free_port
from tests.helpers import run_procs


@pytest.mark.slow(seconds=25)  # a long end-to-end run
def test_hybrid_matches_single_process_reference_and_torch():
    from examples.hybrid_ddp_rpc import config, reference

    argv = ["--smoke"]
    results = run_procs(both, 3, args=(argv, free_port(), free_port(), True), timeout=300)
    assert results[1] is None and results[2] is None
    mine, torch_out = results[0]["jdist"], results[0]["torch"]
    want = reference(config(argv))
    start = reference(dict(config(argv), steps=0))["table"]
    assert np.abs(mine["table"] - start).max() > 1e-3  # the embedding gradients arrived
    for other in (want, torch_out):
        np.testing.assert_allclose(mine["table"], other["table"], rtol=1e-5, atol=1e-5)
    for r, res in zip((1, 2), mine["trainers"], strict=True):
        theirs = torch_out["trainers"][r - 1]
        for other in (want, theirs):
            np.testing.assert_allclose(res["kernel"], other["kernel"], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(res["bias"], other["bias"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(res["losses"], want["losses"][r], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(res["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
