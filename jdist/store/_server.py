"""The TCP store server: one background thread, a ``selectors`` loop, no blocking calls.

Every socket is non-blocking, so a slow, silent or malicious client never stalls the
others: a blocking ``get``/``wait`` is parked as a *waiter* and answered when its keys
appear or its deadline passes. A connection must pass the handshake of
:mod:`jdist.store._wire` within ``HANDSHAKE_TIMEOUT_S`` before any frame of
it is read; bad magic, a wrong secret, an oversized frame or a malformed request closes
that connection only. Served state lives in one ``dict[str, bytes]`` changed only by
this thread through the ``kv_*`` functions of :mod:`jdist.store._base`.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import selectors
import socket
import threading
import time
from collections import deque

import msgpack

from jdist.errors import StoreListenError
from jdist.store import _wire as wire
from jdist.store._base import kv_add, kv_append, kv_compare_set, kv_delete
from jdist.store._wire import Op

__all__ = ["StoreServer", "bind_listener"]

_JOIN_KEY = "\x00jdist/joined"  # pseudo key that join-waiters watch; never stored
_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE


_INT64 = 2**63
_MAX_WAIT_S = 1e9  # about 30 years: anything longer is not a timeout a peer meant


def _is_int(x, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _seconds(x) -> float | None:
    """A request's timeout: None (none), or a finite number of seconds in [0, 1e9]. A
    NaN or an infinity would stall the server's deadline heap for every client."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or \
            not 0 <= x <= _MAX_WAIT_S:  # False for NaN too
        raise _Protocol(x)
    return float(x)


class _Protocol(Exception):
    """A malformed request; the connection is closed."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket bound to ``host:port`` (only that address)."""
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    last: OSError | None = None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(1024)
            sock.setblocking(False)
            return sock
        except OSError as e:
            sock.close()
            last = e
    err = StoreListenError(
        f"The server socket has failed to listen on any local network address. port: {port}: "
        f"the TCPStore server cannot listen on {host}:{port}: {last}; pick another port "
        f"(0 = any free one) or stop the process that holds it")
    err.errno = getattr(last, "errno", None)
    raise err from last


