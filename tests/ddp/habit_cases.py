"""A Flax user's own loop around DDP, run the same way in-process and in real processes.

The user's model has dropout (its own ``nnx.Rngs``) and the tutorial's steps: an
``@nnx.jit train_step(model, optimizer, metrics, batch)`` and ``eval_step``, with an
``nnx.MultiMetric``. The reference is the same steps on one device over the global batch.
"""

from __future__ import annotations

import numpy as np

N_GLOBAL = 8


def make_model():
    import jax
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(5, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.b = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(jax.nn.relu(self.a(x))))

    return Net(nnx.Rngs(0, dropout=1))


def loss_fn(model, batch):
    import jax.numpy as jnp

    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def steps():
    """The tutorial's jitted train and eval steps, and fresh metrics."""
    from flax import nnx

    @nnx.jit
    def train_step(model, optimizer, metrics, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        metrics.update(loss=loss)
        optimizer.update(model, grads)

    @nnx.jit
    def eval_step(model, metrics, batch):
        metrics.update(loss=loss_fn(model, batch))

    return train_step, eval_step, nnx.MultiMetric(loss=nnx.metrics.Average("loss"))


def batches(n=3):
    rng = np.random.RandomState(0)
    return [{"x": rng.randn(N_GLOBAL, 5).astype(np.float32),
             "y": rng.randn(N_GLOBAL, 3).astype(np.float32)} for _ in range(n)]


def rows(batch, rank, world):
    k = N_GLOBAL // world
    return {n: v[rank * k:(rank + 1) * k] for n, v in batch.items()}


def params_of(model):
    import jax
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def user_loop(ddp=None, rank=0, world=1):
    """Train with the user's own steps (through ``ddp.shard_batch`` when given), then
    evaluate: ``(train metrics, eval metrics, params)``."""
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    model = make_model()
    if ddp is not None:
        ddp = DDP(model, process_group=ddp)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    train_step, eval_step, metrics = steps()
    for b in batches():
        train_step(model, opt, metrics, ddp.shard_batch(rows(b, rank, world)) if ddp else b)
    train = {k: float(v) for k, v in metrics.compute().items()}
    metrics.reset()
    model.eval()
    b = batches(1)[0]
    eval_step(model, metrics, ddp.shard_batch(rows(b, rank, world)) if ddp else b)
    return train, {k: float(v) for k, v in metrics.compute().items()}, params_of(model)


def after_ddp_steps(kind, group=None, rank=0, world=1):
    """The user's own code on the module after DDP's ``kind`` of call: an ``@nnx.jit``
    eval step, eager math, a second DDP wrapper; returns what each gave."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model, process_group=group)
    b = rows(batches(1)[0], rank, world)
    if kind == "train_step":
        ddp.train_step(loss_fn, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))(b)
    elif kind == "value_and_grad":
        ddp.value_and_grad(loss_fn)(b)
    else:
        ddp(b["x"])
    _, eval_step, metrics = steps()
    model.eval()
    eval_step(model, metrics, b)
    out = {"eval": float(metrics.compute()["loss"]),
           "eager": float(jnp.sum(model.a.kernel[...] * 2.0)),
           "kernel": np.asarray(model.a.kernel[...])}
    DDP(model, process_group=group)
    return out


def forward_outputs(group=None, rank=0):
    """``ddp(x, y)`` of a module returning ``(logits, loss)`` and a dict with a scalar."""
    import jax.numpy as jnp
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    class WithLoss(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

        def __call__(self, x, y):
            logits = self.a(x)
            loss = jnp.mean((logits - y) ** 2)
            return logits, {"loss": loss, "n": jnp.sum(x > 0)}

    x = np.full((4, 4), rank + 1.0, np.float32) * np.arange(4, dtype=np.float32)[:, None]
    y = np.zeros((4, 3), np.float32)
    got = DDP(WithLoss(), process_group=group)(x, y)
    return (np.asarray(got[0]), {k: np.asarray(v) for k, v in got[1].items()}, x, y)


def main():
    """The real-process job: each piece on 2 processes."""
    from jdist.collectives._group import group_state
    from tests.ddp.mp_cases import _finish, _init

    rank, world = _init()
    out = {"shard": user_loop(ddp=group_state.default_group, rank=rank, world=world),
           "diverged": _diverged(rank, world),
           "after": {k: after_ddp_steps(k, rank=rank, world=world)
                     for k in ("train_step", "value_and_grad", "forward")},
           "forward": forward_outputs(rank=rank),
           "skewed": manual_optimizer_skewed(rank)}
    from tests.ddp import syncbn_cases

    out["syncbn"] = syncbn_cases.mp_cases(rank)
    _finish()
    return out


def _diverged(rank, world):
    """The tutorial's step fed each process's own rows (no shard_batch): the replicas
    drift, and the next DDP call says so."""
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    train_step, _, metrics = steps()
    b = rows(batches(1)[0], rank, world)
    train_step(model, opt, metrics, b)
    try:
        ddp.value_and_grad(loss_fn)(b)
    except Exception as e:  # noqa: BLE001 - the test checks the class and text
        return type(e).__name__, str(e)
    return None


def manual_optimizer_skewed(rank, steps=40, group=None):
    """``ddp.value_and_grad`` with the optimizer applied by hand (the parameters change
    outside DDP every step, so DDP checks the replicas now and then), one process
    slower than the other: both must decide alike when to check (a wall-clock throttle
    made the faster one check alone and wait forever). Returns the losses and the
    final parameters."""
    import time

    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    ddp = DDP(model, process_group=group)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    value_and_grad = ddp.value_and_grad(
        lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    x = np.arange(24, dtype=np.float32).reshape(8, 3) / 24
    y = np.ones((8, 2), np.float32)
    losses = []
    for _ in range(steps):
        loss, grads = value_and_grad((x, y))  # each process: the same 8 rows
        opt.update(model, grads)
        losses.append(float(loss))
        if rank == 1:
            time.sleep(0.03)
    return losses, {k: np.asarray(v) for k, v in nnx.to_pure_dict(
        nnx.state(model, nnx.Param)).items()}
