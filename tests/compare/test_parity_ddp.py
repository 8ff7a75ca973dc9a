"""Parity under data parallelism: torch DDP (gloo) vs jdist DDP, 2 processes each.

One launch per framework runs every case (``run_parity_cases``): MLP (SGD with momentum),
CNN with BatchNorm in training mode (Adam; running statistics compared) and an embedding
model (Adam), 5 steps within 1e-5, every process on its DistributedSampler share; plus
one case whose NNX model keeps its own weights, which must be reported as diverged.
(Single-process tests run every model with both optimizers; each DDP case costs a
compilation in every process, so this keeps to one optimizer per model.)
"""

from __future__ import annotations

import functools

import pytest

import tests.helpers  # noqa: F401  (the suite's fork-server preload)
from jdist.errors import WeightConversionError
from jdist.testing import OptimizerSpec, run_parity, run_parity_cases
from jdist.testing.parity import EXAMPLES, build_nnx_model, build_torch_model, example

TOL = 1e-5
OPTIMIZERS = {
    "sgd": OptimizerSpec("sgd", 0.1, momentum=0.9),
    "adam": OptimizerSpec("adam", 1e-2, betas=(0.9, 0.99)),
}


def _case(name, opt, **kw):
    ex = example(name, seed=1, n=40)
    return dict(torch_model=functools.partial(build_torch_model, name, 1),
                nnx_model=functools.partial(build_nnx_model, name, 1), loss=ex.loss,
                data=ex.data, optimizer=OPTIMIZERS[opt], steps=5, batch_size=8,
                shuffle=True, seed=4, jax_input=ex.jax_input, **kw)


@pytest.mark.slow(seconds=27)  # a long end-to-end run
def test_ddp_parity_two_processes():
    keys = [("mlp", "sgd"), ("cnn", "adam"), ("embedding", "adam")]
    assert {name for name, _ in keys} == set(EXAMPLES)
    cases = [_case(name, opt) for name, opt in keys]
    cases.append(_case("mlp", "sgd", copy_weights=False, params_every_step=True))
    # forked from the suite's fork server (tests/helpers.py preloads torch and JAX)
    reports = run_parity_cases(cases, nprocs=2, timeout=400, start_method="forkserver")
    for (name, opt), report in zip(keys, reports[:-1], strict=False):
        assert report.ok(TOL), f"{name}/{opt}\n{report.table(TOL)}"
        assert len(report.steps) == 5 and report.per_step_arrays is None
        assert "jdist DDP" in report.config["nprocs"]
        assert "(jdist == torch)" in report.config["sampler"]
        if name == "cnn":
            stats = [a for a in report.arrays if a.is_buffer]
            assert {a.name for a in stats} == {"running_mean", "running_var"}
    diverged = reports[-1]
    assert not diverged.ok(1e-3) and diverged.first_divergent_step(1e-3) == 0
    assert len(diverged.per_step_arrays) == 5


def test_ddp_parity_needs_model_factories():
    ex = example("mlp")
    with pytest.raises(TypeError, match="must be a picklable function that builds"):
        run_parity(ex.torch_model, ex.nnx_model, "mse", ex.data, ("sgd", 0.1), nprocs=2)
    with pytest.raises(TypeError, match="jax_input must be picklable"):
        run_parity(functools.partial(build_torch_model, "mlp"),
                   functools.partial(build_nnx_model, "mlp"), "mse", ex.data, ("sgd", 0.1),
                   nprocs=2, jax_input=lambda a: a)
    with pytest.raises(WeightConversionError, match="3 convertible layers"):  # before launch
        run_parity(functools.partial(build_torch_model, "mlp"),
                   functools.partial(build_nnx_model, "cnn"), "mse", ex.data, ("sgd", 0.1),
                   nprocs=2)
    with pytest.raises(ValueError, match="sets \\['nprocs'\\]"):
        run_parity_cases([dict(_case("mlp", "sgd"), nprocs=2)])
