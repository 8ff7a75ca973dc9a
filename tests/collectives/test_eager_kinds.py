"""Eager results keep the input's kind, shape and placement (0-d and empty inputs too).

One 2-process launch runs the grid: every eager collective x {numpy, jax} input x
shapes {(), (2, 0)} in float32 (dtypes are test_eager.py's grid); the parent
checks each result's kind, shape, dtype and value against a numpy reference built from
every rank's input.
Jax results of uncommitted inputs are uncommitted, so they can be placed on the group's
mesh across processes (``device_put`` to ``NamedSharding(mesh, P())``), which a result
committed to the collective's device could not be.
"""

from __future__ import annotations

import itertools

import numpy as np

from tests.helpers import run_procs

N = 2
SHAPES = ((), (2, 0))
DTYPES = ("float32",)
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "send_recv")


def _input(rank, shape, dtype, slot=0):
    rng = np.random.default_rng(100 * rank + 10 * len(shape) + slot)
    return rng.integers(-9, 9, shape).astype(dtype)


def _call(jdist, name, rank, shape, dtype, xp):
    x = xp.asarray(_input(rank, shape, dtype))
    pieces = [xp.asarray(_input(rank, shape, dtype, slot=1 + i)) for i in range(N)]
    if name == "all_reduce":
        return jdist.all_reduce(x)
    if name == "broadcast":
        return jdist.broadcast(x, src=0)
    if name == "reduce":
        return jdist.reduce(x, dst=0)
    if name == "all_gather":
        return jdist.all_gather(None, x)
    if name == "all_gather_into_tensor":
        return jdist.all_gather_into_tensor(None, x)
    if name == "gather":
        return jdist.gather(x, dst=0)
    if name == "scatter":
        return jdist.scatter(x, pieces if rank == 0 else None, src=0)
    if name == "reduce_scatter":
        return jdist.reduce_scatter(None, pieces)
    if name == "all_to_all":
        return jdist.all_to_all(None, pieces)
    if name == "all_to_all_single":
        return jdist.all_to_all_single(None, xp.stack(pieces))
    if name == "send_recv":  # a ring: to the next rank, from the previous one
        work = jdist.isend(x, dst=(rank + 1) % N)
        _, got = jdist.recv(xp.zeros_like(x), src=(rank - 1) % N)
        work.wait()
        return got
    return jdist.reduce_scatter_tensor(None, xp.stack(pieces))


def _reference(name, rank, shape, dtype):
    xs = [_input(r, shape, dtype) for r in range(N)]
    pieces = [[_input(r, shape, dtype, slot=1 + i) for i in range(N)] for r in range(N)]
    total = np.sum(xs, axis=0, dtype=dtype)
    return {
        "all_reduce": total,
        "broadcast": xs[0],
        "reduce": total if rank == 0 else xs[rank],
        "all_gather": xs,
        "all_gather_into_tensor": np.concatenate(xs) if shape else np.stack(xs),
        "gather": xs if rank == 0 else None,
        "scatter": pieces[0][rank],
        "reduce_scatter": np.sum([p[rank] for p in pieces], axis=0, dtype=dtype),
        "reduce_scatter_tensor": np.sum([p[rank] for p in pieces], axis=0,
                                        dtype=dtype)[None],
        "all_to_all": [pieces[j][rank] for j in range(N)],
        "all_to_all_single": np.stack([pieces[j][rank] for j in range(N)]),
        "send_recv": xs[(rank - 1) % N],
    }[name]


def _describe(v, jax):
    if v is None or isinstance(v, list):
        return None if v is None else [_describe(e, jax) for e in v]
    if isinstance(v, jax.Array):
        kind, committed = "jax", v.committed
    else:
        kind, committed = "numpy" if isinstance(v, np.ndarray) else type(v).__name__, None
    return kind, tuple(v.shape), str(v.dtype), np.asarray(v), committed


def child():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdist

    jdist.init_process_group(timeout=60)
    rank, g = jdist.get_rank(), jdist.get_default_group()
    out = {}
    for name, kind, shape, dtype in itertools.product(COLLECTIVES, ("numpy", "jax"), SHAPES,
                                                      DTYPES):
        xp = np if kind == "numpy" else jnp
        out[name, kind, shape, dtype] = _describe(
            _call(jdist, name, rank, shape, dtype, xp), jax)
    # the Horovod sequence: broadcast, then place on the group's mesh, replicated
    b = jdist.broadcast(jnp.arange(4.0) + rank, src=0)
    placed = jax.device_put(b, NamedSharding(g.mesh, P()))
    out["placed"] = (np.asarray(placed.addressable_data(0)), placed.is_fully_replicated)
    committed = jax.device_put(jnp.arange(4.0), jax.local_devices()[0])
    out["committed"] = jdist.all_reduce(committed).committed
    out["coalesced"] = _coalesced(jdist, jax, jnp, rank)
    jdist.destroy_process_group()
    return out


