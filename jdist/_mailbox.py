"""Messages between processes: an authenticated, reconfigurable mailbox (no JAX, floor 0).

Departure from DESIGN.md ("bytes between devices move through XLA"), used where XLA's
collectives cannot do the job or are measured slower, each user saying why in its own
docstring: ``jdist.ft`` (across replica groups: XLA's communicators are formed once per
process and cannot drop or add a member; torchft's layout too) and
``jdist.pipelining`` (host-memory activations between the stages of one host, where a
socket message costs a fraction of an XLA point-to-point program).

Every peer listens on one port. A message is ``(key, frames)``; the receiver files
it under ``(key, sender)`` until :meth:`Mailbox.take` asks for it. Connections
authenticate with a mutual HMAC challenge on the job's secret before any frame is read,
and frames are capped (``max_message_bytes``). Nothing received is unpickled.

A sender's process that dies closes its sockets: the receiver notes the end of that
sender's connection and a :meth:`take` waiting on it fails at once instead of at its
deadline. A stopped or hung sender is found by the caller's ``check`` (heartbeats).
"""

from __future__ import annotations

import hmac
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jdist._hmac import mac
from jdist.errors import CollectiveTimeoutError, PeerFailedError

__all__ = ["Mailbox"]

_MAGIC = b"JDMB\x00\x01"
_NONCE = 32
_MAC = 32
_HEAD = struct.Struct("!IQI")  # key length, total frame bytes, number of frames
_LEN = struct.Struct("!Q")
_MAX_KEY = 1024
_MAX_FRAMES = 1 << 20
_HANDSHAKE_S = 10.0
_MAX_HANDSHAKES = 32  # connections authenticating at once; more are closed at once


