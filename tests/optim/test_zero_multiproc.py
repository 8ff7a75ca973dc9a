"""ZeRO over 2 real processes (gloo): shards live on different processes; plain Adam and
tree-dependent transformations (callable mask + global-norm clip, multi_transform
labels with LAMB) equal unsharded optax."""

from __future__ import annotations

import jax
import numpy as np
import optax

from tests.helpers import run_procs, tree_allclose
from tests.optim.zero_mp_cases import CASES, grads_np, make_tx, params_np, zero_child


def test_zero_two_processes_equals_unsharded_optax():
    res = run_procs(zero_child, 2, timeout=240)
    for name in CASES:
        tx = make_tx(name)
        params, state = params_np(), tx.init(params_np())
        for g in grads_np(2):
            u, state = tx.update(jax.tree.map(lambda x: x.mean(0), g), state, params)
            params = optax.apply_updates(params, u)
        for r in res:
            tree_allclose(r["cases"][name]["params"], params, rtol=1e-6, atol=1e-6)
        tree_allclose(res[0]["cases"][name]["state"], state, rtol=1e-6, atol=1e-6)
        assert "consolidate_state_dict(to=1)" in res[1]["cases"][name]["error"]
    # Adam: mu and nu hold ceil(size / 2) of each leaf (91, 7, 21) + the int32 count
    assert all(r["cases"]["adam"]["local_bytes"] == 2 * 4 * (46 + 4 + 11) + 4 for r in res)
    assert np.isfinite(res[0]["cases"]["adam"]["params"]["w1"]).all()

