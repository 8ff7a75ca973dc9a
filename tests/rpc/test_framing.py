"""The frame decoder: round trips under any chunking, and fuzzing never crashes it."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.rpc.transport import FrameDecoder, FrameError, encode_prefix


def wire(frames):
    return encode_prefix(frames) + b"".join(frames)


def feed(decoder, data, cuts):
    """Feed ``data`` to ``decoder`` in chunks ending at ``cuts``; return the messages."""
    out, pos = [], 0
    for end in sorted(set(cuts)) + [len(data)]:
        while pos < end:
            buf = decoder.get_buffer()
            n = min(len(buf), end - pos)
            assert n > 0
            buf[:n] = data[pos:pos + n]
            pos += n
            out += decoder.buffer_updated(n)
    return out


frames_st = st.lists(st.binary(max_size=300), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(msgs=st.lists(frames_st, min_size=1, max_size=4), data=st.data())
def test_roundtrip_any_chunking(msgs, data):
    blob = b"".join(wire(m) for m in msgs)
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=8))
    got = feed(FrameDecoder(1 << 20), blob, cuts)
    assert [[bytes(f) for f in m] for m in got] == msgs


def test_large_frame_received_in_place():
    big = bytes(range(256)) * 4096  # 1 MiB > staging buffer
    blob = wire([b"h", big, b"t"])
    got = feed(FrameDecoder(1 << 22), blob, list(range(0, len(blob), 70_000)))
    assert [bytes(f) for f in got[0]] == [b"h", big, b"t"]
    assert all(not memoryview(f).readonly for f in got[0])  # arrays built on them are writable


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=2000), data=st.data())
def test_random_bytes_never_crash(blob, data):
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=5))
    try:
        feed(FrameDecoder(4096, max_frames=64), blob, cuts)
    except FrameError:
        pass


@settings(max_examples=300, deadline=None)
@given(msg=frames_st, flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                     min_size=1, max_size=6),
       cut=st.integers(0, 10_000))
def test_mutated_and_truncated_frames_never_crash(msg, flips, cut):
    blob = bytearray(wire(msg))
    for pos, val in flips:
        blob[pos % len(blob)] = val
    blob = bytes(blob[:cut % (len(blob) + 1)])
    try:
        got = feed(FrameDecoder(4096, max_frames=64), blob, [])
    except FrameError:
        return
    for m in got:
        assert sum(len(f) for f in m) <= 4096


def test_oversized_announcement_refused_before_allocation():
    d = FrameDecoder(1000)
    header = encode_prefix([b"x"])[:8] + struct.pack("!Q", 10**15)
    with pytest.raises(FrameError, match="max_frame_bytes=1000"):
        feed(d, header, [])


def test_receive_buffer_allocated_only_after_the_cap_check(monkeypatch):
    from jdist.rpc.transport import _framing

    sizes = []
    monkeypatch.setattr(_framing, "alloc_frame",
                        lambda n: sizes.append(n) or memoryview(bytearray(n)))
    header = encode_prefix([b"x"])[:8] + struct.pack("!Q", 3 << 20)
    with pytest.raises(FrameError, match="max_frame_bytes"):
        feed(FrameDecoder(2 << 20), header + b"\0" * 1000, [])
    assert sizes == []  # refused on the announced length alone
    assert feed(FrameDecoder(4 << 20), header + b"\0" * 1000, []) == []
    assert sizes == [3 << 20]  # within the cap: one buffer of the announced size


@pytest.mark.parametrize("blob,match", [
    (b"GET / HTTP/1.1\r\n", "not a jdist RPC message"),
    (b"JR\x01\x00\x00\x00\x00\x00", "0 frames"),
    (b"JR\x01\x00\xff\xff\xff\xff", "frames"),
])
def test_bad_prefix_messages(blob, match):
    with pytest.raises(FrameError, match=match):
        feed(FrameDecoder(1000), blob, [])