def _tree(rank, jnp):
    return {"w": jnp.full((2, 3), rank + 1.0), "i": np.arange(4, dtype=np.int32) * (rank + 1),
            "s": np.float32(rank), "n": rank + 7, "e": np.zeros((0,), np.float16),
            "b": np.array([rank == 0, True]),
            "h": jnp.asarray(np.full(3, rank + 2.0)).astype("bfloat16"),
            "k": jax_key(rank)}


def jax_key(rank):
    import jax
    return jax.random.key(rank)


def _coalesced(jdist, jax, jnp, rank):
    """Multi-array eager collectives: one round trip (per dtype for reductions)."""
    from jdist.collectives._engine import stats

    g, out = jdist.get_default_group(), {}

    def counted(name, fn):
        before = stats(g)["calls"]
        value = fn()
        out[name + "_calls"] = stats(g)["calls"] - before
        return value

    tree = _tree(rank, jnp)
    b = counted("bcast", lambda: jdist.collectives.broadcast_coalesced(tree, src=1))
    out["bcast"] = {k: (type(v).__name__, np.asarray(jax.random.key_data(v) if k == "k"
                                                        else v).tolist())
                    for k, v in b.items()}
    out["bcast_committed"] = b["w"].committed
    nokey = {k: v for k, v in tree.items() if k not in ("k", "b")}
    r = counted("reduce", lambda: jdist.collectives.all_reduce_coalesced(nokey))
    out["reduce"] = {k: (type(v).__name__, np.asarray(v).tolist()) for k, v in r.items()}
    counted("gather_object", lambda: jdist.all_gather_object(None, {"r": rank}))
    counted("bcast_object", lambda: jdist.broadcast_object_list([rank, "x"], src=0))
    try:
        jdist.collectives.broadcast_coalesced({"a": np.zeros((2, 3), np.float32)}
                                              if rank else {"a": np.zeros((3, 2), np.float32)})
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def _check_coalesced(out, rank):
    src = _tree(1, np)
    assert out["bcast_calls"] == 1 and out["bcast_committed"] is False
    got = out["bcast"]
    assert got["w"] == ("ArrayImpl", np.full((2, 3), 2.0).tolist())
    assert got["i"] == ("ndarray", src["i"].tolist()) and got["n"] == ("int", 8)
    assert got["s"] == ("ndarray", 1.0) and got["e"] == ("ndarray", [])
    assert got["b"] == ("ndarray", [False, True]) and got["h"][1] == [3.0] * 3
    assert got["k"][1] == np.asarray(jax_key_data(1)).tolist()
    assert out["reduce_calls"] == 4  # float32, int32, int64 (a Python int), bfloat16
    trees = [_tree(r, np) for r in range(N)]
    for k in ("i", "s", "n"):
        assert out["reduce"][k][1] == np.sum([t[k] for t in trees], axis=0).tolist(), k
    assert out["reduce"]["n"][0] == "int"
    assert out["gather_object_calls"] == 2 and out["bcast_object_calls"] == 2
    if rank == 1:  # the receiver finds it (the bytes have the same length)
        assert "differs from the source's" in out["mismatch"]


def jax_key_data(rank):
    import jax
    return jax.random.key_data(jax.random.key(rank))


def _check(got, want, kind, what):
    if want is None or isinstance(want, list):
        assert (got is None) == (want is None), what
        if want is not None:
            assert len(got) == len(want), what
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                _check(a, b, kind, f"{what}[{i}]")
        return
    module, shape, dtype, value, committed = got
    assert module == ("numpy" if kind == "numpy" else "jax"), (what, module)
    assert shape == want.shape and dtype == str(want.dtype), (what, shape, dtype, want.shape)
    np.testing.assert_array_equal(value, want, err_msg=what)
    assert committed in ((None,) if kind == "numpy" else (False,)), (what, committed)


def test_eager_results_keep_kind_shape_and_are_placeable():
    res = run_procs(child, N, timeout=300)
    for rank, out in enumerate(res):
        for key in itertools.product(COLLECTIVES, ("numpy", "jax"), SHAPES, DTYPES):
            name, kind, shape, dtype = key
            want = _reference(name, rank, shape, dtype)
            _check(out[key], want, kind, f"rank {rank} {key}")
        np.testing.assert_array_equal(out["placed"][0], np.arange(4.0))
        assert out["placed"][1]
        assert out["committed"] is True
        _check_coalesced(out["coalesced"], rank)
