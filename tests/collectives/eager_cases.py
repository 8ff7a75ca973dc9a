"""Child-process checks for the eager collectives (run by ``run_procs`` in tests).

Every rank builds every rank's inputs from a seed, so each child computes the numpy
reference itself and asserts inside the child; a failure shows up as that rank's
traceback in the test's ``SpawnError``.
"""

from __future__ import annotations

import os
import time

import numpy as np

OPS_BY_DTYPE = {
    "float32": ("SUM", "AVG", "PRODUCT", "MIN", "MAX"),
    "int32": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "bool": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
}
SHAPE = (3, 4)


def make_input(rank: int, dtype: str, salt: int = 0, shape=SHAPE) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 7 * salt + len(dtype))
    if dtype == "float32":
        return rng.uniform(-2, 2, size=shape).astype(np.float32)
    if dtype == "int32":
        return rng.integers(-4, 5, size=shape).astype(np.int32)
    return rng.random(shape) > 0.5


def np_reduce(stack: np.ndarray, op: str) -> np.ndarray:
    """numpy reference of torch's reduction over axis 0 (bool follows torch)."""
    if stack.dtype == np.bool_:
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        return stack.sum(0) % 2 == 1
    return {
        "SUM": lambda s: s.sum(0, dtype=s.dtype),
        "AVG": lambda s: s.mean(0).astype(s.dtype),
        "PRODUCT": lambda s: s.prod(0, dtype=s.dtype),
        "MIN": lambda s: s.min(0),
        "MAX": lambda s: s.max(0),
        "BAND": lambda s: np.bitwise_and.reduce(s, 0),
        "BOR": lambda s: np.bitwise_or.reduce(s, 0),
        "BXOR": lambda s: np.bitwise_xor.reduce(s, 0),
    }[op](stack)


def close(a, b, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype,
                                                        b.dtype)
    if a.dtype.kind == "f":
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=what)
    else:
        np.testing.assert_array_equal(a, b, err_msg=what)


def _reductions(jdist, r: int, n: int, dtypes=tuple(OPS_BY_DTYPE)) -> None:
    for dtype in dtypes:
        ops = OPS_BY_DTYPE[dtype]
        for op_name in ops:
            op = getattr(jdist.ReduceOp, op_name)
            xs = [make_input(k, dtype) for k in range(n)]
            ref = np_reduce(np.stack(xs), op_name)
            x = xs[r].copy()
            close(jdist.all_reduce(x, op), ref, f"all_reduce {dtype} {op_name}")
            close(x, ref, f"all_reduce in place {dtype} {op_name}")
            out = jdist.reduce(xs[r].copy(), dst=n - 1, op=op)
            if r == n - 1:
                close(out, ref, f"reduce {dtype} {op_name}")
            else:
                close(out, xs[r], f"reduce non-dst {dtype} {op_name}")
            lists = [[make_input(k, dtype, salt=j) for j in range(n)] for k in range(n)]
            ref_rs = np_reduce(np.stack([lists[k][r] for k in range(n)]), op_name)
            close(jdist.reduce_scatter(None, lists[r], op), ref_rs,
                  f"reduce_scatter {dtype} {op_name}")
            close(jdist.reduce_scatter_tensor(None, np.concatenate(lists[r]), op), ref_rs,
                  f"reduce_scatter_tensor {dtype} {op_name}")
    x = make_input(r, "float32")
    for bad in ("BAND", "BOR", "BXOR"):
        try:
            jdist.all_reduce(x, getattr(jdist.ReduceOp, bad))
            raise AssertionError(f"{bad} on float32 did not raise")
        except TypeError as e:
            assert "float32" in str(e), e
    try:
        jdist.all_reduce(make_input(r, "int32"), jdist.ReduceOp.AVG)
        raise AssertionError("AVG on int32 did not raise")
    except TypeError as e:
        assert "int32" in str(e), e


def _data_movement(jdist, r: int, n: int, dtypes=tuple(OPS_BY_DTYPE)) -> None:
    for dtype in dtypes:
        xs = [make_input(k, dtype, salt=3) for k in range(n)]
        src = 1 % n
        close(jdist.broadcast(xs[r].copy(), src=src), xs[src], f"broadcast {dtype}")
        out_list = [np.zeros(SHAPE, xs[0].dtype) for _ in range(n)]
        got = jdist.all_gather(out_list, xs[r])
        assert got is out_list
        for k in range(n):
            close(out_list[k], xs[k], f"all_gather {dtype} [{k}]")
        close(jdist.all_gather_into_tensor(None, xs[r]), np.concatenate(xs),
              f"all_gather_into_tensor {dtype}")
        g = jdist.gather(xs[r], dst=0)
        if r == 0:
            for k in range(n):
                close(g[k], xs[k], f"gather {dtype} [{k}]")
        else:
            assert g is None
        table = [[make_input(k, dtype, salt=10 + j) for j in range(n)] for k in range(n)]
        out = np.zeros(SHAPE, xs[0].dtype)
        got = jdist.scatter(out, table[0] if r == 0 else None, src=0)
        close(got, table[0][r], f"scatter {dtype}")
        close(out, table[0][r], f"scatter in place {dtype}")
        recv = jdist.all_to_all(None, table[r])
        for k in range(n):
            close(recv[k], table[k][r], f"all_to_all {dtype} [{k}]")
        close(jdist.all_to_all_single(None, np.concatenate(table[r])),
              np.concatenate([table[k][r] for k in range(n)]), f"all_to_all_single {dtype}")


