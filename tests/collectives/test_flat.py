"""``all_reduce_flat``: one collective per dtype, bit-identical to the per-leaf form.

The grid: every ReduceOp x a tree holding every dtype the op accepts (several leaves per
dtype, 0-d, empty and odd shapes, -0.0 and infinities), reduced over 8 replicas in both
forms and compared bit for bit, and against a numpy reduction of the replicas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jdist.collectives import ReduceOp, all_reduce_flat, prefers_flat
from jdist.collectives._group import make_mesh
from jdist.ddp.hooks import comm_report

N = 8
FLOATS = ("float32", "float16", "bfloat16")
INTS = ("int8", "int16", "int32", "uint8", "uint32")
SHAPES = ((3, 4), (), (0,))


def _dtypes(op):
    if op is ReduceOp.AVG:
        return (*FLOATS, "complex64")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return (*INTS, "bool")
    out = (*FLOATS, *INTS, "bool")
    return (*out, "complex64") if op is ReduceOp.SUM else out


def _values(dtype, shape, rng):
    full = (N, *shape)
    if dtype == "bool":
        return rng.random(full) < 0.5
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -50), min(info.max, 50), full).astype(dtype)
    if dtype == "complex64":
        return (rng.standard_normal(full) + 1j * rng.standard_normal(full)).astype(dtype)
    x = rng.standard_normal(full).astype(np.float32) * 3
    if x.size:
        x.flat[0], x.flat[-1] = -0.0, np.inf
    return np.asarray(jnp.asarray(x, dtype))


def _tree(op):
    rng = np.random.default_rng(sum(map(ord, op.name)))
    return {f"{dt}_{i}": _values(dt, shape, rng)
            for dt in _dtypes(op) for i, shape in enumerate(SHAPES)}


def _reduce(op, flat):
    mesh = make_mesh(jax.devices()[:N], "dp")

    def body(t):
        return jax.tree.map(lambda y: y[None],
                            all_reduce_flat(jax.tree.map(lambda y: y[0], t), op, "dp",
                                            flat=flat))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"),
                                 check_vma=False))


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.kind in "fcV" or x.dtype.itemsize == 2 else x


def _numpy_ref(op, x):
    x = np.asarray(x)
    if op is ReduceOp.SUM:
        if x.dtype == bool:
            return np.any(x, 0)
        return x.sum(0, dtype=x.dtype) if x.dtype.kind in "iu" else x.astype(np.float64).sum(0)
    if op is ReduceOp.MAX:
        return x.max(0)
    if op is ReduceOp.MIN:
        return x.min(0)
    return x.astype(np.float64).mean(0)  # AVG (floats only)


OPS = list(ReduceOp)


@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_flat_is_bit_identical_to_per_leaf(op):
    tree = _tree(op)
    flat, per_leaf = _reduce(op, True)(tree), _reduce(op, False)(tree)
    for k in tree:
        a, b = np.asarray(flat[k]), np.asarray(per_leaf[k])
        assert a.dtype == b.dtype == tree[k].dtype and a.shape == b.shape == tree[k].shape, k
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{op.name} {k}")
        if op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG) and (
                "complex" not in k and a.size):
            want = _numpy_ref(op, tree[k])
            low = np.asarray(tree[k]).dtype.itemsize == 2 and "int" not in k
            tol = 0 if op in (ReduceOp.MIN, ReduceOp.MAX) else (0.25 if low else 1e-4)
            np.testing.assert_allclose(a[0].astype(np.float64), np.asarray(want, np.float64),
                                       rtol=tol, atol=tol, err_msg=f"{op.name} {k}")


def test_flat_makes_one_all_reduce_per_dtype():
    tree = {"a": np.ones((N, 3, 4), np.float32), "b": np.ones((N, 7), np.float32),
            "c": np.ones((N,), np.float32), "i": np.ones((N, 2), np.int32),
            "j": np.ones((N, 5), np.int32), "e": np.ones((N, 0), np.float32)}
    lowered = _reduce(ReduceOp.SUM, True).lower(tree)
    ars = [(c.dtype, c.elements) for c in comm_report(lowered).collectives]
    assert sorted(ars) == [("f32", 20), ("s32", 7)]
    per_leaf = comm_report(_reduce(ReduceOp.SUM, False).lower(tree)).collectives
    assert len(per_leaf) == 6  # one per leaf before XLA's combiner


def test_backend_choice_matches_ddp_flat_buckets():
    assert prefers_flat("cpu", 2) and not prefers_flat("cpu", 1)
    assert not prefers_flat("gpu", 2)
    assert prefers_flat() == (jax.default_backend() == "cpu" and jax.process_count() > 1)


def test_bad_dtype_raises_like_all_reduce():
    mesh = make_mesh(jax.devices()[:N], "dp")
    for flat in (True, False):
        f = jax.shard_map(lambda t, fl=flat: all_reduce_flat(t, ReduceOp.AVG, "dp", flat=fl),
                          mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=False)
        with pytest.raises(TypeError, match="int32"):
            jax.jit(f)({"a": np.ones((N, 2), np.int32), "b": np.ones((N, 2), np.int32)})