def adopt_listener(fd: int, port: int) -> socket.socket:
    """A bound TCP socket handed over as a file descriptor (torch's ``master_listen_fd``),
    made listening and non-blocking; it must be bound to ``port``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise StoreListenError(f"master_listen_fd={fd} is not an open socket: {e}; pass the "
                               f"fd of a bound TCP socket (sock.detach())") from e
    bound = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
    if bound != port:
        sock.detach()
        raise ValueError(f"master_listen_fd={fd} is bound to port {bound}, but port={port}; "
                         f"pass the port the socket is bound to")
    sock.listen(1024)
    sock.setblocking(False)
    return sock


_DRAIN_BYTES = 1 << 26
"""After refusing an oversized frame the server reads and drops up to this much of it:
closing a socket with unread bytes sends a reset, which can destroy the refusal before
the client (still sending) reads it."""


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "authed", "nonce", "deadline", "waiter",
                 "closing", "dead", "writing", "drain_left")

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.authed = False
        self.nonce = nonce
        self.deadline = time.monotonic() + wire.HANDSHAKE_TIMEOUT_S
        self.waiter: _Waiter | None = None
        self.closing = False
        self.dead = False
        self.writing = False
        self.drain_left = _DRAIN_BYTES  # bytes read and dropped after a refused frame


class _Waiter:
    __slots__ = ("conn", "ready", "reply", "watch", "active")

    def __init__(self, conn, ready, reply, watch):
        self.conn, self.ready, self.reply, self.watch = conn, ready, reply, watch
        self.active = True


class StoreServer:
    """Serves one key-value dict on ``host:port`` from a daemon thread.

    Args:
      host: address to bind (only this address is listened on).
      port: TCP port; 0 picks a free one (see :attr:`port`).
      token: shared secret, or None for no-secret mode.
      max_value_bytes: largest accepted value; bigger frames are refused.
    """

    def __init__(self, host: str, port: int, token: bytes | None, max_value_bytes: int,
                 listen_fd: int | None = None):
        self.host = host
        self._listener = bind_listener(host, port) if listen_fd is None else adopt_listener(
            listen_fd, port)
        self.port: int = self._listener.getsockname()[1]
        self._token = token
        self._frame_cap = int(max_value_bytes) + wire.FRAME_OVERHEAD
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._joined = 0
        self._watchers: dict[str, list[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._resume: deque[_Conn] = deque()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, _READ, "listen")
        self._sel.register(self._wake_r, _READ, "wake")
        self._conns: set[_Conn] = set()
        self._running = True
        self._next_sweep = 0.0
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"jdist-TCPStore-server:{self.port}")
        self._thread.start()

    @property
    def joined(self) -> int:
        """How many store clients have connected and joined so far."""
        return self._joined

    # --- lifetime ------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop serving and close every socket (idempotent)."""
        if not self._running:
            return
        self._running = False
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _shutdown(self) -> None:
        for c in list(self._conns):
            self._close(c)
        for s in (self._listener, self._wake_r, self._wake_w):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self._sel.close()

    # --- event loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._running:
                for key, mask in self._sel.select(self._next_timeout()):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        conn = key.data
                        if mask & _READ and not conn.dead:
                            self._on_read(conn)
                        if mask & _WRITE and not conn.dead:
                            self._flush(conn)
                    self._drain_resume()
                self._expire()
        finally:
            self._shutdown()

    def _next_timeout(self) -> float:
        t = 1.0
        if self._deadlines:
            t = min(t, max(0.0, self._deadlines[0][0] - time.monotonic()))
        return t

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: try again later
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, wire.new_nonce())
            self._conns.add(conn)
            self._sel.register(sock, _READ, conn)
            flags = 1 if self._token is not None else 0
            self._send(conn, wire.MAGIC_SERVER + bytes([wire.VERSION, flags]) + conn.nonce)

    def _expire(self) -> None:
        now = time.monotonic()
        if (not self._deadlines or self._deadlines[0][0] > now) and now < self._next_sweep:
            return
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.active:
                self._retire(w)
                self._reply(w.conn, [1, "timeout", ""])
                self._resume.append(w.conn)
        if now >= self._next_sweep:
            self._next_sweep = now + 1.0
            for c in [c for c in self._conns if not c.authed and c.deadline <= now]:
                self._close(c)
        self._drain_resume()

    def _drain_resume(self) -> None:
        while self._resume:
            conn = self._resume.popleft()
            if not conn.dead and conn.waiter is None:
                self._process(conn)

    # --- socket I/O ----------------------------------------------------------------------
    def _close(self, conn: _Conn) -> None:
        if conn.dead:
            return
        conn.dead = True
        if conn.waiter is not None:
            self._retire(conn.waiter)
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _on_read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        if conn.closing:  # discard whatever follows a refused frame (bounded)
            conn.drain_left -= len(data)
            if conn.drain_left <= 0:
                self._close(conn)
            return
        if (conn.authed and not conn.inbuf and conn.waiter is None and not conn.outbuf
                and len(data) >= 4
                and int.from_bytes(data[:4], "big") == len(data) - 4
                and len(data) - 4 <= self._frame_cap):
            self._one_frame(conn, data[4:])  # fast path: exactly one whole request
            return
        conn.inbuf += data
        if len(conn.inbuf) > self._frame_cap + 4:
            # a client waits for each reply, so it never has more than one frame in
            # flight: this one pipelines requests it does not read the answers of
            self._close(conn)
            return
        self._process(conn)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if not conn.outbuf:  # fast path: nothing queued, try to send at once
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(data):
                if conn.closing:
                    self._finish_closing(conn)
                return
            data = data[sent:]
        conn.outbuf += data
        self._flush(conn)

    def _finish_closing(self, conn: _Conn) -> None:
        """The last reply is out. After a refused frame: half-close and let the read
        path drop the rest of the frame until the client closes (see _DRAIN_BYTES);
        after a failed handshake: close at once."""
        if not conn.authed:
            self._close(conn)
            return
        try:
            conn.sock.shutdown(socket.SHUT_WR)
            if conn.writing:  # nothing more to write: reads only
                conn.writing = False
                self._sel.modify(conn.sock, _READ, conn)
        except (OSError, ValueError, KeyError):
            self._close(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(conn)
            return
        want = bool(conn.outbuf)
        if not want and conn.closing:
            self._finish_closing(conn)
            return
        if not want and conn.writing and conn.inbuf:
            self._resume.append(conn)  # frames held back while the reply was queued
        if want != conn.writing:
            conn.writing = want
            self._sel.modify(conn.sock, _READ | (_WRITE if want else 0), conn)

    def _reply(self, conn: _Conn, msg: list) -> None:
        if conn.dead:
            return
        body = msgpack.packb(msg, use_bin_type=True)
        self._send(conn, len(body).to_bytes(4, "big") + body)

    # --- handshake and frames ----------------------------------------------------------
    def _handshake(self, conn: _Conn) -> bool:
        buf = conn.inbuf
        if len(buf) < wire.REPLY_LEN:
            return False
        msg = bytes(buf[:wire.REPLY_LEN])
        del buf[:wire.REPLY_LEN]
        flags, nonce, proof = msg[4], msg[5:37], msg[37:69]
        want = wire.mac(self._token, b"client", conn.nonce, nonce)
        ok = (msg[:4] == wire.MAGIC_CLIENT and (flags & 1) == (self._token is not None)
              and hmac.compare_digest(proof, want))
        if not ok:
            conn.closing = True
            self._send(conn, bytes(wire.VERDICT_LEN))
            return False
        conn.authed = True
        self._send(conn, b"\x01" + wire.mac(self._token, b"server", nonce, conn.nonce))
        return True

    def _process(self, conn: _Conn) -> None:
        if not conn.authed and not self._handshake(conn):
            return
        buf = conn.inbuf
        while (conn.waiter is None and not conn.dead and not conn.closing and not conn.outbuf
               and len(buf) >= 4):
            n = int.from_bytes(buf[:4], "big")
            if n > self._frame_cap:
                conn.closing = True
                self._reply(conn, [1, "size", f"a request of {n} bytes exceeds the server's "
                                   f"limit of {self._frame_cap} bytes (max_value_bytes)"])
                return
            if len(buf) < 4 + n:
                return
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            self._one_frame(conn, body)

    def _one_frame(self, conn: _Conn, body: bytes) -> None:
        try:
            req = msgpack.unpackb(body, raw=False, use_list=True)
        except Exception:  # garbage: drop this client, keep serving the rest
            self._close(conn)
            return
        try:
            self._handle(conn, req)
        except ValueError as e:
            self._reply(conn, [1, "value", str(e)])
        except Exception:  # garbage: drop this client, keep serving the rest
            self._close(conn)

    # --- requests ------------------------------------------------------------------------
    def _handle(self, conn: _Conn, req) -> None:
        if not isinstance(req, list) or not req or not isinstance(req[0], int):
            raise _Protocol(req)
        op, args, d = req[0], req[1:], self._data
        if op == Op.SET:
            k, v = _key(args[0]), _val(args[1])
            d[k] = v
            self._ok(conn, None)
            self._notify([k])
        elif op == Op.GET:
            k = _key(args[0])
            v = d.get(k)
            if v is not None:
                self._ok(conn, v)
            else:
                self._park(conn, [k], args[1], lambda: [0, self._data[k]])
        elif op == Op.ADD:
            k = _key(args[0])
            if not _is_int(args[1], -_INT64, _INT64 - 1):
                raise _Protocol(args)
            self._ok(conn, kv_add(d, k, args[1]))
            self._notify([k])
        elif op == Op.CAS:
            k = _key(args[0])
            self._ok(conn, kv_compare_set(d, k, _val(args[1]), _val(args[2])))
            self._notify([k])
        elif op == Op.WAIT:
            ks = [_key(k) for k in args[0]]
            self._park_on(conn, lambda: all(self._is_set(k) for k in ks), ks, args[1],
                          lambda: [0, None])
        elif op == Op.CHECK:
            self._ok(conn, all(self._is_set(_key(k)) for k in args[0]))
        elif op == Op.DELETE:
            self._ok(conn, kv_delete(d, _key(args[0])))
        elif op == Op.NUM_KEYS:
            self._ok(conn, len(d))
        elif op == Op.LIST_KEYS:
            self._ok(conn, list(d))
        elif op == Op.APPEND:
            k = _key(args[0])
            kv_append(d, k, _val(args[1]))
            self._ok(conn, None)
            self._notify([k])
        elif op == Op.MULTI_SET:
            ks, vs = [_key(k) for k in args[0]], [_val(v) for v in args[1]]
            if len(ks) != len(vs):
                raise _Protocol(args)
            d.update(zip(ks, vs, strict=True))
            self._ok(conn, None)
            self._notify(ks)
        elif op == Op.MULTI_GET:
            ks = [_key(k) for k in args[0]]
            self._park(conn, ks, args[1], lambda: [0, [self._data[k] for k in ks]])
        elif op == Op.JOIN:
            self._joined += 1
            self._ok(conn, self._joined)
            self._notify([_JOIN_KEY])
        elif op == Op.WAIT_WORKERS:
            n = args[0]
            if not _is_int(n, 0, _INT64 - 1):
                raise _Protocol(args)
            self._park_on(conn, lambda: self._joined >= n, [_JOIN_KEY], args[1],
                          lambda: [0, self._joined])
        elif op == Op.PING:
            self._ok(conn, None)
        elif op == Op.QUEUE_PUSH:
            k = _key(args[0])
            self._queues.setdefault(k, deque()).append(_val(args[1]))
            self._ok(conn, None)
            self._notify([k])
        elif op == Op.QUEUE_POP:
            k, block = _key(args[0]), args[1]
            if not block and not self._queues.get(k):
                self._reply(conn, [1, "empty", k])
            else:
                self._park_on(conn, lambda: bool(self._queues.get(k)), [k], args[2],
                              lambda: [0, self._pop(k)])
        elif op == Op.QUEUE_LEN:
            self._ok(conn, len(self._queues.get(_key(args[0]), ())))
        else:
            raise _Protocol(op)

    def _is_set(self, k: str) -> bool:
        """A key is set, or a queue of that name holds a value (torch's check/wait)."""
        return k in self._data or bool(self._queues.get(k))

    def _pop(self, k: str) -> bytes:
        q = self._queues[k]
        v = q.popleft()
        if not q:
            del self._queues[k]
        return v

    def _ok(self, conn: _Conn, result) -> None:
        self._reply(conn, [0, result])

    def _park(self, conn: _Conn, keys: list[str], timeout_s, reply) -> None:
        d = self._data
        self._park_on(conn, lambda: all(k in d for k in keys), keys, timeout_s, reply)

    def _park_on(self, conn: _Conn, ready, watch: list[str], timeout_s, reply) -> None:
        timeout_s = _seconds(timeout_s)
        if ready():
            self._reply(conn, reply())
            return
        w = _Waiter(conn, ready, reply, watch)
        conn.waiter = w
        for k in watch:
            self._watchers.setdefault(k, []).append(w)
        if timeout_s is not None:
            heapq.heappush(self._deadlines,
                           (time.monotonic() + float(timeout_s), next(self._seq), w))

    def _retire(self, w: _Waiter) -> None:
        """Take a finished, timed-out or orphaned waiter off every list."""
        w.active = False
        w.conn.waiter = None
        for k in w.watch:
            lst = self._watchers.get(k)
            if lst is not None:
                try:
                    lst.remove(w)
                except ValueError:
                    pass
                if not lst:
                    del self._watchers[k]

    def _notify(self, keys: list[str]) -> None:
        for k in keys:
            waiting = self._watchers.pop(k, None)
            if not waiting:
                continue
            keep = []
            for w in waiting:
                if not w.active:
                    continue
                if w.ready():
                    self._retire(w)
                    self._reply(w.conn, w.reply())
                    self._resume.append(w.conn)
                else:
                    keep.append(w)
            if keep:
                self._watchers.setdefault(k, []).extend(keep)
        if len(self._deadlines) > 4 * (len(self._conns) + 16):  # drop finished waiters
            self._deadlines = [e for e in self._deadlines if e[2].active]
            heapq.heapify(self._deadlines)


def _key(k) -> str:
    if not isinstance(k, str):
        raise _Protocol(k)
    return k


def _val(v) -> bytes:
    if not isinstance(v, bytes):
        raise _Protocol(v)
    return v