def _read(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return buf


class Mailbox:
    """This peer's listener, its inbox, and its connections to the others.

    Args:
      replica: this peer's id (sent in the handshake; a replica id, a rank).
      incarnation: which life of that id this is (a replacement counts up).
      token: the job's shared secret (``JDIST_AUTH_TOKEN``).
      host: the address to listen on (loopback unless told otherwise).
      max_message_bytes: the largest message accepted from an authenticated peer.

    Users name their errors and their peers through the class attributes below.
    """

    word = "peer"  # what a peer is called in messages
    lost_error: type[Exception] = PeerFailedError  # a sender's connection ended
    timeout_error: type[Exception] = CollectiveTimeoutError  # take's deadline passed
    auth_error: type[Exception] = PeerFailedError  # no secret, or the peer refused it
    token_fix = "set JDIST_AUTH_TOKEN to the same secret in every process"

    def __init__(self, replica: int, incarnation: int, token: bytes,
                 host: str = "127.0.0.1", max_message_bytes: int = 1 << 32):
        if not token:
            raise self.auth_error(f"a {self.word} mailbox needs the job's secret to "
                                  f"authenticate its peers: {self.token_fix}")
        self.replica, self._token, self._cap = int(replica), bytes(token), max_message_bytes
        self._ident = int(replica).to_bytes(4, "big") + int(incarnation).to_bytes(4, "big")
        self._cond = threading.Condition()
        self._inbox: dict[tuple[str, int], list[bytearray]] = {}
        self._ended: dict[tuple[int, int], str] = {}  # (replica, incarnation) -> why it ended
        self._failed: dict[str, str] = {}  # key of a message that could not be sent -> why
        self._out: dict[str, _Sender] = {}
        self._out_lock = threading.Lock()
        self._closed = False
        self._inbound: list[tuple[socket.socket, threading.Thread]] = []
        self._open: dict[tuple[int, int], int] = {}  # (replica, incarnation) -> connections
        self._handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, name="jdist-mailbox-accept", daemon=True).start()

    # -- receiving ------------------------------------------------------------
    def _accept(self) -> None:
        n = 0
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            n += 1
            thread = threading.Thread(target=self._serve, args=(conn, n), daemon=True,
                                      name="jdist-mailbox-recv")
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._inbound.append((conn, thread))
            thread.start()

    def _server_handshake(self, conn: socket.socket) -> tuple[int, int]:
        conn.settimeout(_HANDSHAKE_S / 3)  # (three reads: at most _HANDSHAKE_S in all)
        hello = _read(conn, len(_MAGIC) + _NONCE + 8)
        if bytes(hello[:len(_MAGIC)]) != _MAGIC:
            raise PermissionError("not a jdist mailbox peer")
        nonce_c, ident = bytes(hello[len(_MAGIC):-8]), bytes(hello[-8:])
        nonce_s = secrets.token_bytes(_NONCE)
        conn.sendall(nonce_s + mac(self._token, b"server", nonce_c, nonce_s, ident))
        answer = bytes(_read(conn, _MAC))
        if not hmac.compare_digest(answer, mac(self._token, b"client", nonce_s, nonce_c,
                                               ident)):
            raise PermissionError("peer does not know the job's secret")
        conn.sendall(b"OK")
        conn.settimeout(None)
        return int.from_bytes(ident[:4], "big"), int.from_bytes(ident[4:], "big")

    def _serve(self, conn: socket.socket, conn_id: int) -> None:
        try:
            self._serve_authenticated(conn)
        finally:
            with self._cond:
                self._inbound = [(c, t) for c, t in self._inbound if c is not conn]

    def _serve_authenticated(self, conn: socket.socket) -> None:
        if not self._handshakes.acquire(blocking=False):  # too many unauthenticated
            conn.close()
            return
        try:
            who = self._server_handshake(conn)
        except (OSError, ConnectionError, PermissionError):
            conn.close()
            return
        finally:
            self._handshakes.release()
        sender = who[0]
        with self._cond:
            self._ended.pop(who, None)
            self._open[who] = self._open.get(who, 0) + 1
        why = "its connection closed (process died?)"
        try:
            while True:
                key_len, total, count = _HEAD.unpack(_read(conn, _HEAD.size))
                if key_len > _MAX_KEY or total > self._cap or count > _MAX_FRAMES:
                    why = (f"it sent a message over the cap ({total} bytes, {count} frames; "
                           f"max_message_bytes={self._cap})")
                    break
                key = bytes(_read(conn, key_len)).decode()
                sizes = [_LEN.unpack(_read(conn, _LEN.size))[0] for _ in range(count)]
                if sum(sizes) != total:
                    why = "it sent a malformed message"
                    break
                frames = [_read(conn, s) for s in sizes]
                with self._cond:
                    self._inbox[(key, sender)] = frames
                    self._cond.notify_all()
        except (OSError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            conn.close()
            with self._cond:
                self._open[who] -= 1
                if not self._open[who]:  # (a newer connection of it may still be open)
                    self._ended[who] = why
                self._cond.notify_all()

    def take(self, key: str, sender: tuple[int, int], deadline: float,
             check: Callable[[], None], what: str) -> list[bytearray]:
        """The frames ``sender`` (replica, incarnation) sent under ``key``, waiting until
        ``deadline`` (``time.monotonic``); ``check()`` runs while waiting and may raise.

        Raises:
          lost_error: ``sender``'s connection ended.
          timeout_error: the deadline passed.
        """
        item = (key, sender[0])
        with self._cond:
            while item not in self._inbox:
                if sender in self._ended:
                    raise self.lost_error(f"{self.word} {sender[0]} was lost during "
                                          f"{what}: {self._ended[sender]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.timeout_error(f"{self.word} {sender[0]} sent nothing for "
                                             f"{what} before the deadline")
                self._cond.release()
                try:
                    check()
                finally:
                    self._cond.acquire()
                self._cond.wait(min(left, 0.05))
            return self._inbox.pop(item)

    def poll(self, key: str, sender: int) -> list[bytearray] | None:
        """The frames ``sender`` sent under ``key`` if they are here (taken), else None."""
        with self._cond:
            return self._inbox.pop((key, sender), None)

    def note_failure(self, keys: list[str], why: str) -> None:
        with self._cond:
            for key in keys:
                self._failed[key] = why

    def failure(self, prefix: str) -> str | None:
        """Why a message whose key starts with ``prefix`` could not be sent, if one
        could not."""
        with self._cond:
            return next((w for k, w in self._failed.items() if k.startswith(prefix)), None)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop inbox entries whose key ``keep`` rejects (messages of old rounds)."""
        with self._cond:
            for item in [i for i in self._inbox if not keep(i[0])]:
                del self._inbox[item]
            for key in [k for k in self._failed if not keep(k)]:
                del self._failed[key]

    # -- sending --------------------------------------------------------------
    def post(self, peer: int, address: str, key: str, frames: Sequence,
             timeout: float) -> None:
        """Queue ``frames`` (bytes-like, not changed afterwards) for peer ``peer`` at
        ``address`` under ``key``; returns at once. Each address has its own sending
        thread, so a stopped peer delays nobody else's messages; a message that could
        not be sent is listed by :meth:`failure`."""
        for _ in range(2):  # a sender that failed is replaced once
            with self._out_lock:
                sender = self._out.get(address)
                if sender is None or sender.broken:
                    sender = self._out[address] = _Sender(self, peer, address, timeout)
            if sender.put(key, frames):
                return
        self.note_failure([key], f"could not send to {self.word} {peer} at {address}")

    def connect(self, address: str, timeout: float) -> socket.socket:
        """An authenticated connection to the peer at ``address``."""
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce_c = secrets.token_bytes(_NONCE)
            sock.sendall(_MAGIC + nonce_c + self._ident)
            reply = bytes(_read(sock, _NONCE + _MAC))
            nonce_s, proof = reply[:_NONCE], reply[_NONCE:]
            if not hmac.compare_digest(proof, mac(self._token, b"server", nonce_c, nonce_s,
                                                  self._ident)):
                raise self.auth_error(f"the {self.word} at {address} does not know this "
                                      f"job's secret (another job's?); {self.token_fix}")
            sock.sendall(mac(self._token, b"client", nonce_s, nonce_c, self._ident))
            if bytes(_read(sock, 2)) != b"OK":
                raise self.auth_error(f"the {self.word} at {address} refused this "
                                      f"{self.word}'s secret; {self.token_fix}")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return sock

    def flush(self, deadline: float) -> bool:
        """Wait until every queued message is written to its socket (or listed as failed)
        or ``deadline`` (``time.monotonic``) passes; True if nothing is left queued."""
        with self._out_lock:
            senders = list(self._out.values())
        for sender in senders:
            with sender.idle:
                while sender.pending and not sender.broken:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    sender.idle.wait(left)
        return True

    def close(self, wait: float = 2.0) -> None:
        """Stop listening, close every connection, and wait up to ``wait`` seconds for
        this mailbox's threads to end (none is left running into interpreter exit)."""
        with self._cond:
            self._closed = True
            inbound, self._inbound = self._inbound, []
        self._server.close()
        with self._out_lock:
            senders, self._out = list(self._out.values()), {}
        for sender in senders:
            sender.stop()
        for conn, _ in inbound:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        end = time.monotonic() + wait
        for thread in [t for _, t in inbound] + [s.thread for s in senders]:
            thread.join(max(0.0, end - time.monotonic()))


def _bytes(frame) -> memoryview:
    """A frame as flat bytes (numpy arrays of any dtype, bfloat16 included)."""
    if isinstance(frame, np.ndarray):
        return memoryview(np.ascontiguousarray(frame).reshape(-1).view(np.uint8))
    return memoryview(frame).cast("B")


def _encode(key: str, frames: Sequence) -> list[memoryview | bytes]:
    views = [_bytes(f) for f in frames]
    head = _HEAD.pack(len(key.encode()), sum(v.nbytes for v in views), len(views))
    return [head + key.encode() + b"".join(_LEN.pack(v.nbytes) for v in views), *views]


class _Sender:
    """One connection to one peer and the thread that writes its queued messages.

    A message is either sent or listed as failed (``Mailbox.note_failure``): ``put``
    and the failure path hold one lock, so nothing is queued behind a dead sender."""

    def __init__(self, box: Mailbox, peer: int, address: str, timeout: float):
        self.box, self.peer, self.address, self.timeout = box, peer, address, timeout
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        self.pending = 0  # messages queued and not yet written (or failed)
        self._lock = threading.Lock()
        self.idle = threading.Condition(self._lock)
        self._sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name=f"jdist-mailbox-send-{peer}",
                                       daemon=True)
        self.thread.start()

    def put(self, key: str, frames: Sequence) -> bool:
        """Queue a message; False (nothing queued) if this sender has failed."""
        with self._lock:
            if self.broken:
                return False
            self.queue.put((key, frames))
            self.pending += 1
            return True

    def _run(self) -> None:
        item = None
        try:
            self._sock = self.box.connect(self.address, self.timeout)
            while True:
                item = self.queue.get()
                if item is None:
                    return
                for part in _encode(*item):
                    self._sock.sendall(part)
                item = None
                with self._lock:
                    self.pending -= 1
                    self.idle.notify_all()
        except Exception as e:  # noqa: BLE001 (every failure is reported, none lost)
            why = f"could not send to {self.box.word} {self.peer} at {self.address}: {e}"
            with self._lock:
                self.broken = True
                keys = [] if item is None else [item[0]]
                while not self.queue.empty():  # (what was queued behind it is lost too)
                    later = self.queue.get()
                    keys += [] if later is None else [later[0]]
            self.box.note_failure(keys, why)
        finally:
            with self._lock:
                self.broken = True
                self.pending = 0
                self.idle.notify_all()
            if self._sock is not None:
                self._sock.close()

    def stop(self) -> None:
        self.queue.put(None)
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
