"""Pipelined training equals the unsplit model (``jdist/pipelining``): a 4-stage MLP,
every schedule, several layouts of the stages over pipeline ranks (``pp_size``) and
micro-batch counts; per step, the mean of the micro-batch losses equals the full-batch
loss and each stage's gradients equal the full model's (1e-6), over steps with an
optax update in between. Also: the last stage's output, eval, summed gradients
(``scale_grads=False``), and the bad inputs the issue names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdist.pipelining as pp

D, BATCH, STAGES = 6, 12, 4
SCHEDULES = {"GPipe": (4,), "1F1B": (4,), "LoopedBFS": (1, 2, 4),
             "Interleaved1F1B": (1, 2, 4), "InterleavedZeroBubble": (1, 2, 4)}


def _layers(seed=0):
    rngs = nnx.Rngs(seed)
    return [nnx.Sequential(nnx.Linear(D, D, rngs=rngs), jnp.tanh) for _ in range(STAGES)]


def mse(out, target):
    return jnp.mean((out - target) ** 2)


def _data(step):
    rng = np.random.default_rng(step)
    return (rng.standard_normal((BATCH, D)).astype(np.float32),
            rng.standard_normal((BATCH, D)).astype(np.float32))


def _reference(steps, lr):
    model = nnx.Sequential(*_layers())
    opt = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)
    out = []
    for step in range(steps):
        x, y = _data(step)
        loss, grads = nnx.value_and_grad(lambda m, x=x, y=y: mse(m(x), y))(model)
        out.append((float(loss), [grads.layers[i] for i in range(STAGES)], model(x)))
        opt.update(model, grads)
    return out


@pytest.mark.parametrize("name,m", [(n, m) for n in SCHEDULES for m in (4, 6)])
def test_every_schedule_trains_like_the_unsplit_model(name, m):
    ref = _reference(2, 0.1)
    for size in SCHEDULES[name]:
        stages_mods = _layers()
        stages = [pp.PipelineStage(mod, i, STAGES) for i, mod in enumerate(stages_mods)]
        opts = [nnx.Optimizer(mod, optax.sgd(0.1), wrt=nnx.Param) for mod in stages_mods]
        sched = pp.get_schedule_class(name)(stages, m, loss_fn=mse, pp_size=size)
        kept = []
        for step, (loss, grads, want_out) in enumerate(ref):
            x, y = _data(step)
            losses = []
            out = sched.step(x, target=y, losses=losses)
            assert len(losses) == m
            if BATCH % m == 0:  # equal micro-batches: the mean of means is the batch mean
                np.testing.assert_allclose(np.mean(losses), loss, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
            for st, opt, g in zip(stages, opts, grads, strict=True):
                if BATCH % m == 0:
                    jax.tree.map(lambda a, b: np.testing.assert_allclose(
                        a, b, rtol=1e-5, atol=1e-6), st.grads, g)
                opt.update(st.submod, st.grads)
            kept.append([st.grads for st in stages])
        # (the stages accumulate into buffers their programs consume: never the user's)
        for step_grads, (_, grads, _) in zip(kept, ref, strict=True):
            for got, g in zip(step_grads, grads, strict=True):
                if BATCH % m == 0:
                    jax.tree.map(lambda a, b: np.testing.assert_allclose(
                        a, b, rtol=1e-5, atol=1e-6), got, g)


def test_uneven_micro_batches_weight_each_as_torch_does():
    """12 rows in 5 micro-batches (3, 3, 2, 2, 2): the loss is the mean of micro-batch
    means and the gradient their mean, as torch's tensor_split + scale_grads give."""
    mods = _layers()
    stages = [pp.PipelineStage(mod, i, STAGES) for i, mod in enumerate(mods)]
    sched = pp.Schedule1F1B(stages, 5, loss_fn=mse)
    x, y = _data(0)
    losses = []
    sched.step(x, target=y, losses=losses)
    model = nnx.Sequential(*_layers())
    want_losses, want_grads = [], []
    for a, b in [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12)]:
        loss, g = nnx.value_and_grad(lambda m, a=a, b=b: mse(m(x[a:b]), y[a:b]))(model)
        want_losses.append(float(loss))
        want_grads.append(g)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for i, st in enumerate(stages):
        mean = jax.tree.map(lambda *v: sum(v) / 5, *[g.layers[i] for g in want_grads])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     st.grads, mean)


