"""In-graph collectives (jdist.collectives.functional) on 8 virtual devices against numpy.

Each test runs a function on every replica's slice of a global array (leading axis =
replica) inside ``jax.shard_map`` and compares every replica's output with a numpy
reference. Several ops share one compiled program to keep the suite fast; assertion
messages name the op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jdist.collectives import ReduceOp
from jdist.collectives import functional as F
from jdist.collectives._group import local_group

N = 8
OPS = list(ReduceOp)
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def valid_ops(dtype):
    if dtype == np.float32:
        return [op for op in OPS if op not in BITWISE]
    if dtype == np.int32:
        return [op for op in OPS if op is not ReduceOp.AVG]
    return [op for op in OPS if op is not ReduceOp.AVG]  # bool


def np_reduce(g, op, axis=0):
    """numpy reference of torch's ReduceOp over the replica axis (dtype kept)."""
    if g.dtype == np.bool_:
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return g.any(axis)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return g.all(axis)
        return g.sum(axis) % 2 == 1
    return {
        ReduceOp.SUM: lambda: g.sum(axis, dtype=g.dtype),
        ReduceOp.AVG: lambda: g.mean(axis, dtype=g.dtype),
        ReduceOp.PRODUCT: lambda: g.prod(axis, dtype=g.dtype),
        ReduceOp.MIN: lambda: g.min(axis),
        ReduceOp.MAX: lambda: g.max(axis),
        ReduceOp.BAND: lambda: np.bitwise_and.reduce(g, axis),
        ReduceOp.BOR: lambda: np.bitwise_or.reduce(g, axis),
        ReduceOp.BXOR: lambda: np.bitwise_xor.reduce(g, axis),
    }[op]()


def data(dtype, shape=(N, 3, 4), seed=0):
    rng = np.random.RandomState(seed)
    if dtype == np.float32:
        return (rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)).astype(np.float32)
    if dtype == np.int32:
        return rng.randint(-3, 4, shape).astype(np.int32)
    return rng.rand(*shape) < 0.7


def per_replica(fn, *xs, mesh, check_vma=True, axis="dp", out_specs=None):
    """Run ``fn`` on each replica's slice; returns the outputs stacked per replica."""
    def body(*blocks):
        out = fn(*[b[0] for b in blocks])
        return jax.tree.map(lambda o: o[None], out)

    out_specs = P(axis) if out_specs is None else out_specs
    f = jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=out_specs,
                      check_vma=check_vma)
    return jax.tree.map(np.asarray, jax.block_until_ready(jax.jit(f)(*xs)))


