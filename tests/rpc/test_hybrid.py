"""examples/hybrid_ddp_rpc.py (3 real processes) equals the same maths in one process."""

from __future__ import annotations

import numpy as np

from tests.helpers import run_procs


def _rank_main(argv):
    from examples.hybrid_ddp_rpc import main

    return main(argv)


def test_hybrid_matches_single_process_reference():
    from examples.hybrid_ddp_rpc import config, reference

    results = run_procs(_rank_main, 3, args=(["--smoke"],), timeout=240)
    out = results[0]
    assert results[1] is None and results[2] is None
    want = reference(config(["--smoke"]))
    np.testing.assert_allclose(out["table"], want["table"], rtol=1e-5, atol=1e-5)
    for r, res in zip((1, 2), out["trainers"], strict=True):
        np.testing.assert_allclose(res["kernel"], want["kernel"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(res["bias"], want["bias"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(res["losses"], want["losses"][r], rtol=1e-5, atol=1e-6)
    # the table moved (the embedding gradients reached the parameter server)
    start = reference(dict(config(["--smoke"]), steps=0))["table"]
    assert np.abs(out["table"] - start).max() > 1e-3
