"""SyncBatchNorm with replicas holding different numbers of rows (none included), run
in-process (padding decides each replica's real rows) and in real processes; the
reference is a plain BatchNorm on one device over the real rows only."""

from __future__ import annotations

import numpy as np


def make_model(ndim, fast=True):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(4, use_fast_variance=fast, momentum=0.5,
                                    rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.bn(self.a(x))

    return Net()


def per_example(model, x):
    import jax.numpy as jnp

    y = model(x)
    return jnp.mean(y ** 2 + y, axis=tuple(range(1, y.ndim)))


def rows(n, ndim, seed=0):
    shape = (n,) + (2,) * (ndim - 2) + (3,)
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def reference(xs, ndim, fast=True):
    """One SGD step of the plain model over the real rows: (loss, params, bn stats)."""
    import optax
    from flax import nnx

    model = make_model(ndim, fast)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = np.concatenate(xs)
    loss, grads = nnx.value_and_grad(lambda m: per_example(m, x).mean())(model)
    opt.update(model, grads)
    return float(loss), _state(model)


def _state(model):
    import jax
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def ddp_step(x, pad_to, ndim, fast=True, group=None):
    """One padded DDP step of the converted model on this process's rows ``x``."""
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.ddp import convert_sync_batchnorm

    model = convert_sync_batchnorm(make_model(ndim, fast), group)
    ddp = DDP(model, process_group=group)
    step = ddp.train_step(per_example, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
                          pad_batch_to=pad_to)
    return float(step(x)), _state(model)


MP_SPLITS = ((6, 0), (0, 3), (5, 2))  # rows on rank 0 and rank 1


def mp_cases(rank):
    """The real-process cases: each split, padded to 6 rows per process; and an
    unpadded step with unequal sizes, which must raise naming the sizes."""
    out = {}
    for split in MP_SPLITS:
        xs = [rows(n, 2, seed=r) for r, n in enumerate(split)]
        out[split] = ddp_step(xs[rank], 6, 2)
    try:
        import optax
        from flax import nnx

        from jdist.ddp import DistributedDataParallel as DDP

        model = make_model(2)
        step = DDP(model).train_step(lambda m, x: per_example(m, x).mean(),
                                     nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
        step(rows(4 if rank == 0 else 0, 2))
        out["unequal"] = None
    except ValueError as e:
        out["unequal"] = str(e)
    return out
