"""Eager collectives reuse one staged input array per (group, shape, dtype) on CPU
(``jdist/collectives/_engine.py``, ``_staged_global``): a generated sequence of calls
(shapes repeating and interleaved, numpy and jax inputs, check on and off, sync and
async, every op kind that stages its input, float32 and int32 calls sharing a row's
byte size, and with few packed plans kept) gives each call its own values, compared
with numpy on every rank. A stale buffer would hand a later call an earlier value."""

from __future__ import annotations

import numpy as np

from tests.helpers import run_procs

SHAPES = [(3,), (2, 5), (3,), (40,), (2, 5), (1,), (3,)]


def _sequence(seed: int, n: int = 24) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(SHAPES[rng.integers(len(SHAPES))], bool(rng.integers(2)), bool(rng.integers(2)),
             ["ON", "OFF"][rng.integers(2)], ["all_reduce", "broadcast", "all_gather"][
                 rng.integers(3)], ["float32", "int32"][rng.integers(2)]) for _ in range(n)]


def _value(rank: int, step: int, shape: tuple, dtype: str = "float32") -> np.ndarray:
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100 * step
            + 1000 * rank).astype(dtype)


def _child(seed: int, plan_cap: int | None):
    import os

    import jax.numpy as jnp

    import jdist
    from jdist.collectives import _engine

    if plan_cap is not None:
        _engine.PLAN_CAP = plan_cap
    jdist.init_process_group()
    rank, world = jdist.get_rank(), jdist.get_world_size()
    bad = []
    pending = []
    for step, (shape, as_jax, asyn, mode, op, dt) in enumerate(_sequence(seed)):
        os.environ["JDIST_DEBUG"] = mode
        x = _value(rank, step, shape, dt)
        arg = jnp.asarray(x) if as_jax else x.copy()
        if op == "all_reduce":
            want = sum(_value(r, step, shape, dt) for r in range(world))
            out = jdist.all_reduce(arg, async_op=asyn)
        elif op == "broadcast":
            want = _value(0, step, shape, dt)
            out = jdist.broadcast(arg, src=0, async_op=asyn)
        else:
            want = np.stack([_value(r, step, shape, dt) for r in range(world)])
            outs = [np.zeros(shape, dt) for _ in range(world)]
            work = jdist.all_gather(outs, arg, async_op=asyn)
            out = (work, outs)
        pending.append((step, op, asyn, out, want))
        if not asyn or step % 3 == 0:
            for s, o, a, res, w in pending:
                if o == "all_gather":
                    work, outs = res
                    if a:
                        work.wait()
                    got = np.stack([np.asarray(v) for v in outs])
                else:
                    got = np.asarray(res.wait() if a else res)
                if not np.array_equal(got, w) or got.dtype != w.dtype:
                    bad.append((s, o, a))
            pending = []
    for s, o, a, res, w in pending:
        got = np.asarray(res.wait()) if o != "all_gather" else None
        if o == "all_gather":
            res[0].wait()
            got = np.stack([np.asarray(v) for v in res[1]])
        if not np.array_equal(got, w) or got.dtype != w.dtype:
            bad.append((s, o, a))
    jdist.destroy_process_group()
    return bad


def test_staged_inputs_never_hand_a_call_another_calls_values():
    for seed, plan_cap in ((0, None), (1, 2)):
        assert run_procs(_child, 2, args=(seed, plan_cap), timeout=240) == [[], []]
