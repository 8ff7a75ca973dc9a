"""The unused-parameter family, run the same way in-process and in real processes.

A case is ``(flat, hook, usage, cap)``: flat buckets or not, the default reduction or a
comm hook, how the loss uses the parameters, and a bucket cap that puts every parameter
in a bucket of its own (``"tiny"``: a bucket whose parameters all get no gradient) or all
of them in one (``"one"``: a bucket mixing used and unused parameters). Each case trains
two SGD steps with ``find_unused_parameters=True`` and returns its losses and
parameters; the reference is plain single-device training on the whole batch.
"""

from __future__ import annotations

import itertools

import numpy as np

USAGES = ("all", "unused", "stop_gradient", "ignored_output", "shared")
CASES = list(itertools.product((True, False), (None, "allreduce"), USAGES, ("tiny", "one")))
CAPS = {"tiny": 1e-6, "one": 25.0}
# the real-process job runs each (flat, hook, usage) once, the cap alternating over them
MP_CASES = [c for c in CASES
            if c[3] == ("one", "tiny")[(c[0] + (c[1] is None) + USAGES.index(c[2])) % 2]]


def make_model(usage: str):
    """Three layers; ``usage`` decides which of them the loss differentiates."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(6, 5, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(6, 5, rngs=nnx.Rngs(1))
            self.c = nnx.Linear(5, 3, rngs=nnx.Rngs(2))

        def __call__(self, x):
            h = jnp.tanh(self.a(x))
            if usage == "all":
                h = h + self.b(x)
            elif usage == "stop_gradient":  # used, but no gradient reaches b
                h = h + jax.lax.stop_gradient(self.b(x))
            elif usage == "ignored_output":  # b's output is returned, the loss drops it
                return self.c(h), self.b(x)
            elif usage == "shared":  # c used twice (one gradient accumulated), b unused
                h = h + self.c(h) @ jnp.ones((3, 5)) * 0.1
            return self.c(h), None

    return Net()


def loss_fn(model, batch):
    import jax.numpy as jnp

    out, _ = model(batch["x"])
    return jnp.mean((out - batch["y"]) ** 2)


def batches(n=8, steps=2):
    rng = np.random.RandomState(0)
    return [{"x": rng.randn(n, 6).astype(np.float32), "y": rng.randn(n, 3).astype(np.float32)}
            for _ in range(steps)]


def reference(usage: str):
    """Plain training on one device over the whole batch: ``(losses, params)``."""
    import optax
    from flax import nnx

    model = make_model(usage)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    losses = []
    for b in batches():
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        losses.append(float(loss))
    return losses, _params(model)


def _params(model):
    import jax
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def run_case(case, rank=0, world=1, group=None):
    """Train ``case`` with DDP on this rank's rows of each batch: ``(losses, params)``."""
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.ddp.hooks import allreduce_hook

    flat, hook, usage, cap = case
    model = make_model(usage)
    ddp = DDP(model, process_group=group, find_unused_parameters=True, flat_buckets=flat,
              bucket_cap_mb=CAPS[cap], comm_hook=allreduce_hook if hook else None)
    step = ddp.train_step(loss_fn, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    losses = []
    for b in batches():
        k = len(b["x"]) // world
        losses.append(float(step({n: v[rank * k:(rank + 1) * k] for n, v in b.items()})))
    return losses, _params(model)


def run_all(_rank=None):
    """Every case in this process (a real-process job): ``{case: result or error}``."""
    from tests.ddp.mp_cases import _finish, _init

    rank, world = _init()
    out = {}
    for case in MP_CASES:
        try:
            out[case] = run_case(case, rank, world)
        except Exception as e:  # reported per case by the test
            out[case] = f"{type(e).__name__}: {e}"[:400]
    _finish()
    return out
