"""TCP transport on asyncio: length-prefixed frames, zero-copy send and receive.

Receiving: the event loop watches each socket (``add_reader``) and reads straight into
the buffers :class:`FrameDecoder` hands out, so a large array frame lands in its final
buffer. Any thread may read too (:meth:`TCPComm.poll_until`): a thread about to wait
for a message (a caller for its reply, a pool thread for the next call) reads the
socket itself for a little while, with the socket taken out of the loop's epoll set,
so a message that comes soon wakes no thread at all. A read lock keeps reads and the
delivery of their messages in order, whichever thread reads.

Sending is done by the calling thread with ``socket.sendmsg`` over the frames'
memoryviews (one system call for header and buffers, no join, no copy), waiting with
``poll`` when the kernel buffer is full; a lock keeps messages whole.

Peers on the same machine: on Linux a listener also listens on a Unix socket with a
random name in the abstract namespace, and its address says so
(``tcp://127.0.0.1:40123#local=NAME``). A peer connects there first and falls back to
TCP when that fails (another machine or network namespace: the name does not exist
there). Same frames, same authentication; a Unix socket skips the TCP/IP stack, which
on loopback costs each small message about 20 us of ``sendmsg`` and each round trip
about 60 us (torch's TensorPipe uses shared memory between local peers for the same
reason). ``LOCAL_SOCKETS = False`` turns this off in this process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from jdist.rpc.transport._base import (
    Buffer,
    Comm,
    CommClosedError,
    Handler,
    Listener,
    Transport,
)
from jdist.rpc.transport._framing import FrameDecoder, FrameError, encode_prefix
from jdist.rpc.transport._registry import register_transport

__all__ = ["TCPTransport", "TCPComm", "LOCAL_SOCKETS", "split_host_port", "split_local"]

log = logging.getLogger("jdist.rpc")

_IOV_MAX = 512
_EOF = -1  # _read_once: the stream ended or failed
_LOCAL_TAG = "#local="
_UNIX_BUFFER = 4 << 20  # a Unix socket's queue is its sender's buffer: room for arrays
_LOCAL_CONNECT_S = 2.0
_WAIT_SLICE = 0.02  # wait_until: longest sleep in poll(2) between looks at done()

LOCAL_SOCKETS = sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")
"""Whether listeners also listen on an abstract Unix socket that local peers use."""


def split_local(loc: str) -> tuple[str, str | None]:
    """``"host:port#local=NAME"`` -> ``("host:port", "NAME")`` (None: no local socket)."""
    loc, sep, name = loc.partition(_LOCAL_TAG)
    return loc, (name or None) if sep else None


def split_host_port(loc: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; IPv6 hosts in brackets.

    Raises:
      ValueError: no port, or the port is not an int in 0..65535.
    """
    host, sep, port = loc.rpartition(":")
    if not sep or not host:
        raise ValueError(f"TCP address needs host:port, got {loc!r} (e.g. 127.0.0.1:29500)")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"TCP port must be an int, got {port!r} in {loc!r}") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"TCP port must be in 0..65535, got {p}")
    return host.strip("[]"), p


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_BUFFER)
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # buffer sizes are left to the kernel: setting SO_RCVBUF turns off its autotuning


def _peer_name(sock: socket.socket) -> str:
    try:
        if sock.family == socket.AF_UNIX:
            name = sock.getpeername()
            name = name.decode(errors="replace") if isinstance(name, bytes) else name
            return f"local socket {name.lstrip(chr(0))}" if name else "local peer"
        return "{}:{}".format(*sock.getpeername()[:2])
    except OSError:
        return "?"