def assert_each_replica(out, ref, msg, exact):
    for r in range(out.shape[0]):
        if exact:
            np.testing.assert_array_equal(out[r], ref, err_msg=f"{msg}, replica {r}")
        else:
            np.testing.assert_allclose(out[r], ref, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{msg}, replica {r}")


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_all_reduce_every_op_matches_numpy(mesh8, dtype, check_vma):
    x = data(dtype)
    ops = valid_ops(dtype)
    out = per_replica(lambda v: {op.name: F.all_reduce(v, op, "dp") for op in ops}, x,
                      mesh=mesh8, check_vma=check_vma)
    for op in ops:
        assert out[op.name].dtype == x.dtype, op
        exact = dtype != np.float32 or op in (ReduceOp.MIN, ReduceOp.MAX)
        assert_each_replica(out[op.name], np_reduce(x, op), f"all_reduce {op!r} {dtype}",
                            exact)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_all_reduce_and_broadcast_are_invariant_under_check_vma(mesh8, dtype):
    """Results equal on every replica may leave shard_map with out_specs=P()."""
    x = data(dtype)
    ops = valid_ops(dtype)

    def fn(v):
        res = {op.name: F.all_reduce(v, op) for op in ops}
        res["bcast"] = F.broadcast(v, 6)
        res["gather"] = F.all_gather(v)
        return res

    out = per_replica(fn, x, mesh=mesh8, check_vma=True, out_specs=P())
    for op in ops:
        exact = dtype != np.float32 or op in (ReduceOp.MIN, ReduceOp.MAX)
        assert_each_replica(out[op.name], np_reduce(x, op), f"{op!r}", exact)
    np.testing.assert_array_equal(out["bcast"][0], x[6])
    np.testing.assert_array_equal(out["gather"][0], x)


def test_bad_dtype_for_op_raises_naming_dtype(mesh8):
    for op, dtype in [(ReduceOp.BAND, np.float32), (ReduceOp.BXOR, np.float32),
                      (ReduceOp.AVG, np.bool_), (ReduceOp.AVG, np.int32)]:
        with pytest.raises(TypeError, match=np.dtype(dtype).name):
            per_replica(lambda v, op=op: F.all_reduce(v, op), data(dtype), mesh=mesh8)
    with pytest.raises(TypeError, match="float32"):
        per_replica(lambda v: F.reduce_scatter(v, ReduceOp.BOR), data(np.float32),
                    mesh=mesh8)
    with pytest.raises(TypeError, match="ReduceOp"):
        per_replica(lambda v: F.all_reduce(v, "sum"), data(np.float32), mesh=mesh8)


def test_pytree_and_group_forms(mesh8):
    """Pytrees, and group given as None, a ProcessGroup, a str and a 1-tuple."""
    xf, xi = data(np.float32), data(np.int32)

    def fn(a, b):
        tree = {"w": a, "stats": (b, a[0])}
        return {
            "none": F.all_reduce(tree),
            "pg": F.all_reduce(tree, ReduceOp.MAX, local_group()),
            "tuple": F.all_reduce(tree, ReduceOp.MIN, ("dp",)),
            "bcast": F.broadcast(tree, 2, "dp"),
        }

    out = per_replica(fn, xf, xi, mesh=mesh8)
    for key, op in [("none", ReduceOp.SUM), ("pg", ReduceOp.MAX), ("tuple", ReduceOp.MIN)]:
        exact = op is not ReduceOp.SUM
        assert_each_replica(out[key]["w"], np_reduce(xf, op), key, exact)
        assert_each_replica(out[key]["stats"][0], np_reduce(xi, op), key, True)
        assert_each_replica(out[key]["stats"][1], np_reduce(xf[:, 0], op), key, exact)
    np.testing.assert_array_equal(out["bcast"]["stats"][0],
                                  np.broadcast_to(xi[2], xi.shape))


@pytest.mark.parametrize("check_vma", [True, False])
def test_broadcast_is_bit_exact_for_every_src(mesh8, check_vma):
    xf = data(np.float32)
    xf[3, 0, 0], xf[3, 0, 1], xf[3, 0, 2] = -0.0, np.nan, np.inf
    xi, xb = data(np.int32), data(np.bool_)
    xh = xf.astype(np.float16)

    out = per_replica(lambda a, b, c, d: [F.broadcast((a, b, c, d), s) for s in range(N)],
                      xf, xi, xb, xh, mesh=mesh8, check_vma=check_vma)
    for src in range(N):
        for got, x in zip(out[src], (xf, xi, xb, xh), strict=True):
            for r in range(N):
                assert got[r].dtype == x.dtype
                # compare bits, so that -0.0 and NaN count
                view = np.uint8 if x.dtype == np.bool_ else f"u{x.dtype.itemsize}"
                np.testing.assert_array_equal(got[r].view(view), x[src].view(view),
                                              err_msg=f"src {src} replica {r}")


def test_reduce_gives_dst_the_result_and_others_their_input(mesh8):
    cases = [(np.float32, ReduceOp.SUM), (np.float32, ReduceOp.PRODUCT),
             (np.int32, ReduceOp.BXOR), (np.bool_, ReduceOp.MIN)]
    xs = [data(dt, seed=i) for i, (dt, _) in enumerate(cases)]

    def fn(*vs):
        return [F.reduce(v, 5, op) for v, (_, op) in zip(vs, cases, strict=True)]

    out = per_replica(fn, *xs, mesh=mesh8)
    for got, x, (_, op) in zip(out, xs, cases, strict=True):
        ref = np_reduce(x, op)
        for r in range(N):
            want = ref if r == 5 else x[r]
            np.testing.assert_allclose(got[r], want, rtol=1e-6, err_msg=f"{op!r} replica {r}")


def test_all_gather_stacked_and_tiled(mesh8):
    x = data(np.float32)

    def fn(v):
        return {
            "stack0": F.all_gather(v),
            "stack2": F.all_gather(v, axis=2),
            "tiled0": F.all_gather(v, tiled=True),
            "tiled1": F.all_gather(v, "dp", axis=-1, tiled=True),
            "into": F.all_gather_into_tensor(v),
            "gather": F.gather(v, 3),
        }

    for check_vma in (True, False):
        out = per_replica(fn, x, mesh=mesh8, check_vma=check_vma)
        assert_each_replica(out["stack0"], x, "stack0", True)
        assert_each_replica(out["stack2"], np.stack(list(x), axis=2), "stack2", True)
        assert_each_replica(out["tiled0"], np.concatenate(list(x), 0), "tiled0", True)
        assert_each_replica(out["tiled1"], np.concatenate(list(x), -1), "tiled1", True)
        assert_each_replica(out["into"], np.concatenate(list(x), 0), "into", True)
        assert_each_replica(out["gather"], x, "gather", True)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_reduce_scatter_every_op(mesh8, dtype):
    x = data(dtype, shape=(N, 16, 3))       # tiled: dim 0 of 16 -> chunks of 2
    xn = data(dtype, shape=(N, 3, N), seed=1)  # untiled on dim 1 (== N)
    ops = valid_ops(dtype)

    def fn(v, w):
        return ({op.name: F.reduce_scatter(v, op) for op in ops},
                {op.name: F.reduce_scatter(w, op, "dp", scatter_dimension=-1, tiled=False)
                 for op in ops})

    tiled, untiled = per_replica(fn, x, xn, mesh=mesh8)
    for op in ops:
        exact = dtype != np.float32 or op in (ReduceOp.MIN, ReduceOp.MAX)
        ref, refn = np_reduce(x, op), np_reduce(xn, op)
        for r in range(N):
            for got, want in [(tiled[op.name][r], ref[2 * r:2 * r + 2]),
                              (untiled[op.name][r], refn[:, r])]:
                assert got.dtype == x.dtype
                if exact:
                    np.testing.assert_array_equal(got, want, err_msg=f"{op!r} r{r}")
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                               err_msg=f"{op!r} r{r}")