def test_summed_gradients_and_eval():
    mods = _layers()
    stages = [pp.PipelineStage(mod, i, STAGES) for i, mod in enumerate(mods)]
    x, y = _data(3)
    mean = pp.ScheduleGPipe(stages, 4, loss_fn=mse)
    mean.step(x, target=y)
    g_mean = [st.grads for st in stages]
    summed = pp.ScheduleGPipe(stages, 4, loss_fn=mse, scale_grads=False)
    summed.step(x, target=y)
    for st, g in zip(stages, g_mean, strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 4 * b, rtol=1e-5), st.grads, g)
    losses = []
    out = summed.eval(x, target=y, losses=losses)
    np.testing.assert_allclose(out, nnx.Sequential(*_layers())(x), rtol=1e-6, atol=1e-6)
    assert len(losses) == 4


def test_pipeline_groups_layers_into_equal_stages():
    stages = pp.pipeline([nnx.Linear(D, D, rngs=nnx.Rngs(i)) for i in range(4)], 2)
    assert [len(s.layers) for s in stages] == [2, 2]
    with pytest.raises(ValueError, match="cannot be split into 3 equal stages"):
        pp.pipeline([nnx.Linear(D, D, rngs=nnx.Rngs(i)) for i in range(4)], 3)


def _stages(n=STAGES):
    return [pp.PipelineStage(mod, i, n) for i, mod in enumerate(_layers()[:n])]


@pytest.mark.parametrize("make,match", [
    (lambda: pp.Schedule1F1B(_stages(), 2, loss_fn=mse), "greater than or equal to"),
    (lambda: pp.ScheduleInterleaved1F1B(_stages(), 5, loss_fn=mse, pp_size=2),
     "multiple of the number of rounds"),
    (lambda: pp.ScheduleGPipe(_stages()[1:], 4, loss_fn=mse), "build every stage here"),
    (lambda: pp.ScheduleLoopedBFS(_stages(), 4, loss_fn=mse, pp_size=3), "must divide"),
    (lambda: pp.PipelineStage(nnx.BatchNorm(D, rngs=nnx.Rngs(0)), 0, 1), "other than"),
    (lambda: pp.PipelineStage(_layers()[0], 4, 4), "not in \\[0, 4\\)"),
    (lambda: pp.get_schedule_class("Nope"), "no pipeline schedule named 'Nope'"),
])
def test_bad_configurations_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_step_inputs_are_refused():
    sched = pp.ScheduleGPipe(_stages(), 4, loss_fn=mse)
    x, y = _data(0)
    with pytest.raises(ValueError, match="different numbers of rows"):
        sched.step(x, target=y[:8])
    with pytest.raises(ValueError, match="cannot be split into 4 micro-batches"):
        sched.step(x[:3], target=y[:3])


def test_a_stage_that_raises_names_its_stage_and_action():
    def broken(out, target):
        raise FloatingPointError("bad loss")
    sched = pp.ScheduleGPipe(_stages(), 4, loss_fn=broken)
    x, y = _data(0)
    with pytest.raises(FloatingPointError, match="pipeline stage 3, action 3F0"):
        sched.step(x, target=y)


def test_stages_on_different_devices():
    devs = jax.devices()
    mods = _layers()
    stages = [pp.PipelineStage(mod, i, STAGES, device=devs[i % len(devs)])
              for i, mod in enumerate(mods)]
    x, y = _data(0)
    out = pp.ScheduleInterleaved1F1B(stages, 4, loss_fn=mse, pp_size=2).step(x, target=y)
    np.testing.assert_allclose(out, nnx.Sequential(*_layers())(x), rtol=1e-6, atol=1e-6)
    assert {d for st in stages for d in jax.tree.leaves(st.grads)[0].devices()} == {
        devs[i % len(devs)] for i in range(STAGES)}


