"""pytorch/examples' RPC pipeline in 3 real processes: shard 1 gets its gradient through
the RRef the master hands from worker 1 to worker 2, dropout masks advance per step,
and the whole training matches the same training run locally with plain nnx; calls a
loss function starts before waiting run at once, recorded in order per worker."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_procs
from tests.rpc._pipeline_workers import STEPS, reference, run


@pytest.mark.slow(seconds=15)  # a training run: ~20 s quiet, up to a minute on a loaded VM
def test_pipeline_gradients_through_forwarded_rref_and_dropout():
    out = run_procs(run, 3, timeout=240)[0]
    ref, frozen = reference(), reference(frozen_masks=True)  # here, in plain nnx
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    for a, b in zip(out["p1"], ref["p1"], strict=True):  # shard 1 trained as locally
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(out["p2"], ref["p2"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(out["z"], ref["z"], strict=True):  # the same dropout masks
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(out["z"]) == STEPS
    # with the dropout RNG not advanced, step 2 would already differ from this run
    assert not np.allclose(out["z"][1], frozen["z"][1], atol=1e-3)
    assert out["grads_nonempty"][0] is True and out["grads_nonempty"][1] == 2
    # the same shards with forward marked @dist_autograd.pure: each worker compiles it
    # once (its RRef argument fetched first) and trains exactly as the reference
    pure = out["pure"]
    np.testing.assert_allclose(pure["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    for key in ("p1", "p2", "z"):
        for a, b in zip(pure[key], ref[key], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert [t.get("pure forward") for t in out["pure_traces"]] == [1, 1]
    assert [t.get("pure backward") for t in out["pure_traces"]] == [1, 1]
    # calls started before any is waited on: both workers ran at once (worker 1's call
    # saw worker 2's start), with the right gradient (d/dw of sum(w * x0))
    assert out["overlap_saw_marker"] is True
    np.testing.assert_allclose(out["overlap_grad"], np.full(3, 1.0))
    # four calls to one worker, the later ones quicker: recorded in the order made
    assert out["order"] == [0, 1, 2, 3]
    np.testing.assert_allclose(out["order_grad"], np.full(3, 1.0 + 2.0 + 3.0 + 4.0))
    # a call the loss function never waited on still fails the pass
    assert out["unwaited_error"] is not None and "fail_later" in out["unwaited_error"]