def test_scatter_all_to_all_permute_send_recv(mesh8):
    x = data(np.float32, shape=(N, 16, 2))

    def fn(v):
        return {
            "scatter": F.scatter(v, 4),
            "a2a": F.all_to_all(v),
            "a2a_untiled": F.all_to_all(v[:N], 0, 1, tiled=False),
            "ring": F.send_recv(v),
            "back2": F.send_recv(v, -2),
            "pair": F.permute(v, [(1, 6), (6, 1), (0, 3)]),
            "rs_tensor": F.reduce_scatter_tensor(v, ReduceOp.MAX),
        }

    out = per_replica(fn, x, mesh=mesh8)
    for r in range(N):
        sl = slice(2 * r, 2 * r + 2)
        np.testing.assert_array_equal(out["scatter"][r], x[4, sl])
        np.testing.assert_array_equal(out["a2a"][r], np.concatenate([x[j, sl] for j in range(N)]))
        np.testing.assert_array_equal(out["a2a_untiled"][r],
                                      np.stack([x[j, r] for j in range(N)], axis=1))
        np.testing.assert_array_equal(out["ring"][r], x[(r - 1) % N])
        np.testing.assert_array_equal(out["back2"][r], x[(r + 2) % N])
        want = {6: x[1], 1: x[6], 3: x[0]}.get(r, np.zeros_like(x[0]))
        np.testing.assert_array_equal(out["pair"][r], want)
        np.testing.assert_array_equal(out["rs_tensor"][r], x.max(0)[sl])


