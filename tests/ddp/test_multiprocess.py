"""One launch of 2 processes x 2 devices checks training, init sync, mismatch and join."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

from jdist.collectives._group import ProcessGroup, make_mesh
from tests.ddp import mp_cases
from tests.ddp.models import MLP, data, max_diff, reference_train
from tests.helpers import run_procs


def _four_device_group():
    devs = tuple(jax.devices()[:4])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name="four")


def _reference(tx):
    model = MLP(rngs=nnx.Rngs(0))
    losses = reference_train(model, tx, [data(seed=s) for s in range(3)])
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_two_processes_two_devices_each():
    res = run_procs(mp_cases.multiprocess_main, 2, devices_per_proc=2, timeout=240)
    assert [r["devices"] for r in res] == [4, 4]
    for name, tx in [("sgd", optax.sgd(0.1)), ("adam", optax.adam(1e-2))]:
        ref_losses, ref_params = _reference(tx)
        for r in res:
            losses, params = r[name]
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
            assert max_diff(params, ref_params) < 1e-5
    # the same code on 1 process x 4 devices gives the same results
    one_proc = mp_cases.train_mlp(0, 1, 0.002, "sgd", group=_four_device_group())
    for r in res:
        np.testing.assert_allclose(r["sgd"][0], one_proc[0], rtol=1e-6)
        assert max_diff(r["sgd"][1], one_proc[1]) < 1e-6
    # init sync: both ranks hold rank 0's initial weights
    rank0 = nnx.to_pure_dict(nnx.state(MLP(rngs=nnx.Rngs(10)), nnx.Param))
    assert max_diff(res[0]["synced"], rank0) == 0.0
    assert max_diff(res[1]["synced"], rank0) == 0.0
    # a different model raises on every rank, naming the path and both shapes
    for r in res:
        msg = r["mismatch"]
        assert msg and "'layers/0/bias'" in msg
        assert "rank 0: 'layers/0/bias' shape (32,)" in msg
        assert "rank 1: 'layers/0/bias' shape (33,)" in msg
    # join: rank 0 has 5 batches, rank 1 has 3; grads of absent replicas count as zeros
    # and the mean still divides by all 4 replicas (divide_by_initial_world_size=True)
    expect = -sum((2 * 1 * (i + 1) + (2 * 2 * (i + 1) if i < 3 else 0)) / 4 for i in range(5))
    # divide_by_initial_world_size=False: the mean over the replicas still active
    active = -sum((2 * 1 * (i + 1) + 2 * 2 * (i + 1)) / 4 if i < 3 else (i + 1)
                  for i in range(5))
    for r in res:
        np.testing.assert_allclose(r["join"], [expect] * 3)
        np.testing.assert_allclose(r["join_active"], [active] * 3)
    # throw_on_early_termination: torch's texts, on both ranks, nothing hangs
    assert res[1]["join_throw"] == "Rank 1 exhausted all inputs."
    assert res[0]["join_throw"] == ("Detected at least one rank that exhausted inputs. "
                                    "Throwing across all ranks.")
    # torch's test_DistributedDataParallelCPU: p + g with DDP's gradients tracks torch's
    # non-parallel model (tests/ddp/test_torch_conformance.py)
    for r in res:
        assert len(r["ddp_cpu"]["diffs"]) == 5 and max(r["ddp_cpu"]["diffs"]) < 1e-5, r
    # the demo runs on 2 processes x 2 devices (smoke mode) and agrees on the accuracy
    ex = [r["example"] for r in res]
    assert [e["rank"] for e in ex] == [0, 1] and ex[0]["world"] == 2
    assert ex[0]["accuracy"] == ex[1]["accuracy"] and 0.0 <= ex[0]["accuracy"] <= 1.0
    assert ex[0]["losses"] == ex[1]["losses"] and len(ex[0]["losses"]) == 3