class TCPComm(Comm):
    """A connected non-blocking socket; reads on ``loop``, writes from any thread."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 max_message_bytes: int):
        self.sock = sock
        self.loop = loop
        self.max_message_bytes = int(max_message_bytes)
        self._decoder = FrameDecoder(max_message_bytes)
        self._ready: collections.deque[list] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._error: CommClosedError | None = None
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()  # held while reading and delivering (any thread)
        self._closed = False
        self._fd_open = True  # the socket is still registered with the loop
        self._mute_lock = threading.Lock()
        self._mutes = 0  # threads polling this socket now (see _mute)
        # the loop's epoll object (asyncio's selector internals; None: no muting)
        epoll = getattr(getattr(loop, "_selector", None), "_selector", None)
        self._epoll = epoll if isinstance(epoll, select.epoll) else None
        self._on_message: Callable[[list], None] | None = None
        self._on_close: Callable[[str], None] | None = None
        self.peer = _peer_name(sock)

    async def _attach(self) -> TCPComm:
        self.loop.add_reader(self.sock.fileno(), self._on_readable)
        return self

    def _on_readable(self) -> None:
        """The loop's read path (level-triggered: called while data is unread)."""
        status = self._read_once()
        if status == _EOF:
            self._close_on_loop()

    def _rest_of_large_frame(self) -> list:
        """Inside a large frame, keep reading while the socket has data (one loop
        iteration per readiness event is far too slow for megabytes); the messages it
        completes. Holding the read lock."""
        decoder, msgs = self._decoder, []
        while decoder.receiving_large_frame:
            try:
                n = self.sock.recv_into(decoder.get_buffer())
            except OSError:  # EAGAIN (or an error the next read reports)
                break
            if n == 0:
                break  # end of stream: the next read reports it
            msgs += decoder.buffer_updated(n)
        return msgs

    def _read_once(self) -> int:
        """Read what the socket has (one ``recv``, more inside a large frame) and deliver
        the completed messages, holding the read lock: any thread may call it.

        Returns the number of messages delivered, or ``_EOF`` when the stream ended or
        failed (then only the loop closes the comm; a polling thread just stops).
        """
        with self._rlock:
            if not self._fd_open or self._closed:
                return _EOF
            decoder = self._decoder
            try:
                n = self.sock.recv_into(decoder.get_buffer())
            except (BlockingIOError, InterruptedError):
                return 0
            except OSError as e:
                if self._error is None:
                    self._error = CommClosedError(f"connection to {self.peer} dropped: {e}")
                return _EOF
            if n == 0:
                if self._error is None:
                    self._error = CommClosedError(f"connection to {self.peer} closed by the peer")
                return _EOF
            try:
                msgs = decoder.buffer_updated(n) + self._rest_of_large_frame()
            except FrameError as e:
                if self._error is None:
                    self._error = CommClosedError(
                        f"bad data from {self.peer}, connection closed: {e}")
                return _EOF
            if not msgs:
                return 0
            on_message = self._on_message
            if on_message is not None:
                for m in msgs:
                    on_message(m)
            else:
                self._ready.extend(msgs)
                self.loop.call_soon_threadsafe(self._wake)
            return len(msgs)

    def poll_until(self, done: Callable[[], bool], seconds: float) -> None:
        """Read and deliver in this thread until ``done()``, for at most ``seconds``
        (see :meth:`Comm.poll_until`). Meanwhile the loop is not woken for this socket:
        the kernel would wake it (an IPI paid by the sender) only to find nothing to read.
        """
        if self._on_message is None or self._closed:
            return
        deadline = time.perf_counter() + seconds
        self._mute(True)
        try:
            while not done() and time.perf_counter() < deadline:
                if not self._read_here():
                    return
        finally:
            self._mute(False)

    def wait_until(self, done: Callable[[], bool], seconds: float) -> None:
        """Read and deliver in this thread until ``done()``, for at most ``seconds``,
        sleeping in ``poll(2)`` while nothing is there (see :meth:`Comm.wait_until`); the
        loop is not woken for this socket meanwhile. ``done()`` is checked at least every
        ``_WAIT_SLICE`` seconds (a future failed by a timer or a closed connection)."""
        if self._on_message is None or self._closed:
            return
        deadline = time.perf_counter() + seconds
        poller = select.poll()
        self._mute(True)
        try:
            poller.register(self.sock.fileno(), select.POLLIN)
            while not done():
                if not self._read_here():
                    return
                left = deadline - time.perf_counter()
                if done() or left <= 0:
                    return
                poller.poll(1e3 * min(left, _WAIT_SLICE))
        except (OSError, ValueError):  # the socket closed under us: the loop reports it
            return
        finally:
            self._mute(False)

    def _read_here(self) -> bool:
        """One read in a thread other than the loop's (:meth:`poll_until`,
        :meth:`wait_until`); False at the end of the stream, whose close is left to the
        loop (it may never see the socket readable again)."""
        if self._read_once() != _EOF:
            return True
        try:
            self.loop.call_soon_threadsafe(self._close_on_loop)
        except RuntimeError:  # the loop is gone already
            pass
        return False

    def _mute(self, on: bool) -> None:
        """Take this socket out of the loop's epoll interest set while threads poll it
        (counted: the first poller mutes, the last one re-arms; re-arming reports data
        that came in between, epoll being level-triggered)."""
        with self._mute_lock:
            self._mutes += 1 if on else -1
            if self._mutes != (1 if on else 0) or self._epoll is None:
                return
            with self._rlock:  # not while the loop closes the socket (fd reuse)
                if self._fd_open:
                    try:
                        self._epoll.modify(self.sock.fileno(), 0 if on else select.EPOLLIN)
                    except (OSError, ValueError):
                        pass

    def __repr__(self) -> str:
        return f"TCPComm(peer={self.peer}, closed={self._closed})"

    @property
    def closed(self) -> bool:
        return self._closed

    def set_max_message_bytes(self, n: int) -> None:
        self.max_message_bytes = int(n)
        self._decoder.max_message_bytes = int(n)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: CommClosedError) -> None:
        self._closed = True
        if self._error is None:
            self._error = err
        self._wake()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(str(self._error))

    def start_receiving(self, on_message: Callable[[list], None],
                        on_close: Callable[[str], None]) -> None:
        # straight from the read path: no future or task step per message; under the
        # read lock, so no polling thread delivers a newer message before these
        with self._rlock:
            self._on_message, self._on_close = on_message, on_close
            while self._ready:
                on_message(self._ready.popleft())
        if self._error is not None:
            self._fail(self._error)

    def send(self, frames: Sequence[Buffer], timeout: float | None = None) -> None:
        views = [memoryview(encode_prefix(frames))]
        views += [memoryview(f).cast("B") for f in frames if memoryview(f).nbytes]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wlock:
            if self._closed:
                raise CommClosedError(f"connection to {self.peer} is closed")
            try:
                self._sendmsg_all(views, deadline)
                return
            except (OSError, TimeoutError) as e:
                failed = e
        # the peer went away (a Unix socket refuses at once what TCP would still take):
        # what it sent before is in our buffer, deliver it before closing (its last
        # answer, e.g. a refusal, says why). Not under the write lock: delivering may send
        self._drain()
        self.close()
        raise CommClosedError(f"send to {self.peer} failed: {failed}") from failed

    def _drain(self) -> None:
        """Deliver the complete messages already readable, without waiting."""
        try:
            while self._read_once() > 0:
                pass
        except Exception:  # noqa: BLE001 - best effort before the close
            log.debug("jdist.rpc: draining %s failed", self.peer, exc_info=True)

    def _sendmsg_all(self, views: list[memoryview], deadline: float | None) -> None:
        i = 0
        poller = None
        while i < len(views):
            try:
                n = self.sock.sendmsg(views[i:i + _IOV_MAX])
            except (BlockingIOError, InterruptedError):
                if poller is None:
                    poller = select.poll()
                    poller.register(self.sock.fileno(), select.POLLOUT)
                wait = 1000 if deadline is None else (deadline - time.monotonic()) * 1000
                if wait <= 0:
                    raise TimeoutError("send timed out; peer is not reading") from None
                poller.poll(min(wait, 1000))
                if self._closed:
                    raise OSError("connection closed during send") from None
                continue
            while n > 0:
                size = views[i].nbytes
                if n >= size:
                    n -= size
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0

    async def recv(self) -> list[bytearray | memoryview]:
        while not self._ready:
            if self._error is not None:
                raise self._error
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._ready.popleft()

    def close(self) -> None:
        # shutdown() is thread-safe and makes the loop see end-of-stream, so the
        # transport closes the socket on the loop thread (never under the selector).
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.loop.call_soon_threadsafe(self._close_on_loop)
        except RuntimeError:  # the loop is gone already
            pass

    def _close_on_loop(self) -> None:
        with self._rlock:  # no thread is reading the socket while it is closed
            was_open, self._fd_open = self._fd_open, False
            if was_open:
                try:
                    self.loop.remove_reader(self.sock.fileno())
                except (ValueError, OSError):
                    pass
                self.sock.close()
        self._fail(CommClosedError(f"connection to {self.peer} is closed"))