def test_two_d_mesh_sub_axes():
    """On a (2, 4) mesh, collectives over 'b' stay inside each row; ('a', 'b') spans all."""
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("a", "b"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    x = data(np.float32, shape=(2, 4, 3))
    xi = data(np.int32, shape=(2, 4, 3), seed=3)

    def body(v, w):
        v, w = v[0, 0], w[0, 0]
        res = {
            "sum_b": F.all_reduce(v, group="b"),
            "prod_b": F.all_reduce(v, ReduceOp.PRODUCT, "b"),
            "bxor_ab": F.all_reduce(w, ReduceOp.BXOR, ("a", "b")),
            "sum_ab": F.all_reduce(v, group=("a", "b")),
            "bcast_b": F.broadcast(v, 2, "b"),
            "bcast_ab": F.broadcast(v, 5, ("a", "b")),
            "gather_b": F.all_gather(v, "b"),
            "ring_b": F.ring_all_reduce(v, "b"),
            "ring_ab": F.ring_all_reduce(w, ("a", "b")),
            "shift_b": F.send_recv(v, 1, "b"),
        }
        return jax.tree.map(lambda o: o[None, None], res)

    for check_vma in (True, False):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"),
                                  out_specs=P("a", "b"), check_vma=check_vma))
        out = jax.tree.map(np.asarray, f(x, xi))
        flat, flati = x.reshape(8, 3), xi.reshape(8, 3)
        for a in range(2):
            for b in range(4):
                msg = f"replica ({a}, {b}), check_vma={check_vma}"
                close = lambda got, want, msg=msg: np.testing.assert_allclose(
                    got, want, rtol=1e-5, err_msg=msg)
                close(out["sum_b"][a, b], x[a].sum(0))
                close(out["prod_b"][a, b], x[a].prod(0))
                np.testing.assert_array_equal(out["bxor_ab"][a, b],
                                              np.bitwise_xor.reduce(flati, 0))
                close(out["sum_ab"][a, b], flat.sum(0))
                np.testing.assert_array_equal(out["bcast_b"][a, b], x[a, 2])
                np.testing.assert_array_equal(out["bcast_ab"][a, b], flat[5])
                np.testing.assert_array_equal(out["gather_b"][a, b], x[a])
                close(out["ring_b"][a, b], x[a].sum(0))
                np.testing.assert_array_equal(out["ring_ab"][a, b], flati.sum(0))
                np.testing.assert_array_equal(out["shift_b"][a, b], x[a, (b - 1) % 4])


@pytest.mark.parametrize("check_vma", [True, False])
def test_ring_all_reduce_equals_psum(mesh8, check_vma):
    """Sizes not divisible by 8 (15, 1, 3) and every op the ring supports."""
    xf = data(np.float32, shape=(N, 5, 3))
    xs = data(np.float32, shape=(N,))
    xi = data(np.int32, shape=(N, 3), seed=2)
    xb = data(np.bool_, shape=(N, 3), seed=4)

    def fn(f, s, i, b):
        return {
            "f_ring": F.ring_all_reduce(f, "dp"), "f_psum": jax.lax.psum(f, "dp"),
            "scalar": F.ring_all_reduce(s),
            "avg": F.ring_all_reduce(f, op=ReduceOp.AVG),
            "max": F.ring_all_reduce(f, op=ReduceOp.MAX),
            "i_sum": F.ring_all_reduce(i), "i_prod": F.ring_all_reduce(i, op=ReduceOp.PRODUCT),
            "i_bor": F.ring_all_reduce(i, op=ReduceOp.BOR),
            "b_sum": F.ring_all_reduce(b), "b_xor": F.ring_all_reduce(b, op=ReduceOp.BXOR),
        }

    out = per_replica(fn, xf, xs, xi, xb, mesh=mesh8, check_vma=check_vma)
    for r in range(N):
        np.testing.assert_allclose(out["f_ring"][r], out["f_psum"][r], rtol=1e-5, atol=1e-6)
        # every replica holds the same bits
        np.testing.assert_array_equal(out["f_ring"][r], out["f_ring"][0])
    assert_each_replica(out["scalar"], xs.sum(), "scalar", False)
    assert_each_replica(out["avg"], xf.mean(0), "avg", False)
    assert_each_replica(out["max"], xf.max(0), "max", True)
    assert_each_replica(out["i_sum"], xi.sum(0), "i_sum", True)
    assert_each_replica(out["i_prod"], xi.prod(0, dtype=np.int32), "i_prod", True)
    assert_each_replica(out["i_bor"], np.bitwise_or.reduce(xi, 0), "i_bor", True)
    assert_each_replica(out["b_sum"], xb.any(0), "b_sum", True)
    assert_each_replica(out["b_xor"], xb.sum(0) % 2 == 1, "b_xor", True)


