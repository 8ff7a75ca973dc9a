"""The packing of a rank's pieces into one buffer per dtype, and the reuse of buffers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.checkpoint import CheckpointManager, _pack

_shapes = st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(shapes=_shapes, dtypes=st.lists(st.sampled_from(["float32", "int32", "uint8"]),
                                       min_size=6, max_size=6))
def test_pieces_come_back_out_of_their_buffers(shapes, dtypes):
    rng = np.random.default_rng(0)
    pairs = zip(shapes, dtypes[:len(shapes)], strict=True)
    pieces = [(rng.normal(size=s) * 50).astype(d) for s, d in pairs]
    buffers, places = _pack.pack(pieces)
    assert sorted(buffers) == sorted({f"{p.dtype.name}_buffer" for p in pieces})
    for p, (name, offset, shape) in zip(pieces, places, strict=True):
        out = _pack.piece_of(buffers[name], offset, shape)
        assert out.dtype == p.dtype
        np.testing.assert_array_equal(out, p)
        assert not np.shares_memory(out, buffers[name])


def test_a_spare_buffer_of_the_same_layout_is_filled_again():
    a, b = np.arange(6, dtype=np.float32), np.arange(3, dtype=np.int32)
    first, _ = _pack.pack([a, b])
    again, places = _pack.pack([a + 1, b + 1], spare=first)
    assert again["float32_buffer"] is first["float32_buffer"]
    np.testing.assert_array_equal(again["float32_buffer"], a + 1)
    np.testing.assert_array_equal(again["int32_buffer"], b + 1)
    # another size or dtype: a new buffer, and the spare is left as it was
    other, _ = _pack.pack([np.arange(7, dtype=np.float32)], spare=again)
    assert other["float32_buffer"] is not again["float32_buffer"]
    np.testing.assert_array_equal(again["float32_buffer"], a + 1)


@pytest.mark.parametrize("async_save", [True, False])
def test_every_kept_step_holds_its_own_values_when_buffers_are_reused(tmp_path, async_save):
    """Saves one after another reuse the last finished write's buffers: each step must
    still read back the values it was saved with, not a later step's."""
    w = np.zeros((64, 8), np.float32)
    with CheckpointManager(tmp_path, max_to_keep=4, async_save=async_save) as m:
        for step in range(1, 7):
            w = w + step
            m.save(step, {"p": {"w": w}, "step": step})
            w = w * 1.0  # the caller's array is not the buffer
    expect = np.zeros((64, 8), np.float32)
    values = {}
    for step in range(1, 7):
        expect = expect + step
        values[step] = expect
    with CheckpointManager(tmp_path) as m:
        assert m.all_steps() == [3, 4, 5, 6]
        for step in (6, 5, 4, 3):  # newest first: restoring a step drops newer ones
            out = m.restore({"p": {"w": np.zeros((64, 8), np.float32)}, "step": 0}, step=step)
            assert out["step"] == step
            np.testing.assert_array_equal(out["p"]["w"], values[step])


def test_an_async_save_keeps_the_values_of_save_time(tmp_path, monkeypatch):
    """The writer packs the pieces after save() returned: a jax array donated to the
    next step and a numpy array changed in place must still be saved as they were."""
    import threading

    import jax
    import jax.numpy as jnp

    started = threading.Event()
    real_pack = _pack.pack

    def slow_pack(pieces, spare=None):  # the writer packs only after the loop went on
        started.wait(30)
        return real_pack(pieces, spare)

    monkeypatch.setattr(_pack, "pack", slow_pack)
    w = jnp.arange(4096, dtype=jnp.float32)
    host = np.arange(16, dtype=np.int64)
    with CheckpointManager(tmp_path, async_save=True) as m:
        m.save(1, {"p": {"w": w, "host": host}})
        donate = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)
        out = donate(w)
        junk = [jnp.full((4096,), 7.0) for _ in range(8)]  # reuse of freed memory
        host[:] = -5
        jax.block_until_ready((out, junk))
        started.set()
    monkeypatch.setattr(_pack, "pack", real_pack)
    with CheckpointManager(tmp_path) as m:
        got = m.restore({"p": {"w": np.zeros(4096, np.float32),
                               "host": np.zeros(16, np.int64)}})
    np.testing.assert_array_equal(got["p"]["w"], np.arange(4096, dtype=np.float32))
    np.testing.assert_array_equal(got["p"]["host"], np.arange(16))
