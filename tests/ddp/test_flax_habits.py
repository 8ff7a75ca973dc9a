"""A Flax user's habits around DDP: the tutorial's own ``@nnx.jit`` steps made
data-parallel by ``ddp.shard_batch``, replicas that drift apart named at the next DDP
call, the module usable by the user's own code after any DDP call, ``nnx.Rngs``
arguments advanced, and ``ddp(x, y)`` returning each rank's outputs as torch does.
Each against the same code on one device (1 process x 2 devices and 2 processes)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from tests.ddp import habit_cases
from tests.ddp.models import max_diff
from tests.helpers import run_procs


def _group(n):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"habits{n}")


@pytest.fixture(scope="module")
def reference():
    return habit_cases.user_loop()


@pytest.fixture(scope="module")
def two_processes():
    return run_procs(habit_cases.main, 2, timeout=240)


def _same_as_one_device(got, ref):
    train, evaluation, params = got
    assert train == pytest.approx(ref[0], rel=1e-5)
    assert evaluation == pytest.approx(ref[1], rel=1e-5)
    assert max_diff(params, ref[2]) < 1e-5


@pytest.mark.parametrize("n", [2, 4])
def test_user_jit_steps_with_shard_batch_equal_one_device(reference, n):
    _same_as_one_device(habit_cases.user_loop(ddp=_group(n)), reference)


def test_user_jit_steps_with_shard_batch_two_processes(two_processes, reference):
    for r in two_processes:
        _same_as_one_device(r["shard"], reference)


def test_drifted_replicas_raise_at_next_ddp_call(two_processes):
    for r in two_processes:
        name, msg = r["diverged"]
        assert name == "ReplicaDivergenceError"
        assert "rank(s) 1 hold other values than rank 0" in msg
        assert "ddp.shard_batch(batch)" in msg


@pytest.mark.parametrize("kind", ["train_step", "value_and_grad", "forward"])
def test_module_usable_by_user_code_after_ddp_call(kind):
    got = habit_cases.after_ddp_steps(kind, group=_group(2))
    assert np.isfinite(got["eval"])
    np.testing.assert_allclose(got["eager"], 2.0 * got["kernel"].sum(), rtol=1e-4)


def test_module_usable_by_user_code_after_ddp_call_two_processes(two_processes):
    for kind in ("train_step", "value_and_grad", "forward"):
        a, b = (r["after"][kind] for r in two_processes)
        np.testing.assert_array_equal(a["kernel"], b["kernel"])
        np.testing.assert_allclose(a["eager"], 2.0 * a["kernel"].sum(), rtol=1e-4)


def test_manual_optimizer_with_one_slower_process_checks_replicas_alike(two_processes):
    """The replica check's throttle counts collective calls, so a process slower than
    the other still checks at the same calls: 40 steps end on both (no hang), equal to
    the same SGD on one device (both processes have the same rows)."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    x = np.arange(24, dtype=np.float32).reshape(8, 3) / 24
    y = np.ones((8, 2), np.float32)
    graphdef = nnx.graphdef(model)

    def loss(p):
        return ((nnx.merge(graphdef, p)(x) - y) ** 2).mean()

    losses = []
    for _ in range(40):
        value, grads = jax.value_and_grad(loss)(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        losses.append(float(value))
    want = nnx.to_pure_dict(params)
    for r in two_processes:
        got_losses, got = r["skewed"]
        np.testing.assert_allclose(got_losses, losses, rtol=1e-5, atol=1e-7)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def _module_forward(x, y):
    logits = x @ np.asarray(_W[0]) + np.asarray(_W[1])
    return logits, {"loss": np.mean((logits - y) ** 2), "n": np.sum(x > 0)}


def _weights():
    from flax import nnx as _nnx

    lin = _nnx.Linear(4, 3, rngs=_nnx.Rngs(0))
    return np.asarray(lin.kernel[...]), np.asarray(lin.bias[...])


_W = _weights()


def test_forward_returns_each_ranks_outputs_two_processes(two_processes):
    for r in two_processes:
        logits, extra, x, y = r["forward"]
        ref_logits, ref_extra = _module_forward(x, y)
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
        assert extra["loss"].shape == () and extra["n"].shape == ()
        np.testing.assert_allclose(extra["loss"], ref_extra["loss"], rtol=1e-5)
        assert int(extra["n"]) == int(ref_extra["n"])


def test_forward_scalars_one_per_local_replica():
    logits, extra, x, y = habit_cases.forward_outputs(group=_group(2))
    halves = [_module_forward(x[:2], y[:2]), _module_forward(x[2:], y[2:])]
    np.testing.assert_allclose(logits, np.concatenate([h[0] for h in halves]), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(extra["loss"], [h[1]["loss"] for h in halves], rtol=1e-5)


class _Drop(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def __call__(self, x, rngs):
        h = self.a(x)
        return jax.numpy.where(jax.random.bernoulli(rngs.dropout(), 0.5, h.shape), h, 0.0)


def _drop_loss(m, b, rngs):
    return (m(b, rngs) ** 2).mean()


@pytest.mark.parametrize("kind", ["train_step", "value_and_grad"])
def test_rngs_argument_advances_as_under_nnx_jit(kind):
    x = np.random.RandomState(0).randn(4, 4).astype(np.float32)
    ref_m, ref_rngs = _Drop(), nnx.Rngs(dropout=3)
    ref_opt = nnx.Optimizer(ref_m, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def ref_step(m, o, r):
        loss, g = nnx.value_and_grad(_drop_loss)(m, x, r)
        if kind == "train_step":
            o.update(m, g)
        return loss

    m, rngs = _Drop(), nnx.Rngs(dropout=3)
    ddp = DDP(m, process_group=_group(1))
    step = (ddp.train_step(_drop_loss, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))
            if kind == "train_step" else
            (lambda b, r: ddp.value_and_grad(_drop_loss)(b, r)[0]))
    got = [float(step(x, rngs)) for _ in range(3)]
    want = [float(ref_step(ref_m, ref_opt, ref_rngs)) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len(set(got)) == 3  # a new mask every step
    assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...]) == 3


def _updating_metric(m, b, r, met):
    loss = _drop_loss(m, b, r)
    met.update(values=loss)
    return loss


def test_an_object_argument_whose_state_the_loss_changes_raises_naming_fix():
    ddp = DDP(_Drop(), process_group=_group(2))
    f = ddp.value_and_grad(_updating_metric)
    with pytest.raises(TypeError, match=r"argument #1 is an NNX object \(Average\).*"
                       r"changes.*ddp.shard_batch"):
        f(np.ones((2, 4), np.float32), nnx.Rngs(dropout=0), nnx.metrics.Average())


def test_a_read_only_object_argument_works_as_under_nnx_jit():
    """Distillation: a frozen teacher model passed to every step."""
    x = np.random.RandomState(1).randn(4, 4).astype(np.float32)
    teacher = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

    def loss(m, b, t):
        return ((m.a(b) - t(b)) ** 2).mean()

    ref, got_m = _Drop(), _Drop()
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    step = DDP(got_m, process_group=_group(2)).train_step(
        loss, nnx.Optimizer(got_m, optax.sgd(0.1), wrt=nnx.Param))
    for _ in range(2):
        want, g = nnx.value_and_grad(loss)(ref, x, teacher)
        ref_opt.update(ref, g)
        np.testing.assert_allclose(float(step(x, teacher)), float(want), rtol=1e-6)
    assert max_diff(habit_cases.params_of(got_m), habit_cases.params_of(ref)) < 1e-6


def test_syncbn_two_processes_empty_and_unequal_ranks(two_processes):
    """torch's SyncBatchNorm: an empty rank contributes nothing (tests/ddp/test_syncbn.py
    has the in-process grid); an unpadded step with unequal sizes names them."""
    from tests.ddp import syncbn_cases

    for split in syncbn_cases.MP_SPLITS:
        xs = [syncbn_cases.rows(n, 2, seed=r) for r, n in enumerate(split)]
        loss, state = syncbn_cases.reference([x for x in xs if len(x)], 2)
        for r in two_processes:
            got = r["syncbn"][split]
            np.testing.assert_allclose(got[0], loss, rtol=1e-5, atol=1e-6)
            assert max_diff(got[1], state) < 1e-5
    for r in two_processes:
        assert "rank 0: 4, rank 1: 0 rows" in r["syncbn"]["unequal"]
        assert "pad_batch_to=4" in r["syncbn"]["unequal"]
