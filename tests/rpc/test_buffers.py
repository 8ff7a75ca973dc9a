"""Receive buffers for large frames: reused only once nothing refers to them any more."""

from __future__ import annotations

import collections
import gc
import threading

import numpy as np
import pytest

from jdist.rpc import _serialize as S
from jdist.rpc.transport import FrameDecoder, encode_prefix
from jdist.rpc.transport import _buffers as B

MIB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    monkeypatch.setattr(B, "_pool", collections.deque())


def addr(buf) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data


def test_buffer_is_writable_exact_and_pooled():
    f = B.alloc_frame(3 * MIB + 5)
    assert f.nbytes == 3 * MIB + 5 and not f.readonly and f.format == "B"
    assert B.pooled_bytes() == 4 * MIB  # rounded up to huge pages
    f[:] = b"\x07" * f.nbytes
    assert bytes(f[-3:]) == b"\x07\x07\x07"


def test_small_and_oversized_frames_are_not_pooled(monkeypatch):
    small = B.alloc_frame(B.POOL_MIN_BYTES - 1)
    assert small.nbytes == B.POOL_MIN_BYTES - 1 and B.pooled_bytes() == 0
    monkeypatch.setattr(B, "POOL_BYTES", 4 * MIB)
    big = B.alloc_frame(4 * MIB + 1)
    assert big.nbytes == 4 * MIB + 1 and not big.readonly and B.pooled_bytes() == 0


def _holders():
    """Ways a user can keep a received frame's memory alive (each drops the frame itself)."""
    payload, bufs = S.dumps(np.arange(MIB // 2, dtype=np.float32))

    def array(f):
        return np.frombuffer(f, np.float32)

    def numpy_view_of_array(f):
        return np.frombuffer(f, np.float32)[10:20]

    def memoryview_slice(f):
        return f[100:200]

    def memoryview_of_memoryview(f):
        return memoryview(f)

    def unpickled_array(f):
        f[:] = bufs[0]
        return S.loads(payload, [f])

    def cycle(f):  # held by a reference cycle: free only after gc
        a, b = [f], []
        a.append(b)
        b.append(a)
        return None

    return [array, numpy_view_of_array, memoryview_slice, memoryview_of_memoryview,
            unpickled_array, cycle]


@pytest.mark.parametrize("hold", _holders(), ids=lambda h: h.__name__)
def test_never_reused_while_referenced(hold):
    f = B.alloc_frame(2 * MIB)
    first = addr(f)
    held = hold(f)
    del f
    other = B.alloc_frame(2 * MIB)  # the first one is still in use: new memory
    assert addr(other) != first
    del other
    if held is None:
        gc.collect()
    del held
    assert addr(B.alloc_frame(2 * MIB)) == first  # now nothing refers to it: reused


def test_reuses_after_release_and_contents_stay_independent():
    f = B.alloc_frame(2 * MIB)
    a = np.frombuffer(f, np.uint8)
    a[:] = 1
    del f
    g = B.alloc_frame(2 * MIB)
    np.frombuffer(g, np.uint8)[:] = 2
    assert (a == 1).all()  # g is other memory while a lives
    ptr = a.ctypes.data
    del a
    assert addr(B.alloc_frame(2 * MIB)) == ptr


def test_pool_is_bounded():
    n = B.POOL_BYTES // (8 * MIB)
    held = [B.alloc_frame(8 * MIB) for _ in range(n + 3)]
    assert B.pooled_bytes() == n * 8 * MIB  # the 3 oldest are forgotten, not freed
    addrs = [addr(f) for f in held]
    assert len(set(addrs)) == n + 3
    del held
    again = [B.alloc_frame(8 * MIB) for _ in range(n)]  # all served from the pool
    assert {addr(f) for f in again} == set(addrs[3:])
    assert B.pooled_bytes() == n * 8 * MIB


def test_decoder_frames_independent_while_held():
    """Two large messages decoded one after the other: the first stays intact."""
    d = FrameDecoder(64 * MIB)
    x = np.arange(MIB, dtype=np.float32)
    payload, bufs = S.dumps(x)
    frames = [b"h", payload, bufs[0]]
    blob = encode_prefix(frames) + b"".join(bytes(f) for f in frames)

    def decode():
        out, pos = [], 0
        while pos < len(blob):
            buf = d.get_buffer()
            n = min(len(buf), len(blob) - pos, 300_000)
            buf[:n] = blob[pos:pos + n]
            pos += n
            out += d.buffer_updated(n)
        (msg,) = out
        return S.loads(msg[1], msg[2:])

    first = decode()
    first[:3] = -5  # writable
    second = decode()
    np.testing.assert_array_equal(second, x)
    assert first[0] == -5 and first[3] == 3 and first.ctypes.data != second.ctypes.data
    ptr = second.ctypes.data
    del second
    third = decode()  # the second's memory is free again: reused, same contents
    assert third.ctypes.data == ptr
    np.testing.assert_array_equal(third, x)


def test_threads_never_share_a_live_buffer():
    errors = []

    def work(tag: int):
        for _ in range(20):
            a = np.frombuffer(B.alloc_frame(MIB), np.uint8)
            a[:] = tag
            if not (a == tag).all():
                errors.append(tag)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
