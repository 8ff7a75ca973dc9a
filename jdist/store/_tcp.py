"""``TCPStore``: a store served over TCP by the master process, with a shared secret.

The master (``is_master=True``) starts a :class:`~jdist.store._server.StoreServer`
thread and is also a client of it; the other processes connect as clients. Every
connection authenticates with a mutual HMAC challenge-response on the job's secret
(``auth_token=``, else ``$JDIST_AUTH_TOKEN``, which ``jdist-run`` sets per job).

Differences from torch (documented on purpose):

- a shared secret is checked; a wrong or missing one raises
  :class:`jdist.errors.StoreAuthError` (torch has no authentication);
- values and requests have a size cap (``max_value_bytes``, default 256 MiB), refused
  with :class:`jdist.errors.StoreValueTooLargeError` (torch has none);
- ``num_keys()`` counts only user keys (torch's TCPStore also counts an internal
  ``init/`` key, so it starts at 1);
- ``add`` on a non-integer value raises ``ValueError`` and the connection stays usable
  (torch's server drops the connection);
- ``timeout`` may be seconds as a float as well as a ``timedelta``;
- a timeout raises :class:`jdist.errors.StoreTimeoutError` (a ``RuntimeError`` and a
  ``TimeoutError``; torch: ``DistStoreError``) naming the keys and the time waited;
- after a lost connection the next request reconnects (within 2 s) instead of failing
  for good;
- ``barrier`` is not provided; ``use_libuv`` is accepted and ignored.

A client object is safe to share between threads (one request at a time under a lock;
a thread blocked in ``get`` holds it), and ``clone()`` gives a second connection for a
thread that must not wait behind another's ``get``, as torch's ``clone()`` does.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections.abc import Sequence

import msgpack

from jdist.errors import StoreAuthError, StoreError, StoreTimeoutError, StoreValueTooLargeError
from jdist.store import _wire as wire
from jdist.store._base import (
    DEFAULT_TIMEOUT,
    Store,
    Timeout,
    Value,
    queue_empty_error,
    timeout_error,
    to_key,
    to_keys,
    to_seconds,
    to_value,
)
from jdist.store._server import StoreServer
from jdist.store._wire import Op

__all__ = ["TCPStore"]

_IO_MARGIN_S = 30.0  # extra socket time beyond a server-side wait deadline
# after a lost connection, the next request reconnects within this window only: a server
# that was up and went away has most likely exited, and callers (heartbeats, teardown)
# must learn that quickly rather than after the store timeout
_RECONNECT_S = 2.0
_servers: dict[tuple[str, int], weakref.ref] = {}
_servers_lock = threading.Lock()


class _ServerHandle:
    """Keeps a server alive while any store object refers to it; stops it afterwards."""

    def __init__(self, server: StoreServer):
        self.server = server
        weakref.finalize(self, server.stop)


def _start_server(host: str, port: int, token: bytes | None, cap: int,
                  multi_tenant: bool, listen_fd: int | None = None) -> _ServerHandle:
    with _servers_lock:
        if multi_tenant and port:
            ref = _servers.get((host, port))
            handle = ref() if ref is not None else None
            if handle is not None:
                return handle
        handle = _ServerHandle(StoreServer(host, port, token, cap, listen_fd))
        _servers[(host, handle.server.port)] = weakref.ref(handle)
        return handle


def _connect_host(host: str) -> str:
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


class _Client:
    """One authenticated connection; requests are serialised by a lock."""

    def __init__(self, host: str, port: int, token: bytes | None, cap: int,
                 connect_timeout: float | None):
        self.host, self.port, self.token, self.cap = host, port, token, cap
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        self.io_timeout: float | None = None
        self.connect(connect_timeout)

    def where(self) -> str:
        return f"TCPStore at {self.host}:{self.port}"

    def connect(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause, err = 0.01, None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise StoreTimeoutError(
                    f"could not connect to the {self.where()} within {timeout:.1f}s ({err}); "
                    f"check that the master (is_master=True) runs and that MASTER_ADDR/"
                    f"MASTER_PORT point at it")
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=min(left or 30.0, 30.0))
            except OSError as e:
                err = e
                time.sleep(min(pause, max(0.0, left or pause)))
                pause = min(pause * 2, 0.25)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(min(left or 30.0, 30.0))
                self._handshake(sock)
            except (TimeoutError, ConnectionError) as e:  # server busy or restarting
                sock.close()
                err = e
                continue
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            self.sock, self.buf, self.io_timeout = sock, bytearray(), None
            return

    def _handshake(self, sock: socket.socket) -> None:
        hello = _recv_exact(sock, wire.HELLO_LEN)
        if hello[:4] != wire.MAGIC_SERVER:
            raise StoreError(f"{self.where()} is not a jdist TCPStore (it sent {hello[:4]!r}); "
                             f"check MASTER_PORT")
        server_secret = bool(hello[5] & 1)
        if server_secret and self.token is None:
            raise StoreAuthError(f"the {self.where()} requires a shared secret and this client "
                                 f"has none; set JDIST_AUTH_TOKEN (or auth_token=) to the job's "
                                 f"token")
        if self.token is not None and not server_secret:
            raise StoreAuthError(f"the {self.where()} has no shared secret but this client has "
                                 f"one; start the master with the same JDIST_AUTH_TOKEN")
        snonce, cnonce = hello[6:], wire.new_nonce()
        sock.sendall(wire.MAGIC_CLIENT + bytes([1 if self.token else 0]) + cnonce
                     + wire.mac(self.token, b"client", snonce, cnonce))
        try:
            verdict = _recv_exact(sock, wire.VERDICT_LEN)
        except ConnectionError:
            verdict = bytes(wire.VERDICT_LEN)
        if verdict[0] != 1:
            raise StoreAuthError(f"the {self.where()} refused this client's secret; give every "
                                 f"process the same JDIST_AUTH_TOKEN (or auth_token=)")
        if verdict[1:] != wire.mac(self.token, b"server", cnonce, snonce):
            raise StoreAuthError(f"the {self.where()} could not prove it knows the shared "
                                 f"secret; check MASTER_ADDR/MASTER_PORT and JDIST_AUTH_TOKEN")

    def close(self) -> None:
        with self.lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None

    def request(self, req: list, io_timeout: float | None, reconnect_timeout: float | None):
        body = msgpack.packb(req, use_bin_type=True)
        if len(body) > self.cap + wire.FRAME_OVERHEAD:
            raise StoreValueTooLargeError(
                f"a {_OP_NAMES.get(req[0], req[0])} request of {len(body)} bytes exceeds the "
                f"TCPStore limit (max_value_bytes={self.cap}); store a smaller value")
        frame = len(body).to_bytes(4, "big") + body
        with self.lock:
            if self.sock is None:
                self.connect(reconnect_timeout)
            sock = self.sock
            try:
                if io_timeout != self.io_timeout:
                    sock.settimeout(io_timeout)
                    self.io_timeout = io_timeout
                sock.sendall(frame)
                reply = self._recv_frame(sock)
            except (OSError, ValueError) as e:
                self.sock = None
                sock.close()
                if isinstance(e, socket.timeout):
                    raise StoreError(f"the {self.where()} did not answer a "
                                     f"{_OP_NAMES.get(req[0])} request within {io_timeout}s; "
                                     f"the connection was reset") from e
                raise StoreError(f"lost the connection to the {self.where()} ({e}); the "
                                 f"master process may have exited") from e
        if reply[0] == 0:
            return reply[1]
        kind, msg = reply[1], reply[2]
        if kind == "timeout":
            raise _ServerTimeout()
        if kind == "value":
            raise ValueError(msg)
        if kind == "empty":
            raise queue_empty_error(msg)
        if kind == "size":
            self.close()
            raise StoreValueTooLargeError(f"the {self.where()} refused the request: {msg}")
        raise StoreError(f"the {self.where()} answered an error: {msg}")

    def _recv_frame(self, sock: socket.socket):
        buf = self.buf
        if not buf:  # fast path: the whole reply in one read
            chunk = sock.recv(1 << 18)
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            if len(chunk) >= 4 and int.from_bytes(chunk[:4], "big") == len(chunk) - 4:
                return msgpack.unpackb(chunk[4:], raw=False)
            buf += chunk
        while len(buf) < 4:
            self._fill(sock, buf)
        n = int.from_bytes(buf[:4], "big")
        while len(buf) < 4 + n:
            self._fill(sock, buf)
        out = msgpack.unpackb(memoryview(buf)[4:4 + n], raw=False)
        del buf[:4 + n]
        return out

    @staticmethod
    def _fill(sock: socket.socket, buf: bytearray) -> None:
        chunk = sock.recv(1 << 18)
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        buf += chunk


class _ServerTimeout(Exception):
    pass


_OP_NAMES = {v: k.lower() for k, v in vars(Op).items() if isinstance(v, int)}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionResetError("the server closed the connection during the handshake")
        out += chunk
    return bytes(out)


class TCPStore(Store):
    """A key-value store served over TCP (``torch.distributed.TCPStore`` semantics).

    Args:
      host_name: the master's address; the master binds to exactly this address.
      port: the master's port; with ``is_master=True``, 0 picks a free one (read it
        back from :attr:`port`).
      world_size: number of store users; with ``wait_for_workers`` the master waits
        in the constructor until that many have connected. None (or any negative
        number, as torch): not fixed, don't wait. 0 is refused, in torch's words.
      is_master: start the server in this process (a background thread).
      timeout: default timeout of ``get``/``wait`` and of connecting
        (``timedelta`` or seconds; default 300 s).
      wait_for_workers: see ``world_size``.
      multi_tenant: reuse a server this process already runs on ``host_name:port``.
      master_listen_fd: a bound TCP socket's file descriptor for the master to listen
        on (it takes the socket over), as torch's; ``port`` is the port it is bound to.
      use_libuv: accepted for torch compatibility and ignored.
      auth_token: the shared secret; default ``$JDIST_AUTH_TOKEN``; with neither, the
        store runs without one (only clients without a secret can then connect).
      max_value_bytes: the largest value (and request) accepted.

    Raises:
      ValueError: ``world_size=0`` ("TCPStore world size cannot be 0"), a bad port.
      StoreListenError: the master cannot listen on ``host_name:port`` (torch's "The
        server socket has failed to listen on any local network address").
      StoreAuthError: the secret was refused (or the server failed to prove its own).
      StoreTimeoutError: the server could not be reached, or the workers did not
        connect, within ``timeout`` ("Timed out after N seconds waiting for clients.
        K/N clients joined.").
    """

    def __init__(self, host_name: str, port: int, world_size: int | None = None,
                 is_master: bool = False, timeout: Timeout = DEFAULT_TIMEOUT,
                 wait_for_workers: bool = True, multi_tenant: bool = False,
                 master_listen_fd: int | None = None, use_libuv: bool = True, *,
                 auth_token: str | bytes | None = None,
                 max_value_bytes: int = wire.DEFAULT_MAX_VALUE_BYTES):
        super().__init__(timeout)
        del use_libuv
        if master_listen_fd is not None and not is_master:
            raise ValueError(f"master_listen_fd={master_listen_fd!r} needs is_master=True "
                             f"(only the master listens)")
        if not isinstance(host_name, str) or not host_name and not is_master:
            raise TypeError(f"host_name must be a non-empty str, got {host_name!r}")
        if world_size is not None and (isinstance(world_size, bool)
                                       or not isinstance(world_size, int)):
            raise TypeError(f"TCPStore world_size must be an int or None, got {world_size!r}")
        if world_size == 0:
            raise ValueError("TCPStore world size cannot be 0: pass the number of processes "
                             "that use the store, or None (or -1) if it is not fixed")
        if world_size is not None and world_size < 0:  # torch: any negative = not fixed
            world_size = None
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if port == 0 and not is_master:
            raise ValueError("port=0 (pick a free port) works only with is_master=True; "
                             "clients need the master's actual port (TCPStore.port)")
        if isinstance(max_value_bytes, bool) or not isinstance(max_value_bytes, int) \
                or max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be a positive int, got {max_value_bytes!r}")
        token = wire.resolve_token(auth_token)
        self._host = host_name
        self._world_size = world_size
        self._cap = max_value_bytes
        self._server: _ServerHandle | None = None
        if is_master:
            self._server = _start_server(host_name, port, token, max_value_bytes, multi_tenant,
                                         master_listen_fd)
            port = self._server.server.port
        self._port = port
        self._client = _Client(_connect_host(host_name), port, token, max_value_bytes,
                               self._timeout_s)
        self._call([Op.JOIN])
        if is_master and wait_for_workers and world_size is not None:
            start = time.monotonic()
            try:
                self._call([Op.WAIT_WORKERS, world_size, self._timeout_s], wait=self._timeout_s)
            except _ServerTimeout:
                waited = time.monotonic() - start
                joined = self._server.server.joined
                self.close()
                raise StoreTimeoutError(
                    f"Timed out after {waited:.0f} seconds waiting for clients. "
                    f"{joined}/{world_size} clients joined. (TCPStore master at "
                    f"{host_name}:{port} waited {waited:.1f}s for {world_size} store users; "
                    f"start every process, or pass wait_for_workers=False)") from None

    # --- plumbing ------------------------------------------------------------------------
    @property
    def host(self) -> str:
        """The master's address."""
        return self._host

    @property
    def port(self) -> int:
        """The master's port (the picked one when constructed with ``port=0``)."""
        return self._port

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        """False: jdist's server is a Python selectors loop, not libuv."""
        return False

    def _call(self, req: list, wait: float | None = -1.0):
        """Send ``req``; ``wait`` is the server-side wait in seconds (-1: none)."""
        # one socket timeout for every kind of request when the waits use the store's
        # default, so the socket's mode is not switched (a syscall) on every call
        base = self._timeout_s if wait == -1.0 else wait
        io = None if base is None else base + _IO_MARGIN_S
        return self._client.request(req, io, _RECONNECT_S)

    def _check_size(self, value: bytes) -> bytes:
        if len(value) > self._cap:
            raise StoreValueTooLargeError(
                f"a store value of {len(value)} bytes exceeds max_value_bytes={self._cap}; "
                f"store large data elsewhere or raise max_value_bytes on every TCPStore")
        return value

    def _blocking(self, op: int, keys: list[str], timeout: Timeout, payload):
        secs = self._wait_seconds(timeout)
        start = time.monotonic()
        try:
            return self._call([op, payload, secs], wait=secs)
        except _ServerTimeout:
            raise timeout_error(keys, time.monotonic() - start) from None

    def clone(self) -> TCPStore:
        """A new connection to the same server (use one per thread that blocks in ``get``)."""
        other = object.__new__(TCPStore)
        other._timeout_s = self._timeout_s
        other._host, other._port, other._world_size = self._host, self._port, self._world_size
        other._cap, other._server = self._cap, self._server
        c = self._client
        other._client = _Client(c.host, c.port, c.token, c.cap, self._timeout_s)
        return other

    def close(self) -> None:
        """Close this client's connection; the master's server stops when its last
        store object is closed or collected."""
        self._client.close()
        self._server = None

    def __repr__(self) -> str:
        """torch's form: ``TCPStore(client=TCPClient(SocketImpl(fd=.., addr=[host]:..,
        remote=[host]:..)), server=TCPServer(port=..))`` (``server=<nullptr>`` on a
        client)."""
        sock = self._client.sock
        try:
            fd, local = sock.fileno(), sock.getsockname()[1]
            client = (f"TCPClient(SocketImpl(fd={fd}, addr=[{self._host}]:{local}, "
                      f"remote=[{self._host}]:{self._port}))")
        except (AttributeError, OSError):
            client = "TCPClient(closed)"
        server = f"TCPServer(port={self._port})" if self._server is not None else "<nullptr>"
        return f"TCPStore(client={client}, server={server})"

    # --- the contract --------------------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        self._call([Op.SET, to_key(key), self._check_size(to_value(value))])

    def get(self, key: str) -> bytes:
        key = to_key(key)
        return self._blocking(Op.GET, [key], None, key)

    def add(self, key: str, amount: int) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"add() amount must be an int, got {amount!r}")
        return self._call([Op.ADD, to_key(key), amount])

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        exp = self._check_size(to_value(expected_value))
        des = self._check_size(to_value(desired_value))
        return self._call([Op.CAS, to_key(key), exp, des])

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        keys = to_keys(keys)
        self._blocking(Op.WAIT, keys, timeout, keys)

    def check(self, keys: Sequence[str]) -> bool:
        return self._call([Op.CHECK, to_keys(keys)])

    def delete_key(self, key: str) -> bool:
        return self._call([Op.DELETE, to_key(key)])

    def num_keys(self) -> int:
        return self._call([Op.NUM_KEYS])

    def list_keys(self) -> list[str]:
        return self._call([Op.LIST_KEYS])

    def append(self, key: str, value: Value) -> None:
        self._call([Op.APPEND, to_key(key), self._check_size(to_value(value))])

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks, vs = self._pairs(keys, values)
        for v in vs:
            self._check_size(v)
        self._call([Op.MULTI_SET, ks, vs])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = to_keys(keys)
        return self._blocking(Op.MULTI_GET, keys, None, keys)

    def queue_push(self, key: str, value: Value) -> None:
        self._call([Op.QUEUE_PUSH, to_key(key), self._check_size(to_value(value))])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = to_key(key)
        if not block:
            return self._call([Op.QUEUE_POP, key, False, None])
        secs, start = self._timeout_s, time.monotonic()
        try:
            return self._call([Op.QUEUE_POP, key, True, secs], wait=secs)
        except _ServerTimeout:
            raise timeout_error([key], time.monotonic() - start) from None

    def queue_len(self, key: str) -> int:
        return self._call([Op.QUEUE_LEN, to_key(key)])

    def ping(self, timeout: Timeout = 10.0) -> None:
        """Round-trip a no-op request (raises StoreError if the server is gone)."""
        self._client.request([Op.PING], to_seconds(timeout), to_seconds(timeout))
