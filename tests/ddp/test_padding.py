"""Shape buckets: ``train_step(pad_batch_to=...)`` compiles once per size and is exact.

Variable-size batches (torch's HybridModel trainers see them) are padded to a few sizes
with a mask; the losses and parameters must equal plain full-batch training on the
unpadded batches, and repeated sizes must not trace (compile) again.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.ddp import DistributedDataParallel as DDP
from tests.ddp.models import MLP, data, max_diff, mse, reference_train

ROWS = [13, 27, 20, 9]  # over 8 replicas: padded to 16, 32, 32, 16


def _batches():
    return [data(n=n, seed=i) for i, n in enumerate(ROWS)]


def _ddp_train(pad_batch_to):
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model)
    traces = []

    def per_example(m, b):
        traces.append(b["x"].shape)
        return jnp.mean((m(b["x"]) - b["y"]) ** 2, axis=-1)

    step = ddp.train_step(per_example, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param),
                          pad_batch_to=pad_batch_to)
    losses, seen = [], []
    for b in _batches():
        losses.append(float(step(b)))
        seen.append(len(traces))
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param)), seen


@pytest.mark.parametrize("pad_batch_to", [[16, 32], 32])
def test_padded_steps_equal_unpadded_training_and_compile_once_per_size(pad_batch_to):
    losses, params, seen = _ddp_train(pad_batch_to)
    ref = MLP(rngs=nnx.Rngs(0))
    ref_losses = reference_train(ref, optax.adam(1e-2), _batches(), loss_fn=mse)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_diff(params, nnx.to_pure_dict(nnx.state(ref, nnx.Param))) < 1e-5
    if pad_batch_to == 32:
        assert seen[0] == seen[-1]  # one size: traced at the first step only
    else:
        assert seen[1] == seen[-1]  # 20 reuses 32's program, 9 reuses 16's


def test_padding_errors_name_the_fix():
    model = MLP(rngs=nnx.Rngs(0))
    ddp = DDP(model)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    per = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2, axis=-1)  # noqa: E731
    with pytest.raises(ValueError, match=r"sizes \[12\] are not positive multiples of this "
                                         r"process's 8 devices"):
        ddp.train_step(per, opt, pad_batch_to=[12, 16])
    with pytest.raises(TypeError, match="must be an int or a non-empty list of ints"):
        ddp.train_step(per, opt, pad_batch_to="auto")
    step = ddp.train_step(per, opt, pad_batch_to=16)
    with pytest.raises(ValueError, match="has 20 rows, more than the largest pad_batch_to "
                                         "size 16; add a size >= 20"):
        step(data(n=20))
    from jdist.ddp._padding import PadSizes

    with pytest.raises(ValueError, match="with 2 processes every process must pad to the "
                                         "same size.*pass one int"):
        PadSizes([16, 32], local_devices=8, processes=2)
    assert PadSizes(32, local_devices=8, processes=2).sizes == (32,)
    scalar = ddp.train_step(mse, opt, pad_batch_to=16)
    with pytest.raises(ValueError, match="must return one loss per example"):
        scalar(data(n=12))
