"""The parity harness's pieces: optimizer/loss mapping (torch as oracle), TorchBatchNorm,
sampler batches, the report, error cases and the CLI's exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jdist.errors import WeightConversionError
from jdist.testing import (
    ArrayDiff,
    OptimizerSpec,
    ParityReport,
    StepResult,
    TorchBatchNorm,
    batch_schedule,
    loss_pair,
    make_optax,
    make_torch_optimizer,
    optimizer_spec,
    run_parity,
)
from jdist.testing.parity import build_nnx_model, build_torch_model, example, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------ optimizer mapping


@pytest.mark.parametrize("spec", [
    ("sgd", 0.1),
    ("sgd", 0.1, 0.9),
    OptimizerSpec("sgd", 0.05, momentum=0.8, weight_decay=0.1, nesterov=True),
    ("adam", 1e-2),
    ("adam", 1e-2, (0.8, 0.9), 1e-3, 0.05),
    ("adamw", 1e-2, (0.9, 0.99), 1e-6, 0.3),
], ids=str)
def test_optimizer_pairs_follow_the_same_update_rule(spec):
    """Same gradients -> same parameters for 6 steps (large eps and decay make the
    placement of eps and of weight decay visible)."""
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(7).astype(np.float32)
    grads = rng.standard_normal((6, 7)).astype(np.float32) * 1e-2
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = make_torch_optimizer(spec, [tp])
    tx = make_optax(spec)
    jp = jnp.asarray(p0)
    state = tx.init(jp)
    update = jax.jit(tx.update)
    for g in grads:
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
        upd, state = update(jnp.asarray(g), state, jp)
        jp = optax.apply_updates(jp, upd)
    # float32 rounding differs (torch divides by bias corrections in another order)
    np.testing.assert_allclose(np.asarray(jp), tp.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(jp) - p0).max() > 1e-3


def test_optimizer_spec_forms_and_errors():
    assert optimizer_spec(("adam", 1e-3)) == OptimizerSpec("adam", 1e-3)
    assert optimizer_spec({"name": "sgd", "lr": 1, "momentum": 0.5}).momentum == 0.5
    assert optimizer_spec(("sgd", 0.1, 0.9)).momentum == 0.9
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        optimizer_spec(("rmsprop", 0.1))
    with pytest.raises(ValueError, match=r"lr must be a finite number.*-1"):
        optimizer_spec(("sgd", -1))
    with pytest.raises(ValueError, match="at least lr"):
        optimizer_spec(("sgd",))
    with pytest.raises(ValueError, match="betas must be a pair"):
        optimizer_spec(("adam", 1e-3, (0.9,)))
    with pytest.raises(TypeError, match=r"tuple like \('sgd', 0.1\)"):
        optimizer_spec(0.1)
    with pytest.raises(ValueError, match="nesterov=True needs momentum"):
        make_optax(OptimizerSpec("sgd", 0.1, nesterov=True))


def test_named_losses_match_torch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 4)).astype(np.float32)
    labels = rng.integers(0, 4, 5)
    ce = loss_pair("cross_entropy")
    np.testing.assert_allclose(
        float(ce.jax_fn(jnp.asarray(logits), jnp.asarray(labels))),
        float(ce.torch_fn(torch.from_numpy(logits), torch.from_numpy(labels))), rtol=1e-6)
    target = rng.standard_normal((5, 4)).astype(np.float32)
    mse = loss_pair("mse")
    np.testing.assert_allclose(
        float(mse.jax_fn(jnp.asarray(logits), jnp.asarray(target))),
        float(mse.torch_fn(torch.from_numpy(logits), torch.from_numpy(target))), rtol=1e-6)
    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        loss_pair("hinge")
    with pytest.raises(TypeError, match="pair of callables"):
        loss_pair((1, 2))


# -------------------------------------------------------------- TorchBatchNorm


def test_torch_batchnorm_matches_torch_in_training_and_eval():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 5, 5)).astype(np.float32) * 2 + 1
    tbn = torch.nn.BatchNorm2d(3, momentum=0.2)
    with torch.no_grad():
        tbn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        tbn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    nbn = TorchBatchNorm(3, momentum=0.8, epsilon=1e-5, rngs=nnx.Rngs(0))
    nbn.scale[...] = jnp.array([1.0, 2.0, 0.5])
    nbn.bias[...] = jnp.array([0.1, -0.2, 0.3])
    plain = nnx.BatchNorm(3, momentum=0.8, epsilon=1e-5, rngs=nnx.Rngs(0))
    xh = jnp.asarray(np.moveaxis(x, 1, -1))
    for _ in range(2):  # training mode: outputs and running statistics
        ty = tbn(torch.from_numpy(x)).detach().numpy()
        ny = nbn(xh)
        plain(xh)
        np.testing.assert_allclose(np.moveaxis(np.asarray(ny), -1, 1), ty, atol=1e-5)
    np.testing.assert_allclose(np.asarray(nbn.mean[...]), tbn.running_mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(nbn.var[...]), tbn.running_var.numpy(), atol=1e-6)
    # nnx.BatchNorm's biased update is measurably off (why TorchBatchNorm exists)
    assert np.abs(np.asarray(plain.var[...]) - tbn.running_var.numpy()).max() > 1e-3
    tbn.eval()
    ty = tbn(torch.from_numpy(x)).detach().numpy()
    ny = nbn(xh, use_running_average=True)
    np.testing.assert_allclose(np.moveaxis(np.asarray(ny), -1, 1), ty, atol=1e-5)
    with pytest.raises(ValueError, match="does not take mask="):
        nbn(xh, mask=jnp.ones(xh.shape, bool))


def test_plain_nnx_batchnorm_shows_up_as_a_running_var_difference():
    class PlainCNN(nnx.Module):
        """The example CNN with nnx.BatchNorm (biased running variance)."""

        def __init__(self, rngs):
            self.conv1 = nnx.Conv(3, 8, (3, 3), padding=1, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(8, momentum=0.9, epsilon=1e-5, rngs=rngs)
            self.conv2 = nnx.Conv(8, 16, (3, 3), strides=2, padding=1, rngs=rngs)
            self.head = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.conv2(nnx.relu(self.bn(self.conv1(x)))))
            return self.head(h.mean(axis=(1, 2)))

    ex = example("cnn")
    model = PlainCNN(nnx.Rngs(0))
    report = run_parity(ex.torch_model, model, "cross_entropy", ex.data, ("sgd", 0.1),
                        steps=2, batch_size=32, jax_input="channels_last")
    assert report.ok(1e-5, buffers=False)
    assert not report.ok(1e-5)
    worst = max(report.arrays, key=lambda a: a.max_abs_diff)
    assert (worst.name, worst.nnx_path) == ("running_var", "bn")
    assert report.max_buffer_diff > 1e-5


# -------------------------------------------------------------------- batches


@pytest.mark.parametrize("replicas,rank,drop", [(1, 0, False), (3, 2, False), (3, 1, True)])
def test_batch_schedule_jdist_sampler_equals_torch(replicas, rank, drop):
    kw = dict(shuffle=True, seed=7, num_replicas=replicas, rank=rank, drop_last=drop)
    t = batch_schedule(23, 9, 4, source="torch", **kw)
    j = batch_schedule(23, 9, 4, source="jdist", **kw)
    assert [a.tolist() for a in t] == [b.tolist() for b in j]
    share = len(list(torch.utils.data.DistributedSampler(range(23), **{
        k: v for k, v in kw.items()})))
    per_epoch = -(-share // 4)
    assert sum(len(b) for b in t[:per_epoch]) == share  # one epoch, then the next
    assert t[0].tolist() != t[per_epoch].tolist()  # set_epoch reshuffles
    with pytest.raises(ValueError, match="source must be 'torch' or 'jdist'"):
        batch_schedule(10, 1, 2, source="numpy")


# --------------------------------------------------------------------- report


def _report(loss_diff=0.0, w=0.0, rv=0.0):
    steps = (StepResult(0, 1.0, 1.0 + loss_diff), StepResult(1, 0.5, 0.5))
    arrays = (ArrayDiff("0", "conv", "conv2d", "weight", (2, 1, 3, 3), w),
              ArrayDiff("1", "bn", "batchnorm", "running_var", (2,), rv))
    return ParityReport(steps, arrays, None, {"loss": "mse", "steps": 2})


def test_report_properties_and_table():
    r = _report(loss_diff=2e-6, w=3e-7, rv=4e-5)
    assert r.max_loss_diff == pytest.approx(2e-6)
    assert r.max_param_diff == 3e-7 and r.max_buffer_diff == 4e-5
    assert r.ok(1e-4) and not r.ok(1e-5) and r.ok(1e-5, buffers=False)
    assert not r.ok(1e-6, buffers=False)
    assert r.layer_diffs() == {"0": 3e-7, "1": 4e-5}
    assert r.first_divergent_step(1e-6) == 0 and r.first_divergent_step(1e-5) is None
    table = r.table(tol=1e-5)
    assert str(r) == r.table()
    for text in ("torch loss", "running_var", "2x1x3x3", "4.000e-05", "FAIL at tolerance"):
        assert text in table, table
    assert "PASS at tolerance 0.001" in r.table(tol=1e-3)
    nan = _report(w=float("nan"))
    assert not nan.ok(1.0) and np.isnan(nan.max_param_diff)
    with pytest.raises(ValueError, match="tol must be a non-negative number"):
        r.ok(-1)


# ------------------------------------------------------------------- errors


def test_mismatched_models_raise_naming_both_sides():
    t = build_torch_model("mlp")
    with pytest.raises(WeightConversionError, match="3 convertible layers.*has 4"):
        run_parity(t, build_nnx_model("cnn"), "mse", example("mlp").data, ("sgd", 0.1))
    wide = torch.nn.Sequential(torch.nn.Linear(10, 17), torch.nn.Tanh(),
                               torch.nn.Linear(17, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))
    with pytest.raises(WeightConversionError, match="shape mismatch"):
        run_parity(wide, build_nnx_model("mlp"), "mse", example("mlp").data, ("sgd", 0.1))
    with pytest.raises(WeightConversionError, match="shape mismatch"):
        run_parity(wide, build_nnx_model("mlp"), "mse", example("mlp").data, ("sgd", 0.1),
                   copy_weights=False)


def test_bad_arguments_raise_clear_errors():
    ex = example("mlp")
    good = (ex.torch_model, ex.nnx_model, "mse", ex.data, ("sgd", 0.1))
    with pytest.raises(ValueError, match="same leading"):
        run_parity(*good[:3], (ex.data[0], ex.data[1][:5]), good[4])
    with pytest.raises(TypeError, match=r"\(inputs, targets\) pair"):
        run_parity(*good[:3], ex.data[0], good[4])
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        run_parity(*good, steps=0)
    with pytest.raises(ValueError, match="jax_input must be None, 'channels_last'"):
        run_parity(*good, jax_input="nhwc")
    with pytest.raises(TypeError, match="torch_model must be a torch.nn.Module"):
        run_parity(ex.nnx_model, ex.nnx_model, *good[2:])
    with pytest.raises(TypeError, match="nnx_model must be a flax.nnx.Module"):
        run_parity(ex.torch_model, ex.torch_model, *good[2:])


def test_divergence_is_reported_with_the_first_step():
    ex = example("mlp")  # NNX keeps its own initialisation
    report = run_parity(*ex[1:5], ("sgd", 0.1), steps=2, copy_weights=False)
    assert not report.ok(1e-3)
    assert report.first_divergent_step(1e-3) == 0
    assert report.max_param_diff > 1e-3


# ------------------------------------------------------------------------ CLI


def test_cli_exit_codes(capsys):
    assert main(["--model", "mlp", "--steps", "3", "--momentum", "0.9", "--tol", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "PASS at tolerance 1e-05" in out and "fc3" in out
    assert main(["--model", "mlp", "--steps", "3", "--momentum", "0.9", "--tol", "1e-12"]) == 1
    assert "FAIL at tolerance 1e-12" in capsys.readouterr().out
    assert main(["--model", "embedding", "--steps", "2", "--perturb", "1e-3"]) == 1
    assert "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--model", "resnet"])
    assert e.value.code == 2


def test_cli_runs_as_a_module_and_does_not_import_torch_at_package_import():
    """One fresh interpreter: ``import jdist.testing`` leaves torch alone, then the CLI
    runs as ``python -m`` would run it (runpy, ``__main__``)."""
    code = (
        "import sys, runpy, jdist.testing, jdist.testing.parity\n"
        "assert 'torch' not in sys.modules, 'torch imported by jdist.testing'\n"
        "sys.argv = ['parity', '--model', 'mlp', '--steps', '2', '--tol', '1e-5']\n"
        "runpy.run_module('jdist.testing.parity', run_name='__main__', alter_sys=True)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fc3" in res.stdout and "PASS at tolerance 1e-05" in res.stdout
