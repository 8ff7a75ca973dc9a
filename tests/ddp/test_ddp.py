"""DDP on 8 virtual devices equals full-batch training on one device."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp import _placement
from jdist.errors import ReplicaDivergenceError
from tests.ddp.models import MLP, data, max_diff, mse, reference_train


@pytest.mark.parametrize("cap, tx", [
    (None, optax.sgd(0.1)),
    (0.002, optax.sgd(0.1)),  # ~2 KB buckets: split into several
    (0.002, optax.adam(1e-2)),
])
def test_train_step_equals_full_batch_training(cap, tx):
    batches = [data(seed=s) for s in range(3)]
    ref = MLP(rngs=nnx.Rngs(0))
    ref_losses = reference_train(ref, tx, batches)
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model, bucket_cap_mb=cap)
    step = ddp.train_step(mse, nnx.Optimizer(model, tx, wrt=nnx.Param))
    losses = [float(step(b)) for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param)) < 1e-5
    assert len(ddp.buckets.buckets) == (1 if cap is None else 2)


def test_train_step_updates_module_and_optimizer_in_place_each_step():
    """The step reads and writes the module's own Variables (found at its first call): the
    new values are visible right after each step, and values changed between steps (a
    checkpoint restored with nnx.update) are what the next step starts from."""
    tx = optax.adam(1e-2)
    batches = [data(seed=s) for s in range(3)]
    model = MLP(rngs=nnx.Rngs(0))
    kernel = model.layers[0].kernel
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = DDP(model).train_step(mse, opt)
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    reference_train(ref, tx, batches[:1])  # one step, with its own optimizer state
    step(batches[0])
    assert model.layers[0].kernel is kernel  # same Variable, new value
    assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param)) < 1e-5
    assert int(opt.step[...]) == 1
    # restore other values (and a fresh optimizer state) between steps
    other = MLP(rngs=nnx.Rngs(7))
    nnx.update(model, nnx.state(other, nnx.Param))
    nnx.update(opt, nnx.state(ref_opt))  # ref_opt never stepped: count 0, zero moments
    losses = [float(step(b)) for b in batches[1:]]
    ref_losses = reference_train(other, tx, batches[1:])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_diff(nnx.state(model, nnx.Param), nnx.state(other, nnx.Param)) < 1e-5
    assert int(opt.step[...]) == 2


class Sowing(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        y = self.lin(x)
        self.sow(nnx.Intermediate, "y_mean", jnp.mean(y))
        return y


def test_step_that_adds_variables_updates_the_module_like_nnx_update():
    """A step whose structure changes (sow adds an Intermediate; a tuple value) falls back
    from reading and writing cached Variables to nnx.split/nnx.update."""
    model = Sowing(nnx.Rngs(0))
    step = DDP(model).train_step(mse, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    for _ in range(2):
        step(data(n=8))
    sown = nnx.state(model, nnx.Intermediate)["y_mean"].get_value()
    assert isinstance(sown, tuple) and len(sown) == 2


@pytest.mark.parametrize("flat", [True, False])
def test_value_and_grad_returns_replica_mean_and_aux(flat):
    b = data()
    ref = MLP(rngs=nnx.Rngs(1))
    ref_loss, ref_grads = nnx.value_and_grad(mse)(ref, b)
    ddp = DDP(MLP(rngs=nnx.Rngs(1)), bucket_cap_mb=0.001, flat_buckets=flat)
    f = ddp.value_and_grad(lambda m, b: (mse(m, b), m(b["x"]).shape[0]), has_aux=True)
    (loss, aux), grads = f(b)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert max_diff(grads, ref_grads) < 1e-6
    np.testing.assert_array_equal(np.asarray(aux), [8] * 8)  # per replica: 64 / 8 rows


def _hlo(ddp, batch):
    eng = ddp._engine
    (prog,) = [p for k, p in eng._programs.items() if k[0] == "grad"]
    _, params, buffers = nnx.split(ddp.module, nnx.Param, ...)
    args = (_placement.replicated(params, eng.group), eng.buffers_in(buffers), None, None,
            None, _placement.shard_batch(batch, eng.group), (), None)
    text = prog.lower(*args).compile().as_text()
    return text[text.index("ENTRY"):].splitlines()


def _all_reduces(lines):
    """``(line index, elements)`` of every all-reduce; ``elements`` counts the non-scalar
    operands of a (possibly variadic) all-reduce, 0 for a scalar one (the loss mean)."""
    out = []
    for i, ln in enumerate(lines):
        if " all-reduce(" not in ln and " all-reduce-start(" not in ln:
            continue
        result = ln.split("=", 1)[1].split("all-reduce")[0]
        dims = [d for d in re.findall(r"f32\[([\d,]*)\]", result) if d]
        out.append((i, sum(int(np.prod([int(x) for x in d.split(",")])) for d in dims)))
    return out


@pytest.mark.parametrize("flat", [False, True])
def test_one_all_reduce_per_bucket_scheduled_inside_backward(flat):
    """Default: XLA's combiner merges each bucket's gradients into one variadic all-reduce
    (and never two buckets); flat: one all-reduce of the flat buffer, combiner off, the
    loss mean riding in the last bucket's (one element more, no all-reduce of its own)."""
    ddp = DDP(MLP((16, 64, 64, 64, 4), rngs=nnx.Rngs(0)), bucket_cap_mb=0.01,
              flat_buckets=flat)
    b = data()
    loss, _ = ddp.value_and_grad(mse)(b)
    sizes = [sum(ddp.buckets.leaves[j].size for j in bk.leaves) for bk in ddp.buckets.buckets]
    assert len(sizes) >= 3
    lines = _hlo(ddp, b)
    ars = _all_reduces(lines)
    bucket_ars = [(i, n) for i, n in ars if n]  # the loss mean may have its own
    if flat:
        assert [n for _, n in ars] == sizes[:-1] + [sizes[-1] + 1], (ars, sizes)
    else:
        assert [n for _, n in bucket_ars] == sizes, (ars, sizes)
        assert len(ars) in (len(sizes), len(sizes) + 1)
    np.testing.assert_allclose(float(loss), float(mse(MLP((16, 64, 64, 64, 4),
                                                           rngs=nnx.Rngs(0)), b)), rtol=1e-6)
    # bucket 0's all-reduce runs before the backward matmuls of the earlier layers
    first_ar = bucket_ars[0][0]
    later_compute = [i for i, ln in enumerate(lines)
                     if i > first_ar and ("dot(" in ln or "kind=kCustom" in ln)]
    assert later_compute, "no backward computation after the first bucket's all-reduce"
    # and the last bucket's all-reduce waits for the first layer's weight gradient
    first_layer_grad = [i for i, ln in enumerate(lines)
                        if "dot(%param" in ln and "lhs_contracting_dims={0}" in ln]
    assert first_layer_grad and first_ar < first_layer_grad[0] < bucket_ars[-1][0]


