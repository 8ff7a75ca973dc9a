"""torch's distributed_test.py join / uneven-input DDP tests (``join|uneven``) on jdist.

Every case runs in one shared launch of 2 processes (tests/algorithms/ddp_join_cases.py);
the in-process checks cover ``Join([ddp])`` itself.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.algorithms.join import Join
from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp._join import DDPJoinHook
from jdist.errors import JoinError
from tests.algorithms import ddp_join_cases as cases
from tests.helpers import run_procs

DETECTED = "Detected at least one rank that exhausted inputs. Throwing across all ranks."


@pytest.fixture(scope="module")
def ranks():
    return run_procs(cases.main, 2, timeout=420)


def _same_on_every_rank(values):
    assert len(set(values)) == 1, values


def test_ddp_grad_div_uneven_inputs(ranks):
    for rank, r in enumerate(ranks):
        grads = r["grad_div"]
        n_iters = 3 + (2 if rank > 0 else 0)
        # divide_by_initial_world_size=False: joined ranks add zeros and the mean is over
        # the active ones, so the gradient stays grad_scale
        assert len(grads[False]) == n_iters
        for g in grads[False]:
            np.testing.assert_array_equal(g, np.full((5, 5), 50.0, np.float32))
        # True (default): always divided by the initial world size
        for i, g in enumerate(grads[True]):
            effective_ws = r["world"] - (1 if i >= 3 else 0)
            np.testing.assert_array_equal(g, np.full((5, 5), 50.0 * effective_ws / r["world"]))


def test_ddp_join_model_equivalence(ranks):
    for r in ranks:
        local, ddp = r["model_equivalence"]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     local, ddp)


def test_ddp_uneven_inputs_stop_iteration_sync_bn(ranks):
    for name in ("bn", "comm"):
        got = [r["sync_bn"][name] for r in ranks]
        for rank, g in enumerate(got):
            assert g["n"] == 5
            cls, msg = g["error"]
            assert cls == "JoinError"  # a RuntimeError, torch's class
            assert msg == (f"Rank {rank} exhausted all inputs." if rank != 0 else DETECTED)
        _same_on_every_rank([g["digest"] for g in got])


def test_ddp_uneven_inputs(ranks):
    keys = [k for k in ranks[0]["uneven"] if k[0] != "cpu"]
    assert len(keys) == 3 * 7 - 4 + 2
    max_rank = ranks[0]["world"] - 1
    for key in keys:
        name, variant, mapping = key
        got = [r["uneven"][key] for r in ranks]
        min_iters = got[0]["min_num_iters"]
        for rank, g in enumerate(got):
            if variant == "throw":
                assert g["total_iters"] == min_iters, key
                cls, msg = g["error"]
                assert cls == "JoinError"
                assert msg == ("Rank 0 exhausted all inputs." if rank == 0 else DETECTED)
            else:
                assert g["error"] is None, (key, g["error"])
                assert g["total_iters"] >= min_iters, key
                # every rank agreed on the last joiner as the authoritative rank
                assert g["authoritative_rank"] == max_rank, key
        _same_on_every_rank([g["digest"] for g in got])


def test_join_rank_without_inputs(ranks):
    """A rank with no input at all (torch's mapping {0: 0, 1: 3}) gets the others' step
    call and shadows it; a fresh module too (its first step is inside the context)."""
    got = [r["uneven"]["small_model", "plain", "0+3"] for r in ranks]
    for g in got:
        assert g["error"] is None and g["authoritative_rank"] == 1
    assert [g["total_iters"] for g in got] == [0, 3]
    _same_on_every_rank([g["digest"] for g in got])
    # rank 1 alone: x = i + 1 on 2 rows, loss = sum -> grad 2 * (i + 1), divided by the
    # initial world size 2; sgd(0.1) from the same initial kernel on both ranks
    (init_a, a, _, _), (init_b, b, _, _) = (r["fresh"] for r in ranks)
    np.testing.assert_array_equal(init_a, init_b)
    np.testing.assert_array_equal(a, b)
    expected = init_a - 0.1 * sum(2.0 * (i + 1) / 2 for i in range(3))
    np.testing.assert_allclose(a, expected, rtol=1e-6)


def test_join_ddp_with_a_user_joinable(ranks):
    """Join([ddp, all_reducer]): rank 0 has 2 iterations, rank 1 has 4."""
    totals = [r["fresh"][2] for r in ranks]
    assert totals == [2 * 2, 2 * 2 + 2 * 1]  # torch's formula for the all-reducer
    _same_on_every_rank([r["fresh"][3] for r in ranks])


def test_join_smaller_last_batch_on_the_rank_still_training(ranks):
    """The joined rank replays its 4-row batch as 3 rows: one program, no padding."""
    (init, a), (_, b) = (r["smaller_last"] for r in ranks)
    np.testing.assert_array_equal(a, b)
    # two steps of 4 ones on both ranks (grad 4 per rank, mean 4), then 3 rows of 2 on
    # rank 1 only (grad 6, divided by the initial world size 2)
    np.testing.assert_allclose(a, init - 0.1 * (4 + 4 + 3), rtol=1e-6)


def test_ddp_uneven_input_join_disable(ranks):
    for r in ranks:
        got = r["join_disable"]
        expected_grad = sum(range(r["world"])) / r["world"]
        assert got["grads"] == [expected_grad] * 5
        assert got["enable"] is False
    _same_on_every_rank([r["join_disable"]["digest"] for r in ranks])


def test_ddp_uneven_input_exception(ranks):
    for r in ranks:
        assert r["exception"] == ("ValueError", "Intentional error")


def test_ddp_join_respects_forward_sync_buffers_false(ranks):
    for r in ranks:
        before, after = r["buffers"]
        np.testing.assert_array_equal(before, after)


# ---------------------------------------------------------------- in-process checks
class _Lin(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jax.numpy.zeros((3,)))


def _loss(m, x):
    return jax.numpy.sum(m.w[...] * x)


def test_join_list_is_ddp_join_in_one_process():
    model = _Lin()
    ddp = DDP(model)
    step = ddp.train_step(_loss, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    x = np.ones((len(ddp.process_group.local_devices), 3), np.float32)
    for k, ctx in enumerate((lambda: Join([ddp]), ddp.join)):
        with ctx():
            assert ddp._join_config.enable and ddp._join_config.is_first_joinable
            for _ in range(2):
                step(x)
        assert ddp._join_config.enable is False  # reset when the context exits
        np.testing.assert_allclose(np.asarray(model.w[...]), [-0.2 * (k + 1)] * 3,
                                   rtol=1e-6)
    assert ddp.join_process_group is ddp.process_group
    assert ddp.join_device in ddp.process_group.local_devices
    assert isinstance(ddp.join_hook(), DDPJoinHook)


def test_join_contexts_cannot_be_nested():
    ddp = DDP(_Lin())
    with ddp.join():
        with pytest.raises(JoinError, match="cannot be nested"):
            Join([ddp])


def test_replayed_batch_takes_the_others_rows():
    from jdist.ddp._join import batch_rows, with_rows

    batch = {"x": np.arange(8.0).reshape(4, 2), "y": np.arange(4)}
    assert batch_rows(batch) == 4 and batch_rows(()) == -1
    assert with_rows(batch, 4) is batch and with_rows(batch, -1) is batch
    three = with_rows(batch, 3)
    np.testing.assert_array_equal(three["y"], [0, 1, 2])
    np.testing.assert_array_equal(with_rows(batch, 6)["y"], [0, 1, 2, 3, 0, 1])
    with pytest.raises(JoinError, match="cannot replay an empty batch"):
        with_rows({"x": np.zeros((0, 2))}, 2)


def test_steps_are_numbered_as_made_and_held_weakly():
    import gc

    from jdist.ddp._join import StepNumbers

    steps = StepNumbers()

    def a():
        pass

    def b():
        pass

    steps.add(a)
    steps.add(b)
    assert (steps.number(a), steps.number(b)) == (0, 1) and steps.get(1) is b
    del b
    gc.collect()
    assert steps.get(1) is None and steps.number(a) == 0
