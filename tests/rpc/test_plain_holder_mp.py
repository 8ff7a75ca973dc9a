"""A parameter server that is a plain Python class holding NNX modules, trained by RPC
under distributed autograd in 2 real processes: its parameters get the gradients
jax.grad gives (they got none, silently, when only nnx.Modules were searched), and
torch's idioms on get_gradients' result work on the owner (``{k: v for k, v in
grads.items()}`` raised "unhashable type: 'Param'")."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_procs
from tests.rpc._holder_workers import LR, reference_grads


@pytest.fixture(scope="module")
def trained():
    return run_procs(_run, 2, timeout=240)[1]


def _run():
    from tests.rpc._holder_workers import run

    return run()


def test_plain_class_holding_modules_gets_gradients(trained):
    ref = reference_grads(trained["before"])
    got = trained["idioms"]["by_param"]
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    for w0, w1, r in zip(trained["before"], trained["after"], ref, strict=True):
        np.testing.assert_allclose(w1, w0 - LR * r, rtol=1e-5, atol=1e-6)  # the SGD step
    assert trained["idioms"]["calls"] == 1  # the attribute it rebinds, as in torch


def test_gradient_map_torch_idioms(trained):
    idioms = trained["idioms"]
    ref = reference_grads(trained["before"])
    assert idioms["nonempty"] is True
    assert idioms["count"] == 5  # the shared module counted once
    np.testing.assert_allclose(idioms["copied_kernel"], ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(idioms["plain_kernel"], ref[0], rtol=1e-5, atol=1e-6)
    assert idioms["keys_equal_params"] is True
