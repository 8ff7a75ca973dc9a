"""scatter / scatter_kwargs / gather: torch.chunk sizes, pytrees, traps (torch as oracle)."""

import dataclasses
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jdist.dp import chunk_sizes, gather, scatter, scatter_kwargs
from jdist.dp._scatter_gather import SCALAR_WARNING

DEVS = jax.devices()


class Pair(NamedTuple):
    a: object
    b: object


@dataclasses.dataclass
class Batch:
    x: object
    tag: str = "t"


def test_chunk_sizes_match_torch_chunk_for_every_batch_and_device_count():
    for n in range(0, 41):
        for d in range(1, 9):
            want = tuple(c.shape[0] for c in torch.zeros(n).chunk(d))
            assert chunk_sizes(n, d) == want, (n, d)


@pytest.mark.parametrize("n,d,dim", [(10, 4, 0), (5, 4, 0), (3, 4, 0), (10, 8, 0), (16, 8, 0),
                                     (7, 3, 1)])
def test_scatter_values_and_devices_match_torch_chunk(n, d, dim):
    data = np.arange(n * 6, dtype=np.float32).reshape((n, 6) if dim == 0 else (6, n))
    want = [c.numpy() for c in torch.from_numpy(data).chunk(d, dim)]
    for src in (data, jnp.asarray(data)):
        parts = scatter(src, DEVS[:d], dim)
        assert len(parts) == len(want)
        for i, (p, w) in enumerate(zip(parts, want, strict=True)):
            assert p.devices() == {DEVS[i]}
            np.testing.assert_array_equal(np.asarray(p), w)


def test_scatter_recurses_into_containers_and_repeats_other_objects():
    x = jnp.arange(10.0)
    marker = object()
    tree = (x, [x, marker], {"k": x, "s": "str"}, Pair(x, 3), Batch(x), (), None)
    parts = scatter(tree, [0, 1, 2, 3])
    assert len(parts) == 4
    for i, p in enumerate(parts):
        lo, hi = 3 * i, min(10, 3 * i + 3)
        assert isinstance(p, tuple) and isinstance(p[1], list) and isinstance(p[3], Pair)
        assert isinstance(p[4], Batch) and p[4].tag == "t"
        for arr in (p[0], p[1][0], p[2]["k"], p[3].a, p[4].x):
            np.testing.assert_array_equal(arr, np.arange(lo, hi, dtype=np.float32))
            assert arr.devices() == {DEVS[i]}
        assert p[1][1] is marker and p[2]["s"] == "str" and p[3].b == 3
        assert p[5] == () and p[6] is None


def test_scatter_without_arrays_gives_one_replica_per_device():
    assert scatter(("a", 1), DEVS[:5]) == [("a", 1)] * 5


def test_scatter_mismatched_batch_sizes_raise_quoting_sizes():
    # torch zips 3 chunks with 2 chunks here and silently drops sample 4
    with pytest.raises(ValueError, match=r"different sizes along dim 0.*5.*2"):
        scatter((jnp.ones(5), jnp.ones(2)), DEVS[:4])
    with pytest.raises(ValueError, match="'y'"):
        scatter_kwargs((jnp.ones(5),), {"y": jnp.ones(4)}, DEVS[:4])
    with pytest.raises(ValueError, match="no dimension 0"):
        scatter(jnp.float32(1.0), DEVS[:2])


def test_scatter_kwargs_gives_equal_length_tuples():
    ins, kws = scatter_kwargs((jnp.ones((5, 2)), "s"), {"y": jnp.arange(5)}, DEVS[:4])
    assert len(ins) == len(kws) == 3
    assert [i[0].shape[0] for i in ins] == [2, 2, 1] and all(i[1] == "s" for i in ins)
    np.testing.assert_array_equal(kws[2]["y"], [4])
    ins, kws = scatter_kwargs((), {"y": jnp.arange(5)}, DEVS[:4])
    assert ins == ((), (), ()) and len(kws) == 3


def test_gather_concatenates_on_target_device_and_cpu():
    parts = scatter(jnp.arange(20.0).reshape(10, 2), DEVS[:4])
    out = gather(parts, DEVS[2])
    assert out.devices() == {DEVS[2]}
    np.testing.assert_array_equal(out, np.arange(20.0).reshape(10, 2))
    out = gather(parts, "cpu")
    assert out.devices() == {jax.devices("cpu")[0]}
    cols = scatter(jnp.arange(20.0).reshape(2, 10), DEVS[:3], dim=1)
    np.testing.assert_array_equal(gather(cols, 0, dim=1), np.arange(20.0).reshape(2, 10))


def test_gather_structures_none_and_objects():
    outs = [{"y": jnp.ones((2, 1)) * i, "n": None, "p": Pair(jnp.ones(2) * i, "s")}
            for i in range(3)]
    g = gather(outs, 0)
    np.testing.assert_array_equal(g["y"][:, 0], [0, 0, 1, 1, 2, 2])
    assert g["n"] is None and isinstance(g["p"], Pair)
    np.testing.assert_array_equal(g["p"].a, [0, 0, 1, 1, 2, 2])
    assert g["p"].b == ["s", "s", "s"]  # torch returns a map object here
    assert gather(["a", "b"], 0) == ["a", "b"]
    assert gather([1, 2], 0) == [1, 2]  # torch: TypeError: 'int' object is not iterable


def test_gather_scalars_become_vector_with_torch_warning():
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)):
        v = gather([jnp.float32(i) for i in range(3)], 0)
    np.testing.assert_array_equal(v, [0, 1, 2])
    assert SCALAR_WARNING == ("Was asked to gather along dimension 0, but all input tensors "
                              "were scalars; will instead unsqueeze and return a vector.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="dim 1"):
            gather([jnp.float32(1), jnp.float32(2)], 0, dim=1)


def test_gather_dict_key_mismatch_raises_torch_error():
    with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
        gather([{"a": jnp.ones(1)}, {"a": jnp.ones(1), "b": jnp.ones(1)}], 0)
    with pytest.raises(ValueError, match=r"All dicts must have the same number of keys.*'b'"):
        gather([{"a": jnp.ones(1)}, {"b": jnp.ones(1)}], 0)


def test_scatter_then_gather_is_differentiable():
    x = jnp.arange(10.0)

    def f(x):
        parts = scatter(x, DEVS[:4])
        return jnp.sum(gather([p * (i + 1) for i, p in enumerate(parts)], 0) ** 2)

    want = jax.grad(lambda x: jnp.sum((x * jnp.repeat(jnp.arange(1.0, 5.0),
                                                      np.array([3, 3, 3, 1]))) ** 2))(x)
    np.testing.assert_allclose(jax.grad(f)(x), want, rtol=1e-6)