def _jax_in_jax_out(jdist, r: int, n: int) -> None:
    import jax
    import jax.numpy as jnp

    xs = [make_input(k, "float32") for k in range(n)]
    y = jdist.all_reduce(jnp.asarray(xs[r]))
    assert isinstance(y, jax.Array), type(y)
    close(np.asarray(y), np.stack(xs).sum(0), "all_reduce jax")
    gathered = jdist.all_gather(None, jnp.asarray(xs[r]))
    assert all(isinstance(v, jax.Array) for v in gathered)
    # torch's default int64 keeps its width even with JAX's x64 mode off
    big = np.array([2**40 + r, -(2**35)], np.int64)
    close(jdist.all_reduce(big.copy()),
          np.sum([np.array([2**40 + k, -(2**35)], np.int64) for k in range(n)], 0),
          "all_reduce int64")


def _async(jdist, r: int, n: int) -> None:
    xs = [make_input(k, "float32", salt=5) for k in range(n)]
    works = [jdist.all_reduce(xs[r].copy(), async_op=True) for _ in range(3)]
    wb = jdist.broadcast(xs[r].copy(), src=0, async_op=True)
    for w in works:
        close(w.wait(timeout=60), np.stack(xs).sum(0), "async all_reduce")
        assert w.is_completed()
    close(wb.wait(), xs[0], "async broadcast")
    # a blocking call after pending async ones runs after them, in order
    w = jdist.all_gather(None, xs[r], async_op=True)
    close(jdist.all_reduce(xs[r].copy(), jdist.ReduceOp.MAX), np.stack(xs).max(0), "after")
    close(np.stack(w.wait()), np.stack(xs), "async all_gather")
    jdist.barrier()
    jdist.barrier(async_op=True).wait()


def _objects(jdist, r: int, n: int) -> None:
    objs = [{"rank": k, "blob": "x" * (50 * k + 1), "arr": np.arange(k)} for k in range(n)]
    out = [None] * n
    assert jdist.all_gather_object(out, objs[r]) is out
    for k in range(n):
        assert out[k]["rank"] == k and len(out[k]["blob"]) == 50 * k + 1
        np.testing.assert_array_equal(out[k]["arr"], np.arange(k))
    lst = [("a", 1), {"b": [2] * 300}, None] if r == 0 else [None, None, None]
    jdist.broadcast_object_list(lst, src=0)
    assert lst == [("a", 1), {"b": [2] * 300}, None], lst
    g = jdist.gather_object(objs[r], None, dst=n - 1)
    assert (g is None) if r != n - 1 else [o["rank"] for o in g] == list(range(n))
    out = [None]
    inputs = [list(range(k * 40)) for k in range(n)] if r == 0 else None
    jdist.scatter_object_list(out, inputs, src=0)
    assert out[0] == list(range(r * 40)), out


def _p2p(jdist, r: int, n: int) -> None:
    # a ring of blocking send/recv: even ranks send first, odd ranks receive first
    mine = np.full((5,), 10 * r, np.int32)
    nxt, prv = (r + 1) % n, (r - 1) % n
    buf = np.zeros((5,), np.int32)
    if r % 2 == 0:
        jdist.send(mine, nxt)
        src, got = jdist.recv(buf, prv)
    else:
        src, got = jdist.recv(buf, prv)
        jdist.send(mine, nxt)
    assert src == prv and (got == 10 * prv).all() and (buf == 10 * prv).all(), (src, got)
    # a ring of isend/irecv, all in flight at once, twice (messages stay ordered)
    works = []
    for k in range(2):
        works.append(jdist.isend(np.full((2, 2), 100 * r + k, np.float32), nxt))
    recvs = [jdist.irecv(np.zeros((2, 2), np.float32), prv) for _ in range(2)]
    for k, w in enumerate(recvs):
        s, v = w.wait(timeout=60)
        assert s == prv and (v == 100 * prv + k).all(), (k, s, v)
    for w in works:
        w.wait(timeout=60)
        assert w.is_completed()
    # the same ring through batch_isend_irecv
    ops = [jdist.P2POp(jdist.isend, np.full((3,), r, np.int32), nxt),
           jdist.P2POp(jdist.irecv, np.zeros((3,), np.int32), prv)]
    works = jdist.batch_isend_irecv(ops)
    s, v = works[1].wait(timeout=60)
    works[0].wait(timeout=60)
    assert s == prv and (v == prv).all(), (s, v)
    # recv from any source: every rank sends to rank 0
    if r == 0:
        seen = sorted(int(jdist.recv(np.zeros((1,), np.int64))[0]) for _ in range(n - 1))
        assert seen == list(range(1, n)), seen
    else:
        jdist.send(np.array([r], np.int64), 0)


