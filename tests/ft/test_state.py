"""``jdist.ft._state``: a pytree's leaves as frames and back (healing's payload), and
every difference from the receiver's own tree refused with an FtError naming the leaf."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.errors import FtError
from jdist.ft._state import pack, to_numpy, unpack


def _wire(frames) -> list[bytearray]:
    """The frames as the mailbox hands them over: one bytearray each."""
    return [bytearray(f) if isinstance(f, bytes) else bytearray(np.asarray(f).tobytes())
            for f in frames]


def _tree(seed: int):
    rng = np.random.default_rng(seed)
    return {
        "np": {
            "f32": rng.standard_normal((2, 3)).astype(np.float32),
            "f64_0d": np.asarray(rng.standard_normal()),
            "f16": rng.standard_normal(5).astype(np.float16),
            "i8": rng.integers(-128, 127, 4).astype(np.int8),
            "u16": rng.integers(0, 65535, (3, 1)).astype(np.uint16),
            "i64_0d": np.asarray(rng.integers(-(2**62), 2**62), np.int64),
            "bool": rng.integers(0, 2, 6).astype(bool),
            "c64": (rng.standard_normal(2) + 1j * rng.standard_normal(2)).astype(np.complex64),
            "empty": np.zeros((0, 3), np.float32),
        },
        "jax": {
            "f32": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32),
            "i32": jnp.asarray(rng.integers(-1000, 1000, 3), jnp.int32),
            "f32_0d": jnp.asarray(rng.standard_normal(), jnp.float32),
            "u8": jnp.asarray(rng.integers(0, 255, 7), jnp.uint8),
        },
        "step": int(rng.integers(0, 10**6)),
        "neg": -int(rng.integers(1, 10**6)),
        "key": jax.random.key(seed),
        "keys": jax.random.split(jax.random.key(seed + 100), 3),
        "list": [np.asarray([seed], np.int32), (jnp.asarray([float(seed)]),)],
    }


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _check_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if _is_key(w):
            assert _is_key(g) and isinstance(g, jax.Array)
            assert g.shape == w.shape
            assert jax.random.key_impl(g) == jax.random.key_impl(w)
            np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))
        elif isinstance(w, jax.Array):
            assert isinstance(g, jax.Array)
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.sharding == w.sharding
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        elif isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray)
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        else:  # a python scalar comes back as a 0-d numpy array of the same value
            assert np.shape(g) == () and g == w and int(g) == w


@pytest.mark.parametrize("as_wire", [True, False], ids=["bytearrays", "pack-output"])
def test_round_trip(as_wire):
    sent, mine = _tree(1), _tree(2)
    frames = pack(sent)
    assert isinstance(frames[0], bytes)
    header = json.loads(frames[0])  # a JSON header, one entry per leaf
    assert len(header) == len(frames) - 1 == len(jax.tree.leaves(sent))
    got = unpack(_wire(frames) if as_wire else frames, mine, "replica 1")
    _check_equal(got, sent)


def test_round_trip_copies_out_of_the_frames():
    sent = {"a": np.arange(6, dtype=np.float32), "b": np.asarray(3, np.int64)}
    frames = _wire(pack(sent))
    got = unpack(frames, {"a": np.zeros(6, np.float32), "b": np.asarray(0, np.int64)}, "x")
    for f in frames[1:]:
        f[:] = b"\xff" * len(f)  # the mailbox's buffers may be reused: the state is not
    np.testing.assert_array_equal(got["a"], np.arange(6, dtype=np.float32))
    assert int(got["b"]) == 3
    got["a"][0] = 7.0  # and the loaded numpy leaves are writable


def test_healed_keys_draw_the_same_numbers():
    sent = {"key": jax.random.key(7), "keys": jax.random.split(jax.random.key(8), 2)}
    like = {"key": jax.random.key(0), "keys": jax.random.split(jax.random.key(0), 2)}
    got = unpack(_wire(pack(sent)), like, "replica 0")
    np.testing.assert_array_equal(jax.random.normal(got["key"], (3,)),
                                  jax.random.normal(sent["key"], (3,)))
    np.testing.assert_array_equal(jax.random.bits(got["keys"][1]),
                                  jax.random.bits(sent["keys"][1]))


def test_to_numpy_is_contiguous_and_keeps_0d():
    assert to_numpy(np.asarray(2.0)).shape == ()
    t = np.arange(12).reshape(3, 4).T
    out = to_numpy(t)
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, t)
    np.testing.assert_array_equal(to_numpy(jax.random.key(3)),
                                  jax.random.key_data(jax.random.key(3)))


def _leaf_index(tree, path_suffix: str) -> int:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return next(i for i, p in enumerate(paths) if p.endswith(path_suffix))


def _replace(tree, group: str, name: str, value):
    tree[group] = {**tree[group], name: value}
    return tree


@pytest.mark.parametrize("group,name,value", [
    ("np", "f32", np.zeros((3, 2), np.float32)),  # shape
    ("np", "f32", np.zeros((2, 3), np.float64)),  # dtype
    ("np", "f64_0d", np.zeros((1,), np.float64)),  # 0-d vs 1-d
    ("np", "i8", np.zeros(4, np.uint8)),  # same size, other dtype
    ("jax", "i32", jnp.zeros(3, jnp.float32)),  # dtype, same bytes per element
    ("jax", "u8", jnp.zeros(6, jnp.uint8)),  # shape
])
def test_mismatched_leaf_raises_naming_it(group, name, value):
    sent = _tree(1)
    like = _replace(_tree(2), group, name, value)
    i = _leaf_index(like, f"['{group}']['{name}']")
    with pytest.raises(FtError) as info:
        unpack(_wire(pack(sent)), like, "replica 3")
    text = str(info.value)
    assert f"leaf {i} " in text and "replica 3" in text
    assert str(list(value.shape)) in text


@pytest.mark.parametrize("extra", ["sender", "receiver"])
def test_mismatched_leaf_count_raises(extra):
    a, b = _tree(1), _tree(2)
    (a if extra == "sender" else b)["more"] = np.zeros(2, np.float32)
    n_sent, n_mine = len(jax.tree.leaves(a)), len(jax.tree.leaves(b))
    with pytest.raises(FtError) as info:
        unpack(_wire(pack(a)), b, "replica 5")
    text = str(info.value)
    assert "replica 5" in text and f"{n_sent} leaves" in text and str(n_mine) in text


def test_missing_frame_raises():
    sent = _tree(1)
    frames = _wire(pack(sent))
    with pytest.raises(FtError):
        unpack(frames[:-1], _tree(2), "replica 1")


def test_round_trip_bfloat16():
    sent = {"w": jnp.arange(4, dtype=jnp.bfloat16), "v": np.ones(2, jnp.bfloat16)}
    like = {"w": jnp.zeros(4, jnp.bfloat16), "v": np.zeros(2, jnp.bfloat16)}
    _check_equal(unpack(_wire(pack(sent)), like, "replica 0"), sent)


@pytest.mark.parametrize("sender_has_key", [True, False])
def test_key_versus_raw_key_data_raises(sender_has_key):
    key = jax.random.key(0)
    raw = jnp.zeros(jax.random.key_data(key).shape, jnp.uint32)
    sent, like = ({"k": key}, {"k": raw}) if sender_has_key else ({"k": raw}, {"k": key})
    with pytest.raises(FtError):
        unpack(_wire(pack(sent)), like, "replica 0")
