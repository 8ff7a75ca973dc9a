"""Transport interfaces: a :class:`Comm` moves whole messages (lists of byte frames).

A transport decides *how* bytes move (TCP sockets, in-process queues); which bytes move
is the protocol's business. Every transport passes the same test suite
(``tests/rpc/test_transport.py``).

Threading contract (the agent relies on it):

- ``Comm.send`` is thread-safe and blocking: it returns once the frames are handed to
  the operating system (or the peer's queue), so the caller may mutate its arrays
  afterwards. Call it from worker threads, never from the event loop for large data.
- ``Comm.recv`` is a coroutine run by a single reader task on the comm's event loop.
- ``Comm.close`` may be called from any thread, any number of times.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Sequence

from jdist.errors import RpcError

__all__ = [
    "Buffer",
    "Comm",
    "CommClosedError",
    "Listener",
    "Transport",
    "parse_address",
]

Buffer = bytes | bytearray | memoryview


class CommClosedError(RpcError, ConnectionError):
    """The connection is closed (by either side, or because the peer sent garbage)."""


def parse_address(address: str) -> tuple[str, str]:
    """Split ``"scheme://location"`` into ``(scheme, location)``.

    Raises:
      ValueError: ``address`` has no ``scheme://`` part.
    """
    if not isinstance(address, str) or "://" not in address:
        raise ValueError(
            f"transport address must look like 'tcp://127.0.0.1:29500' or 'inproc://name', "
            f"got {address!r}")
    scheme, loc = address.split("://", 1)
    return scheme, loc


class Comm(abc.ABC):
    """One bidirectional, message-oriented connection."""

    #: messages larger than this (sum of frame lengths) are refused and the comm closed
    max_message_bytes: int

    @abc.abstractmethod
    def send(self, frames: Sequence[Buffer], timeout: float | None = None) -> None:
        """Send one message; thread-safe; raises :class:`CommClosedError` when closed.

        Raises:
          CommClosedError: the connection is closed, or the send did not finish within
            ``timeout`` seconds (the comm is then closed: a half-sent message cannot be
            taken back).
        """

    @abc.abstractmethod
    async def recv(self) -> list[bytearray | memoryview]:
        """The next message's frames; raises :class:`CommClosedError` at end of stream.

        Frames are writable and referenced by nothing else (``bytearray``, or for large
        frames a ``memoryview`` of numpy memory), so arrays rebuilt on them are too.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connection (idempotent, any thread); a pending ``recv`` ends."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` ran or the connection dropped."""

    def set_max_message_bytes(self, n: int) -> None:
        """Change the receive cap (the agent raises it once the peer is authenticated)."""
        self.max_message_bytes = int(n)

    def poll_until(self, done: Callable[[], bool], seconds: float) -> None:
        """Read and deliver (to ``on_message``, in this thread) what arrives, without
        blocking, until ``done()`` or for at most ``seconds``; then return.

        A thread about to wait for a message polls briefly first: a message that comes
        soon is then handled without waking any thread. Only comms that
        :meth:`start_receiving` was called on deliver; this default (transports without
        polling) returns at once.
        """
        del done, seconds

    def wait_until(self, done: Callable[[], bool], seconds: float) -> None:
        """Like :meth:`poll_until`, but sleeping between reads until something arrives:
        a thread that waits for a message reads it itself, woken once by the kernel,
        instead of being woken by the thread that read it. This default returns at once
        (the caller then waits as usual)."""
        del done, seconds

    def start_receiving(self, on_message: Callable[[list], None],
                        on_close: Callable[[str], None]) -> None:
        """From now on call ``on_message(frames)`` for each message, then ``on_close(reason)``.

        Call it on the comm's event loop, instead of (not while) awaiting ``recv``. Both
        callbacks run on the loop thread. This default pumps ``recv`` in a task;
        transports may deliver straight from their read path.
        """

        async def pump() -> None:
            reason = "connection closed"
            try:
                while True:
                    on_message(await self.recv())
            except CommClosedError as e:
                reason = str(e)
            finally:
                on_close(reason)

        asyncio.get_running_loop().create_task(pump())


class Listener(abc.ABC):
    """A bound endpoint accepting connections; ``address`` is dialable by peers."""

    address: str

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop accepting; existing comms are left to their owners."""


Handler = Callable[[Comm], Awaitable[None]]


class Transport(abc.ABC):
    """A scheme's way to listen and connect; one instance serves any number of comms."""

    scheme: str

    def location(self, address: str, verb: str) -> str:
        """The part of ``address`` after ``scheme://``; ``ValueError`` for another scheme
        (``verb``: what was attempted, e.g. ``"listen on"``)."""
        scheme, loc = parse_address(address)
        if scheme != self.scheme:
            raise ValueError(f"{type(self).__name__} cannot {verb} {address!r}")
        return loc

    @abc.abstractmethod
    async def listen(self, address: str, handler: Handler, *,
                     max_message_bytes: int) -> Listener:
        """Start accepting at ``address``; each new comm is passed to ``handler``.

        ``address`` may leave the port (``tcp://127.0.0.1:0``) or name open; the
        returned listener's ``address`` is the concrete one.
        """

    @abc.abstractmethod
    async def connect(self, address: str, *, timeout: float,
                      max_message_bytes: int) -> Comm:
        """Open a comm to ``address``.

        Raises:
          CommClosedError: nothing listens there or the connection failed in ``timeout``.
        """
