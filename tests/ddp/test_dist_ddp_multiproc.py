"""torch's multi-rank DDP tests of ``distributed_test.py``, on 2 real processes (gloo),
all cases in ONE shared launch (``dist_ddp_cases.main``). Each test checks torch's
assertion on what the ranks returned."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ddp import dist_ddp_cases
from tests.helpers import run_procs


@pytest.fixture(scope="module")
def ranks():
    return run_procs(dist_ddp_cases.main, 2, timeout=300)


def _case(ranks, name):
    out = [r[name] for r in ranks]
    for r, o in enumerate(out):
        assert not (isinstance(o, dict) and "error" in o and isinstance(o["error"], str)), (
            f"rank {r}: {o['error']}")
    return out


def test_ddp_broadcast_buffer(ranks):
    r0, r1 = _case(ranks, "broadcast_buffer")
    for k, (a, b) in enumerate(zip(r0["bufs"], r1["bufs"], strict=True)):
        np.testing.assert_array_equal(a, b)  # torch: all ranks hold rank 0's buffer
        np.testing.assert_allclose(a, r0["initial_rank0"] + k + 1, rtol=1e-6)


def test_ddp_init_sync_buffers_with_forward_sync_buffers_false(ranks):
    r0, r1 = _case(ranks, "init_sync_buffers_forward_sync_false")
    assert r0["flag"] is False and r1["flag"] is False
    np.testing.assert_array_equal(r0["after_init"], r1["after_init"])  # synced at init
    assert not np.array_equal(r0["after_step"], r1["after_step"])  # not at forward
    np.testing.assert_allclose(r0["after_step"], r0["after_init"] + 1, rtol=1e-6)


@pytest.mark.parametrize("kind", ["shape", "num_params"])
def test_ddp_model_diff_across_ranks(ranks, kind):
    """torch: at least one rank raises; jdist: every rank raises ModelMismatchError (a
    RuntimeError) naming the first differing parameter."""
    for err in (r[kind] for r in _case(ranks, "model_diff")):
        assert err is not None and err["class"] == "ModelMismatchError" and err["runtime"]
        assert ("embedding" in err["message"] or "lin" in err["message"]), err


def test_verify_model_across_rank(ranks):
    for err in _case(ranks, "verify_model_after_change"):
        assert err is not None and err["runtime"], err


def _mean_local(iters, key="local"):
    import jax

    return jax.tree.map(lambda *g: sum(g) / len(g), *iters)


def test_ddp_control_flow_different_across_ranks(ranks):
    r0, r1 = _case(ranks, "control_flow_different")
    for i, (a, b) in enumerate(zip(r0["iters"], r1["iters"], strict=True)):
        want = _mean_local([a["local"], b["local"]])
        for got in (a["ddp"], b["ddp"]):
            for name in ("lin1", "lin2"):
                np.testing.assert_allclose(got[name]["kernel"], want[name]["kernel"],
                                           rtol=1e-4, atol=1e-5)
            # torch's used-map: lin2 used by no rank on even iterations, by one on odd
            assert bool(np.any(got["lin2"]["kernel"])) == (i % 2 == 1)
    for err in (r0["error"], r1["error"]):
        assert err["class"] == "UnusedParametersError" and err["runtime"]
        assert "'lin2/kernel'" in err["message"]
        assert "find_unused_parameters=True" in err["message"]


def test_different_graph_across_ranks(ranks):
    r0, r1 = _case(ranks, "different_graph")
    want = _mean_local([r0["local"], r1["local"]])
    for r in (r0, r1):
        for g in r["grads"]:
            np.testing.assert_allclose(g["lin2"]["kernel"], want["lin2"]["kernel"],
                                       rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(g["lin1"]["kernel"], want["lin1"]["kernel"],
                                       rtol=1e-4, atol=1e-5)


def test_grads_same_across_ranks_with_no_sync(ranks):
    import jax

    g0, g1 = _case(ranks, "grads_same_with_no_sync")
    assert len(jax.tree.leaves(g0)) == 8  # no parameter without a gradient
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_ddp_sync_module_states(ranks):
    r0, r1 = _case(ranks, "sync_module_states")
    assert not np.array_equal(r0["before"], r1["before"])
    for r in (r0, r1):
        np.testing.assert_array_equal(r["after"], r0["before"])


def test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value(ranks):
    """Departure: ranks whose inputs differ beyond the batch size (here the spatial
    size) raise a ValueError on every rank naming each rank's shapes; torch runs them."""
    for err in _case(ranks, "syncbn_diff_input_sizes_running_value"):
        assert err is not None and err["class"] == "ValueError", err
        assert "rank 0: [(10, 2):float32], rank 1: [(100, 2):float32]" in err["message"]
        assert "pad the inputs to one shape" in err["message"]