def _recompiles(jdist, r: int, n: int) -> None:
    import jax

    from jdist.collectives import _engine

    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: events.append(name) if "compile" in name else None)
    g = jdist.get_default_group()
    x = make_input(r, "float32")
    jdist.all_reduce(x.copy())
    jdist.all_gather(None, x)
    before = (_engine.stats(g)["compiles"], len(events))
    for _ in range(20):
        jdist.all_reduce(x.copy())
        jdist.all_gather(None, x)
        jdist.broadcast(x.copy(), src=0)
    after = (_engine.stats(g)["compiles"], len(events))
    assert after == before, f"repeated calls recompiled: {before} -> {after}"


def _large(jdist, r: int, n: int) -> None:
    """Host arrays from 256 KiB go through a reused staging buffer: results stay right
    (and earlier results untouched) across calls with new values, async and mixed ops."""
    shape = (300, 257)  # 308 KB of float32
    results, refs = [], []
    for salt in range(3):
        xs = [make_input(k, "float32", salt=10 + salt, shape=shape) for k in range(n)]
        x = xs[r].copy()
        results.append(jdist.all_reduce(x))
        refs.append(np.stack(xs).sum(0))
        close(x, refs[-1], f"large all_reduce in place {salt}")
        close(jdist.broadcast(xs[r].copy(), src=n - 1), xs[n - 1], f"large broadcast {salt}")
    for got, want in zip(results, refs, strict=True):  # not overwritten by the later calls
        close(got, want, "large all_reduce result kept")
    from jdist.collectives._group import resolve_group

    assert (shape, "<f4") in resolve_group(None).extra["staging"]  # the staged path ran
    ints = [make_input(k, "int32", salt=20, shape=shape) for k in range(n)]
    bools = [make_input(k, "bool", salt=21, shape=shape) for k in range(n)]
    works = [jdist.all_reduce(ints[r].copy(), jdist.ReduceOp.MAX, async_op=True),
             jdist.all_reduce(bools[r].copy(), jdist.ReduceOp.BOR, async_op=True),
             jdist.all_reduce(ints[r].copy(), jdist.ReduceOp.MIN, async_op=True)]
    close(works[0].wait(timeout=60), np.stack(ints).max(0), "large async MAX")
    close(works[1].wait(timeout=60), np.stack(bools).any(0), "large async BOR")
    close(works[2].wait(timeout=60), np.stack(ints).min(0), "large async MIN")
    xs = [make_input(k, "float32", salt=22, shape=shape) for k in range(n)]
    close(jdist.all_gather_into_tensor(None, xs[r]), np.concatenate(xs), "large all_gather")
    big = [make_input(k, "float32", salt=23, shape=(n * 100, 700)) for k in range(n)]
    close(jdist.reduce_scatter_tensor(None, big[r]), np.stack(big).sum(0)[r * 100:(r + 1) * 100],
          "large reduce_scatter_tensor")


def battery(subgroup: bool = True, dtypes=tuple(OPS_BY_DTYPE)) -> dict:
    """Every eager collective on this job; returns timing and device facts.

    ``dtypes``: the element types the reductions and data movement run over (each
    dtype x op is a program of its own; a second topology needs only float32's)."""
    import jax

    import jdist

    t0 = time.time()
    jdist.init_process_group(timeout=60)
    r, n = jdist.get_rank(), jdist.get_world_size()
    assert r == int(os.environ["RANK"]) and n == int(os.environ["WORLD_SIZE"])
    _reductions(jdist, r, n, dtypes)
    _data_movement(jdist, r, n, dtypes)
    _jax_in_jax_out(jdist, r, n)
    _async(jdist, r, n)
    _large(jdist, r, n)
    _objects(jdist, r, n)
    _p2p(jdist, r, n)
    _recompiles(jdist, r, n)
    if subgroup and n >= 3:
        sub = jdist.new_group([0, 2])
        if r in (0, 2):
            xs = [make_input(k, "int32") for k in (0, 2)]
            close(jdist.all_reduce(xs[r // 2].copy(), group=sub), xs[0] + xs[1], "subgroup")
            close(jdist.broadcast(xs[r // 2].copy(), src=2, group=sub), xs[1], "sub bcast")
            assert jdist.all_gather_object(None, r, group=sub) == [0, 2]
        else:
            assert sub is jdist.NON_GROUP_MEMBER
    local = len(jax.local_devices())
    jdist.destroy_process_group()
    return {"rank": r, "local_devices": local, "seconds": time.time() - t0}
