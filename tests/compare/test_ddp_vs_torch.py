"""jdist DDP vs torch DDP (gloo), 2 processes each: same weights, data order, results."""

from __future__ import annotations

import numpy as np

from tests.compare import ddp_cases
from tests.helpers import run_procs


def test_jdist_ddp_matches_torch_ddp():
    theirs = run_procs(ddp_cases.torch_main, 2, timeout=240)
    ours = run_procs(ddp_cases.jdist_main, 2, devices_per_proc=1, timeout=240)
    for rank in range(2):
        for name in ("mlp", "cnn"):
            t_state = theirs[rank][name][1]
            j_losses, j_state = ours[rank][name]
            # torch returns each rank's local loss; jdist the mean over replicas
            t_mean = np.mean([theirs[r][name][0] for r in range(2)], axis=0)
            np.testing.assert_allclose(j_losses, t_mean, rtol=1e-5, atol=1e-5)
            assert t_state.keys() == j_state.keys()
            for k in t_state:
                np.testing.assert_allclose(j_state[k], t_state[k], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name} {k} rank {rank}")
        # join with 5 vs 3 batches: torch's numbers, and both runs returned
        np.testing.assert_allclose(ours[rank]["join"], theirs[rank]["join"], rtol=1e-6)
        # no_sync: both ranks end with [3, 2]
        np.testing.assert_allclose(theirs[rank]["no_sync"], [3.0, 2.0])
        np.testing.assert_allclose(ours[rank]["no_sync"], [3.0, 2.0])
