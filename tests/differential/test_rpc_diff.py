"""Distributed autograd over random RPC call graphs: jdist's rpc vs torch's.

Generated (``rpc_cases.build_tree``): a tree of local operations and RPCs across 3
workers, nested up to four deep: ``rpc_sync``, ``rpc_async(...).wait()`` and
``remote(...).to_here()``, a ``remote()`` whose RRef is handed to a third worker that
calls ``to_here()``, arguments evaluated by the caller or by the callee (a callee that
calls further workers itself, back into its caller too), parameters owned by every
worker and used where they live, some used twice, and RRefs of all of them handed on
with every call. One
torch rpc job and one jdist rpc job (3 processes each, kept for the session) run each
tree from the same parameter values under a distributed autograd context; the loss and
every parameter's gradient (read on its owner) must agree with each other to float32
rounding, and both with the same tree differentiated in one process by ``jax.grad``.

Found by it: a call whose callee called back into the caller, which called the callee
again (w0 -> w2 -> w0 -> w2), hung in jdist: the second call to w2 waited to be
recorded after the first, which waited for it (``DistAutogradContext.chain`` now orders
only the calls made by the same code: the loss function, or one incoming call).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.differential import replayed, scaled
from tests.differential.pool import pools
from tests.differential.rpc_cases import build_tree, jdist_case, reference, torch_case


@st.composite
def cases(draw):
    owners: list[int] = []

    def choice(options):
        return draw(st.sampled_from(options))

    tree = build_tree(choice, draw(st.integers(1, 4)), 0, owners)
    return {"tree": tree, "owners": owners, "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=scaled(6), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
@replayed("rpc")
def test_dist_autograd_over_random_call_graphs_matches_torch(case):
    exact = reference(case)
    want = pools.get("torch_rpc", 3).run(torch_case, case)[0]
    got = pools.get("jdist_rpc", 3).run(jdist_case, case)[0]
    for name, res in (("torch", want), ("jdist", got)):
        np.testing.assert_allclose(res["loss"], exact["loss"], rtol=1e-5, atol=1e-5,
                                   err_msg=f"{name}'s loss")
        assert len(res["grads"]) == len(case["owners"]), name
        for i, (g, e) in enumerate(zip(res["grads"], exact["grads"], strict=True)):
            np.testing.assert_allclose(
                g, e, rtol=1e-5, atol=1e-5,
                err_msg=f"{name}: parameter {i} (owner w{case['owners'][i]})")
    for i, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"jdist vs torch: parameter {i}")
