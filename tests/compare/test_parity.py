"""Parity through the public harness: torch vs Flax NNX, 5 steps, within 1e-5.

MLP (MSE), CNN with BatchNorm in training mode (running statistics compared too) and an
embedding model (cross-entropy), each with SGD (momentum) and Adam, single process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jdist.testing import OptimizerSpec, compare_models, run_parity
from jdist.testing.parity import EXAMPLES, example

TOL = 1e-5
OPTIMIZERS = {
    "sgd": OptimizerSpec("sgd", 0.1, momentum=0.9),
    "adam": OptimizerSpec("adam", 1e-2, betas=(0.9, 0.99), eps=1e-8),
}


def _torch_arrays(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
            if v.dtype.is_floating_point}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", EXAMPLES)
def test_single_process_parity(name, opt):
    ex = example(name, seed=1, n=48)
    before = _torch_arrays(ex.torch_model)
    report = run_parity(ex.torch_model, ex.nnx_model, ex.loss, ex.data, OPTIMIZERS[opt],
                        steps=5, batch_size=16, shuffle=True, seed=3,
                        jax_input=ex.jax_input)
    assert report.ok(TOL), report.table(TOL)
    assert len(report.steps) == 5
    # the run trained something: every array moved well beyond the tolerance
    after = _torch_arrays(ex.torch_model)
    moved = {k: float(np.abs(after[k] - before[k]).max()) for k in before}
    assert min(moved.values()) > 100 * TOL, moved
    # every array of every layer pair was compared, running statistics included
    names = {(a.torch_path, a.name) for a in report.arrays}
    expected = {tuple(k.rsplit(".", 1)) for k in before}
    assert names == expected
    if name == "cnn":
        assert {"running_mean", "running_var"} <= {a.name for a in report.arrays}
    # the report's final numbers are what an independent comparison gives
    again = compare_models(ex.torch_model, ex.nnx_model)
    assert [a.max_abs_diff for a in again] == [a.max_abs_diff for a in report.arrays]


def test_torch_losses_match_a_plain_torch_loop():
    """The harness feeds torch the sampler's batches in order (one epoch + wrap)."""
    ex = example("mlp", seed=2, n=20)
    ref = example("mlp", seed=2, n=20).torch_model
    report = run_parity(ex.torch_model, ex.nnx_model, "mse", ex.data, ("sgd", 0.05),
                        steps=4, batch_size=8, shuffle=True, seed=5,
                        params_every_step=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    sampler = torch.utils.data.DistributedSampler(range(20), num_replicas=1, rank=0,
                                                  shuffle=True, seed=5)
    batches = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        idx = list(sampler)
        batches += [idx[i:i + 8] for i in range(0, 20, 8)]  # sizes 8, 8, 4
    x, y = (torch.from_numpy(a) for a in ex.data)
    losses = []
    for b in batches[:4]:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x[b]), y[b])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose([s.torch_loss for s in report.steps], losses, rtol=1e-6)
    assert report.per_step_arrays is not None and len(report.per_step_arrays) == 4
    assert report.ok(TOL) and report.first_divergent_step(TOL) is None
