"""In-process transport: comms are pairs of asyncio queues, listeners a process-wide table.

Used by most unit tests: several agents in one process, each with its own event loop,
talk with no sockets. Messages are copied on send, as a socket would, so the sender may
mutate its arrays afterwards and the receiver gets writable buffers.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence

from jdist.rpc.transport._base import (
    Buffer,
    Comm,
    CommClosedError,
    Handler,
    Listener,
    Transport,
)
from jdist.rpc.transport._registry import register_transport

__all__ = ["InprocTransport", "InprocComm"]

_lock = threading.Lock()
_listeners: dict[str, InprocListener] = {}
_names = itertools.count()


class InprocComm(Comm):
    """One end of an in-process pair; ``recv`` runs on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_message_bytes: int, label: str):
        self.loop = loop
        self.max_message_bytes = int(max_message_bytes)
        self.label = label
        self.peer: InprocComm | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"InprocComm({self.label!r}, closed={self._closed})"

    @property
    def closed(self) -> bool:
        return self._closed

    def _deliver(self, msg: list[bytearray] | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, msg)
        except RuntimeError:  # loop already closed
            self._closed = True

    def send(self, frames: Sequence[Buffer], timeout: float | None = None) -> None:
        del timeout  # queues never block
        with self._lock:
            if self._closed or self.peer is None or self.peer._closed:
                raise CommClosedError(f"in-process comm {self.label!r} is closed")
            msg = [bytearray(f) for f in frames]
            self.peer._deliver(msg)

    async def recv(self) -> list[bytearray]:
        msg = await self._queue.get()
        if msg is None:
            self._closed = True
            raise CommClosedError(f"in-process comm {self.label!r} closed")
        if sum(len(f) for f in msg) > self.max_message_bytes:
            self.close()
            raise CommClosedError(
                f"message of {sum(len(f) for f in msg)} bytes exceeds "
                f"max_frame_bytes={self.max_message_bytes}; connection closed")
        return msg

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._deliver(None)
        peer = self.peer
        if peer is not None and not peer._closed:
            peer._deliver(None)
            peer._closed = True


class InprocListener(Listener):
    def __init__(self, address: str, handler: Handler, loop: asyncio.AbstractEventLoop,
                 max_message_bytes: int):
        self.address = address
        self.handler = handler
        self.loop = loop
        self.max_message_bytes = max_message_bytes

    async def stop(self) -> None:
        with _lock:
            if _listeners.get(self.address) is self:
                del _listeners[self.address]


class InprocTransport(Transport):
    """``inproc://name`` addresses; ``inproc://`` (empty name) picks a fresh one."""

    scheme = "inproc"

    async def listen(self, address: str, handler: Handler, *,
                     max_message_bytes: int) -> Listener:
        name = self.location(address, "listen on")
        with _lock:
            if not name:
                name = f"listener-{next(_names)}"
            full = f"inproc://{name}"
            if full in _listeners:
                raise ValueError(f"in-process address {full!r} is already in use")
            listener = InprocListener(full, handler, asyncio.get_running_loop(),
                                      max_message_bytes)
            _listeners[full] = listener
        return listener

    async def connect(self, address: str, *, timeout: float,
                      max_message_bytes: int) -> Comm:
        del timeout
        with _lock:
            listener = _listeners.get(address)
        if listener is None:
            raise CommClosedError(f"nothing listens at {address!r}")
        client = InprocComm(asyncio.get_running_loop(), max_message_bytes, f"client->{address}")
        server = InprocComm(listener.loop, listener.max_message_bytes, f"server@{address}")
        client.peer, server.peer = server, client

        def _accept() -> None:
            listener.loop.create_task(listener.handler(server))

        try:
            listener.loop.call_soon_threadsafe(_accept)
        except RuntimeError as e:
            raise CommClosedError(f"listener at {address!r} is gone") from e
        return client


register_transport("inproc", InprocTransport)