def test_bucket_with_more_gradients_than_the_combiner_merges_is_copied(monkeypatch):
    """XLA's combiner merges at most 256 arrays into one all-reduce, so a bucket with more
    parameters than ``MAX_COMBINED`` is copied into one flat buffer (one all-reduce either
    way). Checked with the limit lowered to 2 (a real 256-parameter bucket takes seconds
    to trace): the 4-parameter buckets are flat, the others are merged by XLA."""
    from jdist.ddp import _reducer

    monkeypatch.setattr(_reducer, "MAX_COMBINED", 2)
    b = data()
    ddp = DDP(MLP((16, 64, 64, 64, 4), rngs=nnx.Rngs(1)), bucket_cap_mb=0.02)
    _, grads = ddp.value_and_grad(mse)(b)
    counts = [len(bk.leaves) for bk in ddp.buckets.buckets]
    assert max(counts) > 2 and min(counts) <= 2, counts
    sizes = [sum(ddp.buckets.leaves[j].size for j in bk.leaves) for bk in ddp.buckets.buckets]
    lines = _hlo(ddp, b)
    assert [n for _, n in _all_reduces(lines) if n] == sizes
    operands = [[d for d in re.findall(r"f32\[([\d,]*)\]", ln.split(" all-reduce(")[0]) if d]
                for ln in lines if " all-reduce(" in ln]
    flat = [ops for ops in operands if len(ops) == 1 and "," not in ops[0]]
    assert len(flat) == sum(c > 2 for c in counts), operands  # copied: one 1-D operand
    _, ref_grads = nnx.value_and_grad(mse)(MLP((16, 64, 64, 64, 4), rngs=nnx.Rngs(1)), b)
    assert max_diff(grads, ref_grads) < 1e-6


