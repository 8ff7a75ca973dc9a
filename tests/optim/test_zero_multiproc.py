"""ZeRO over 2 real processes (gloo): shards live on different processes."""

from __future__ import annotations

import jax
import numpy as np
import optax

from tests.helpers import run_procs, tree_allclose
from tests.optim.zero_mp_cases import grads_np, params_np, zero_child


def test_zero_two_processes_equals_unsharded_adam():
    res = run_procs(zero_child, 2, timeout=180)
    tx = optax.adam(1e-2)
    params, state = params_np(), tx.init(params_np())
    for g in grads_np(2):
        u, state = tx.update(jax.tree.map(lambda x: x.mean(0), g), state, params)
        params = optax.apply_updates(params, u)
    total = sum(x.size for x in jax.tree.leaves(params_np()))  # 91 + 7 + 21 = 119
    for r in res:
        tree_allclose(r["params"], params, rtol=1e-6, atol=1e-6)
        assert r["local_bytes"] == 2 * 4 * -(-total // 2) + 4  # mu, nu shard + count
    tree_allclose(res[0]["state"], state, rtol=1e-6, atol=1e-6)
    assert "consolidate_state_dict(to=1)" in res[1]["error"]
    assert np.isfinite(res[0]["params"]["w1"]).all()
