"""Length-prefixed framing of messages: a message is a list of byte frames.

Wire layout of one message::

    b"JR" | version u8 | flags u8 | nframes u32 | nframes x length u64 | frame bytes...

:class:`FrameDecoder` is a pure state machine with the ``get_buffer`` /
``buffer_updated`` pair of :class:`asyncio.BufferedProtocol`: the reader receives straight
into the buffer it hands out, so large frames land in their final buffer with no copy
(small frames go through a staging buffer and come out as ``bytearray``). Anything
malformed raises :class:`FrameError` before memory is allocated for it; the caller then
closes the connection.

A large frame comes out as a writable ``memoryview`` of numpy memory from
:func:`jdist.rpc.transport._buffers.alloc_frame` (not a ``bytearray``, whose zero-fill
costs more than the transfer).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from jdist.rpc.transport._buffers import alloc_frame

__all__ = ["FrameError", "FrameDecoder", "encode_prefix", "MAGIC", "VERSION", "MAX_FRAMES"]

MAGIC = b"JR"
VERSION = 1
MAX_FRAMES = 4096
_PREFIX = struct.Struct("!2sBBI")
_STAGING = 256 * 1024
_MIN_STAGING = 4096


class FrameError(ValueError):
    """Bytes on a connection that are not a valid message (or exceed the size cap)."""


def encode_prefix(frames: Sequence[memoryview | bytes | bytearray]) -> bytes:
    """The prefix (magic, version, count, lengths) that precedes ``frames`` on the wire."""
    n = len(frames)
    if not 0 < n <= MAX_FRAMES:
        raise FrameError(f"a message has 1..{MAX_FRAMES} frames, got {n}")
    lengths = [memoryview(f).nbytes for f in frames]
    return _PREFIX.pack(MAGIC, VERSION, 0, n) + struct.pack(f"!{n}Q", *lengths)


class FrameDecoder:
    """Incremental decoder: feed received bytes, get complete messages back.

    Args:
      max_message_bytes: cap on the sum of a message's frame lengths; a larger announced
        message raises :class:`FrameError` before any of it is read.
      max_frames: cap on the number of frames per message.
    """

    def __init__(self, max_message_bytes: int, max_frames: int = MAX_FRAMES):
        self.max_frames = int(max_frames)
        self._buf = bytearray(0)
        self._start = 0
        self._end = 0
        self._lengths: list[int] | None = None  # lengths of the message being read
        self._nframes = 0
        self._frames: list[bytearray | memoryview] = []
        self._direct: memoryview | None = None  # large frame being received in place
        self._direct_off = 0

        self.max_message_bytes = max_message_bytes  # sizes the staging buffer

    @property
    def max_message_bytes(self) -> int:
        """The cap on a message's bytes; setting it sizes the staging buffer to what a
        message under the cap can need (at most 256 KiB, at least 4 KiB), so a
        connection that has not authenticated yet (capped at the handshake's size)
        holds kilobytes, not the staging buffer of a peer's connection."""
        return self._max

    @max_message_bytes.setter
    def max_message_bytes(self, n: int) -> None:
        self._max = int(n)
        want = min(_STAGING, max(_MIN_STAGING, 2 * (self._max + _PREFIX.size + 8 * 8)))
        live = self._end - self._start
        if want != len(self._buf) and live <= want:
            buf = bytearray(want)
            buf[:live] = self._buf[self._start:self._end]
            self._buf, self._start, self._end = buf, 0, live

    @property
    def receiving_large_frame(self) -> bool:
        """Whether a large frame is being received in place (read on while data is there)."""
        return self._direct is not None

    def get_buffer(self) -> memoryview:
        """Where the next received bytes should be written (never empty)."""
        if self._direct is not None:
            return self._direct[self._direct_off:]
        if self._end == len(self._buf):
            live = self._end - self._start
            self._buf[:live] = self._buf[self._start:self._end]
            self._start, self._end = 0, live
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> list[list]:
        """Record ``nbytes`` written into the last buffer; return completed messages.

        Raises:
          FrameError: the bytes are not a valid message or exceed the caps.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        out: list[list] = []
        if self._direct is not None:
            self._direct_off += nbytes
            if self._direct_off < self._direct.nbytes:
                return out
            self._frames.append(self._direct)
            self._direct = None
            self._finish_if_done(out)
        else:
            self._end += nbytes
        self._parse(out)
        return out

    def _avail(self) -> int:
        return self._end - self._start

    def _finish_if_done(self, out: list[list]) -> None:
        if self._lengths is not None and len(self._frames) == len(self._lengths):
            out.append(self._frames)
            self._frames = []
            self._lengths = None

    def _parse(self, out: list[list]) -> None:
        while True:
            if self._lengths is None:
                if not self._parse_header():
                    return
                continue
            length = self._lengths[len(self._frames)]
            avail = self._avail()
            if length <= avail:
                s = self._start
                self._frames.append(self._buf[s:s + length])  # slicing copies once
                self._start += length
                self._finish_if_done(out)
                continue
            if length <= len(self._buf) // 2:
                return  # small frame: wait for more bytes in the staging buffer
            frame = alloc_frame(length)
            frame[:avail] = memoryview(self._buf)[self._start:self._end]
            self._start = self._end = 0
            self._direct, self._direct_off = frame, avail
            return

    def _parse_header(self) -> bool:
        if self._nframes == 0:
            if self._avail() < _PREFIX.size:
                return False
            magic, version, _flags, n = _PREFIX.unpack_from(self._buf, self._start)
            if magic != MAGIC or version != VERSION:
                raise FrameError(
                    f"not a jdist RPC message (magic {bytes(magic)!r}, version {version}); "
                    "is something else connecting to this port?")
            if not 0 < n <= self.max_frames:
                raise FrameError(f"message announces {n} frames (allowed 1..{self.max_frames})")
            if 8 * n > len(self._buf) - _PREFIX.size:  # its lengths must fit the staging
                raise FrameError(f"message announces {n} frames, more than a message under "
                                 f"max_frame_bytes={self._max} may have here")
            self._start += _PREFIX.size
            self._nframes = n
        need = 8 * self._nframes
        if self._avail() < need:
            return False
        lengths = list(struct.unpack_from(f"!{self._nframes}Q", self._buf, self._start))
        self._start += need
        self._nframes = 0
        total = sum(lengths)
        if total > self.max_message_bytes:
            raise FrameError(
                f"message of {total} bytes exceeds max_frame_bytes={self.max_message_bytes}; "
                "raise RpcBackendOptions(max_frame_bytes=...) on the receiver if intended")
        self._lengths = lengths
        return True