def test_errors_name_the_bad_value_and_fix(mesh8):
    x = data(np.float32, shape=(N, 3, 2))
    run = lambda fn: per_replica(fn, x, mesh=mesh8)
    with pytest.raises(NameError, match="'tp' is not bound.*shard_map"):
        run(lambda v: F.all_reduce(v, group="tp"))
    with pytest.raises(NameError, match="not bound"):
        F.all_reduce(jnp.ones(3), group="dp")  # outside shard_map
    with pytest.raises(TypeError, match=r"tuple\(\['dp'\]\)"):
        run(lambda v: F.all_reduce(v, group=["dp"]))
    with pytest.raises(TypeError, match="axis name"):
        run(lambda v: F.all_reduce(v, group=3))
    with pytest.raises(ValueError, match="src=8 is out of range.*0 <= src < 8"):
        run(lambda v: F.broadcast(v, 8))
    with pytest.raises(TypeError, match="dst must be a Python int"):
        run(lambda v: F.reduce(v, 1.0))
    with pytest.raises(ValueError, match=r"repeats a source"):
        run(lambda v: F.permute(v, [(0, 1), (0, 2)]))
    with pytest.raises(ValueError, match=r"\(0, 9\) is out of range"):
        run(lambda v: F.permute(v, [(0, 9)]))
    with pytest.raises(ValueError, match="size 3, needs a multiple of 8"):
        run(lambda v: F.reduce_scatter(v))
    with pytest.raises(ValueError, match="needs exactly 8"):
        run(lambda v: F.reduce_scatter(v, ReduceOp.MAX, tiled=False))
    with pytest.raises(ValueError, match="not divisible by the 8 replicas"):
        run(lambda v: F.scatter(v))
    with pytest.raises(ValueError, match="split_axis 1 of shape .* multiple of the 8"):
        run(lambda v: F.all_to_all(v, 1, 0))
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        run(lambda v: F.all_gather(v, axis=3))


def test_replicated_inputs_under_check_vma(mesh8):
    """Inputs typed invariant (in_specs=P()) count once per replica, as in torch."""
    c = data(np.float32, shape=(N, 2))
    ci = data(np.int32, shape=(N, 2), seed=5)

    def body(v, w):
        res = {
            "sum": F.all_reduce(v), "prod": F.all_reduce(v, ReduceOp.PRODUCT),
            "bxor": F.all_reduce(w, ReduceOp.BXOR), "bcast": F.broadcast(v, 3),
            "reduce": F.reduce(v, 2), "gather": F.all_gather(v), "rs": F.reduce_scatter(v),
            "a2a": F.all_to_all(v), "shift": F.send_recv(v), "ring": F.ring_all_reduce(v),
        }
        return jax.tree.map(lambda o: o[None], res)

    f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P(), out_specs=P("dp"),
                              check_vma=True))
    out = jax.tree.map(np.asarray, f(c, ci))
    for r in range(N):
        np.testing.assert_allclose(out["sum"][r], N * c, rtol=1e-6)
        np.testing.assert_allclose(out["prod"][r], c ** N, rtol=1e-5)
        np.testing.assert_array_equal(out["bxor"][r], np.zeros_like(ci))  # even count
        np.testing.assert_array_equal(out["bcast"][r], c)
        np.testing.assert_allclose(out["reduce"][r], N * c if r == 2 else c, rtol=1e-6)
        np.testing.assert_array_equal(out["gather"][r], np.stack([c] * N))
        np.testing.assert_allclose(out["rs"][r], N * c[r:r + 1], rtol=1e-6)
        np.testing.assert_array_equal(out["a2a"][r], np.concatenate([c[r:r + 1]] * N))
        np.testing.assert_array_equal(out["shift"][r], c)
        np.testing.assert_allclose(out["ring"][r], N * c, rtol=1e-6)
