"""Checked eager collectives whose fingerprint and data fit one slot run as a single
all-gather and compute every member's result locally (``jdist/collectives/_engine.py``
``packed_program``: the body's collectives batched by ``vmap``); larger ones gather the
slot, then run the collective. A generated grid of calls (every kind that stages its
input, every reduce op per dtype, sizes on both sides of the slot, numpy and jax
inputs) on 3 processes gives, with the check on and off, what numpy gives (bit for bit
on every rank for exact types), and the same as the real collective where the call is
larger than the slot (the check-off path runs the one-trip program too where the call
fits the slot); and a mismatched pair of calls still raises on every rank whichever
side of the slot each call is on.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.collectives.eager_cases import OPS_BY_DTYPE, make_input, np_reduce
from tests.helpers import run_procs

WORLD = 3


def _slot_elems(world: int) -> int:
    """float32/int32 elements that fill a group of ``world``'s slot with the fingerprint."""
    from jdist.collectives._engine import slot_bytes
    from jdist.collectives._fingerprint import FP_LEN

    return slot_bytes(world) // 4 - FP_LEN


SLOT_ELEMS = _slot_elems(WORLD)
PAIR_ELEMS = _slot_elems(2)


def _cases() -> list[tuple]:
    out = []
    for dtype, ops in OPS_BY_DTYPE.items():
        sizes = (7, 2 * SLOT_ELEMS) if dtype == "float32" else (7,)
        for op, n in itertools.product(ops, sizes):
            out.append(("all_reduce", dtype, op, n))
    for kind, n in itertools.product(("broadcast", "all_gather", "reduce_scatter",
                                      "all_to_all"), (1, SLOT_ELEMS + 1)):
        out.append((kind, "float32", "SUM", n))
    out += [("all_reduce", "float64", "SUM", 9), ("all_reduce", "int64", "MAX", 9),
            ("broadcast", "complex64", None, 5), ("all_reduce", "float32", "SUM", SLOT_ELEMS),
            ("all_reduce", "float32", "SUM", SLOT_ELEMS + 1)]
    return out


def _call(jdist, kind, x, op, rank, world):
    op_ = getattr(jdist.ReduceOp, op) if op else None
    if kind == "all_reduce":
        return jdist.all_reduce(x, op=op_)
    if kind == "broadcast":
        return jdist.broadcast(x, src=1)
    if kind == "all_gather":
        return np.stack([np.asarray(v) for v in jdist.all_gather([None] * world, x)])
    if kind == "reduce_scatter":
        out = np.zeros_like(np.asarray(x))
        return jdist.reduce_scatter(out, [x] * world, op=op_)
    out = [np.zeros_like(np.asarray(x)) for _ in range(world)]
    return np.stack([np.asarray(v) for v in jdist.all_to_all(out, [x * (j + 1) for j in
                                                                    range(world)])])


def _want(kind, dtype, op, n, rank, world, salt):
    xs = [_input(r, dtype, n, salt) for r in range(world)]
    if kind == "all_reduce":
        return np_reduce(np.stack(xs), op)
    if kind == "broadcast":
        return xs[1]
    if kind == "all_gather":
        return np.stack(xs)
    if kind == "reduce_scatter":
        return np.stack(xs).sum(0, dtype=xs[0].dtype)
    return np.stack([xs[j] * (rank + 1) for j in range(world)])


def _input(rank, dtype, n, salt):
    if dtype in OPS_BY_DTYPE:
        return make_input(rank, dtype, salt, shape=(n,))
    rng = np.random.default_rng(rank * 31 + salt)
    if dtype == "complex64":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    return (rng.integers(-5, 5, n) if dtype == "int64" else rng.standard_normal(n)).astype(
        dtype)


def _child(cases):
    import os

    import jax
    import jax.numpy as jnp

    import jdist

    jdist.init_process_group(timeout=60)
    rank, world = jdist.get_rank(), jdist.get_world_size()
    bad, results = [], []
    for i, (kind, dtype, op, n) in enumerate(cases):
        x = _input(rank, dtype, n, i)
        want = _want(kind, dtype, op, n, rank, world, i)
        got = {}
        for mode, as_jax in (("ON", False), ("ON", True), ("OFF", False)):
            if as_jax and np.dtype(dtype).itemsize == 8:
                continue  # (no 64-bit jax arrays with x64 off)
            os.environ["JDIST_DEBUG"] = mode
            arg = jnp.asarray(x) if as_jax else x.copy()
            got[mode, as_jax] = np.asarray(_call(jdist, kind, arg, op, rank, world))
        exact = np.dtype(dtype).kind not in "fc" or op in (None, "MIN", "MAX")
        for key, v in got.items():
            if v.shape != want.shape or v.dtype != want.dtype:
                bad.append((kind, dtype, op, n, key, "shape/dtype", v.shape, v.dtype))
            elif exact and not np.array_equal(v, want):
                bad.append((kind, dtype, op, n, key, "value"))
            elif not exact and not np.allclose(v, want, rtol=1e-5, atol=1e-5):
                bad.append((kind, dtype, op, n, key, "value"))
        results.append(got["ON", False].tobytes())
    os.environ["JDIST_DEBUG"] = "ON"
    jax.block_until_ready(jnp.zeros(1))
    jdist.destroy_process_group()
    return bad, results


def test_checked_calls_equal_the_real_collective_and_numpy():
    cases = _cases()
    out = run_procs(_child, WORLD, args=(cases,), timeout=400)
    for bad, _ in out:
        assert bad == []
    # every member computed the same bytes where the result is the same for all
    same = [i for i, c in enumerate(cases) if c[0] in ("all_reduce", "broadcast",
                                                       "all_gather")]
    for i in same:
        assert len({out[r][1][i] for r in range(WORLD)}) == 1, cases[i]


def _mismatch(sizes):
    import jdist
    from jdist.errors import CollectiveMismatchError

    jdist.init_process_group(timeout=30)
    rank = jdist.get_rank()
    try:
        jdist.all_reduce(np.ones(sizes[rank], np.float32))
    except CollectiveMismatchError as e:
        msg = str(e)
    else:
        msg = "no error"
    out = jdist.all_reduce(np.ones(3, np.float32))  # the group still works afterwards
    jdist.destroy_process_group()
    return msg, out.tolist()


@pytest.mark.parametrize("sizes", [(7, 9), (7, PAIR_ELEMS + 1), (PAIR_ELEMS + 1, 3 * PAIR_ELEMS),
                                   (PAIR_ELEMS, PAIR_ELEMS + 1)])
def test_mismatched_calls_raise_on_every_rank_either_side_of_the_slot(sizes):
    out = run_procs(_mismatch, 2, args=(sizes,), timeout=120)
    for msg, after in out:
        assert "shape" in msg and str(sizes[0]) in msg and str(sizes[1]) in msg, msg
        assert after == [2.0, 2.0, 2.0]