class ScalarAndEmpty(nnx.Module):
    """Scalar and zero-size parameters, each in a bucket of its own with a tiny cap."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 4, rngs=rngs)
        self.scale = nnx.Param(jnp.asarray(1.5))
        self.empty = nnx.Param(jnp.zeros((0,)))

    def __call__(self, x):  # used first: their gradients are ready last (chained buckets)
        return self.lin(self.scale[...] * x + jnp.sum(self.empty[...]))


@pytest.mark.parametrize("flat", [False, True])
def test_scalar_and_empty_parameters_in_chained_buckets(flat):
    b = data()
    ref_grads = nnx.grad(mse)(ScalarAndEmpty(nnx.Rngs(0)), b)
    ddp = DDP(ScalarAndEmpty(nnx.Rngs(0)), bucket_cap_mb=1e-6, flat_buckets=flat)
    _, grads = ddp.value_and_grad(mse)(b)
    assert [bk.paths for bk in ddp.buckets] == [("lin/bias",), ("lin/kernel",),
                                                 ("empty", "scale")]
    for name in ("lin", "scale"):
        assert max_diff(grads[name], ref_grads[name]) < 1e-6
    assert np.asarray(grads["empty"][...]).shape == (0,)


def test_comm_hook_state_is_threaded_and_registered_once():
    calls = []

    def counting_hook(state, bucket):
        calls.append((bucket.index, bucket.is_last, bucket.parameters))
        total = jax.lax.psum(bucket.buffer, bucket.axis_name)
        return total / bucket.num_replicas, state + 1

    b = data()
    ref = MLP(rngs=nnx.Rngs(0))
    _, ref_grads = nnx.value_and_grad(mse)(ref, b)
    ddp = DDP(MLP(rngs=nnx.Rngs(0)), bucket_cap_mb=0.002)
    ddp.register_comm_hook(jnp.zeros((), jnp.int32), counting_hook)
    with pytest.raises(RuntimeError, match=re.escape(
            "register_comm_hook or register_builtin_comm_hook can only be called once.")):
        ddp.register_comm_hook(None, counting_hook)
    f = ddp.value_and_grad(mse)
    _, grads = f(b)
    _, grads = f(b)
    assert max_diff(grads, ref_grads) < 1e-6
    nb = len(ddp.buckets.buckets)
    assert int(ddp.comm_hook_state) == 2 * nb
    assert [c[0] for c in calls[-nb:]] == list(range(nb))
    assert [c[1] for c in calls[-nb:]] == [False] * (nb - 1) + [True]


def test_hook_returning_per_replica_values_is_rejected():
    ddp = DDP(MLP(rngs=nnx.Rngs(0)), comm_hook=lambda s, bk: (bk.buffer, s))
    # checked when the step runs (a result typed per replica may hold equal values)
    with pytest.raises(ReplicaDivergenceError, match="differs across replicas"):
        ddp.value_and_grad(mse)(data())


def test_register_after_first_step_is_rejected():
    ddp = DDP(MLP(rngs=nnx.Rngs(0)))
    ddp.value_and_grad(mse)(data())
    with pytest.raises(RuntimeError, match="before the first step"):
        ddp.register_comm_hook(None, lambda s, b: (jax.lax.pmean(b.buffer, b.axis_name), s))


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="FunctionalDDP"):
        DDP({"w": jnp.ones(3)})

    class Empty(nnx.Module):
        def __call__(self, x):
            return x

    with pytest.raises(ValueError, match="doesn't have any parameter"):
        DDP(Empty())
    ddp = DDP(MLP(rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"60 samples.*8 devices.*60 % 8 = 4"):
        ddp.value_and_grad(mse)(data(n=60))


def test_forward_splits_batch_over_replicas():
    model = MLP(rngs=nnx.Rngs(0))
    x = data()["x"]
    out = DDP(model)(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(model(jnp.asarray(x))), rtol=1e-6,
                               atol=1e-6)
