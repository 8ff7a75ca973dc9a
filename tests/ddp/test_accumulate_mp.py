"""Across real processes: gradients of ``ddp.value_and_grad`` summed over calls separated
by every kind of parameter update (eager optimizer update, a jitted one, optax applied
by hand, a DDP ``train_step``), against full-batch gradients computed here with plain
JAX (generated sequences); and the join context failing fast on every process, naming
the fix, where it cannot shadow a step (a ZeRO step it does not list, a step a process
without inputs never made) instead of leaving the others in a collective until the
group's timeout."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from tests.helpers import run_procs

UPDATES = ("eager", "jit", "optax", "train")


def _data(rank: int, i: int):
    rng = np.random.default_rng(100 * rank + i)
    return (rng.standard_normal((8, 4)).astype(np.float32),
            rng.standard_normal((8, 2)).astype(np.float32))


def _accumulate(sequences):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel as DDP

    jdist.init_process_group()
    rank, world = jdist.get_rank(), jdist.get_world_size()

    def loss_fn(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    errors = []
    for seq in sequences:
        model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2,
                                                                              rngs=nnx.Rngs(1)))
        ddp = DDP(model)
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        vg, step = ddp.value_and_grad(loss_fn), ddp.train_step(loss_fn, opt)
        graph = nnx.graphdef(model)
        acc, want = None, None
        for i, update in enumerate(seq):
            b = _data(rank, i)
            full = tuple(np.concatenate([_data(r, i)[k] for r in range(world)])
                         for k in range(2))
            params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
            ref = jax.grad(lambda p, f=full, gd=graph: loss_fn(nnx.merge(gd, p), f))(params)
            _, g = vg(b)
            acc = g if acc is None else jax.tree.map(jnp.add, acc, g)  # across updates
            want = ref if want is None else jax.tree.map(np.add, want, ref)
            if update == "eager":
                opt.update(model, g)
            elif update == "jit":
                nnx.jit(lambda m, o, gg: o.update(m, gg))(model, opt, g)
            elif update == "optax":
                p = nnx.state(model, nnx.Param)
                nnx.update(model, jax.tree.map(lambda a, c: a - 0.05 * c, p, g))
            else:
                step(b)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(w))))
                   for a, w in zip(jax.tree.leaves(acc), jax.tree.leaves(want), strict=True))
        if diff > 1e-5:
            errors.append((seq, diff))
    jdist.destroy_process_group()
    return errors


def test_gradients_accumulate_across_every_kind_of_update():
    seqs = [p for p in itertools.product(UPDATES, repeat=2)] + [
        ("train", "eager", "jit"), ("jit", "train", "optax"), ("optax", "optax", "train")]
    assert run_procs(_accumulate, 2, args=(seqs,), timeout=300) == [[], []]


def _join_case(case: str):
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.errors import JoinError
    from jdist.optim import ZeroRedundancyOptimizer

    jdist.init_process_group(timeout=60)
    rank = jdist.get_rank()

    def loss_fn(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    ddp = DDP(model)
    n = {"zero": (3, 2), "no_input": (3, 0)}[case][rank]
    batches = [_data(rank, i) for i in range(n)]
    t0 = time.monotonic()
    try:
        if case == "zero":  # torch's ZeRO after DDP's gradients, inside ddp.join() only
            zero = ZeroRedundancyOptimizer(optax.adam(1e-2))
            params = nnx.state(model, nnx.Param)
            state = zero.init(params)
            vg = ddp.value_and_grad(loss_fn)
            with ddp.join():
                for b in batches:
                    _, g = vg(b)
                    params, state = zero.step(params, g, state)
        else:  # the step made inside the loop: a process without inputs never makes it
            with ddp.join():
                for b in batches:
                    ddp.value_and_grad(loss_fn)(b)
        out = "no error"
    except JoinError as e:
        out = str(e)
    jdist.destroy_process_group()
    return out, time.monotonic() - t0


@pytest.mark.parametrize("case, words", [
    ("zero", "ZeroRedundancyOptimizer ran its collectives inside a join context that "
             "does not list it"),
    ("no_input", "rank 1 ran no DDP step inside the join context"),
])
def test_join_fails_fast_everywhere_where_it_cannot_shadow(case, words):
    res = run_procs(_join_case, 2, args=(case,), timeout=120)
    for msg, seconds in res:
        assert words in msg
        assert seconds < 20  # not the group's 60 s timeout