class TCPListener(Listener):
    def __init__(self, socks: list[socket.socket], address: str, tasks: list[asyncio.Task]):
        self.socks = socks
        self.address = address
        self._tasks = tasks

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for sock in self.socks:
            sock.close()


def _local_listener() -> tuple[socket.socket, str] | None:
    """A listening abstract Unix socket with a fresh random name, or None (not Linux,
    turned off, or refused)."""
    if not LOCAL_SOCKETS:
        return None
    name = f"jdist-rpc-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        return None
    return sock, name


class TCPTransport(Transport):
    """``tcp://host:port``; port 0 picks a free one. Local peers use a Unix socket (see
    the module docstring)."""

    scheme = "tcp"

    async def listen(self, address: str, handler: Handler, *,
                     max_message_bytes: int) -> Listener:
        loc, _ = split_local(self.location(address, "listen on"))
        host, port = split_host_port(loc)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host

        async def accept_loop(lsock: socket.socket) -> None:
            while True:
                try:
                    conn, _ = await loop.sock_accept(lsock)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                _tune(conn)
                try:
                    comm = await TCPComm(conn, loop, max_message_bytes)._attach()
                except OSError:
                    conn.close()
                    continue
                loop.create_task(handler(comm))

        socks, public = [sock], f"tcp://{shown}:{bound}"
        local = _local_listener()
        if local is not None:
            socks.append(local[0])
            public += _LOCAL_TAG + local[1]
        return TCPListener(socks, public, [loop.create_task(accept_loop(s)) for s in socks])

    async def connect(self, address: str, *, timeout: float,
                      max_message_bytes: int) -> Comm:
        loc, local = split_local(self.location(address, "connect to"))
        host, port = split_host_port(loc)
        loop = asyncio.get_running_loop()
        if local is not None and LOCAL_SOCKETS:
            comm = await self._connect_local(loop, local, timeout, max_message_bytes)
            if comm is not None:
                return comm
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        _tune(sock)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            raise CommClosedError(f"cannot connect to {address}: {e!r}") from e
        return await TCPComm(sock, loop, max_message_bytes)._attach()

    @staticmethod
    async def _connect_local(loop: asyncio.AbstractEventLoop, name: str, timeout: float,
                             max_message_bytes: int) -> Comm | None:
        """The peer's Unix socket, or None: no such name here (another machine or
        network namespace: the caller uses TCP), or it does not accept in time."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _tune(sock)
            # a listening Unix socket accepts at once or refuses: a short cap keeps a
            # full backlog from spending the caller's whole timeout before TCP is tried
            await asyncio.wait_for(loop.sock_connect(sock, "\0" + name),
                                   min(timeout, _LOCAL_CONNECT_S))
            return await TCPComm(sock, loop, max_message_bytes)._attach()
        except (OSError, asyncio.TimeoutError):
            sock.close()
            return None


register_transport("tcp", TCPTransport)
