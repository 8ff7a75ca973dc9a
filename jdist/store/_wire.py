"""Wire format of the TCP store: the authentication handshake, frames and op codes.

Handshake (fixed sizes, before any frame is read):

1. server -> client, 38 bytes: ``b"JDST"``, version (1 byte), flags (1 byte; bit 0 =
   the server has a secret), server nonce (32 bytes).
2. client -> server, 69 bytes: ``b"JDSC"``, flags (bit 0 = the client has a secret),
   client nonce (32), ``HMAC-SHA256(secret, b"client" + server_nonce + client_nonce)``.
3. server -> client, 33 bytes: status (1 = accepted) and
   ``HMAC-SHA256(secret, b"server" + client_nonce + server_nonce)``, which the client
   checks, so the server proves it knows the secret too. On refusal the server sends
   status 0 and closes.

Without a secret on both sides the MACs are zeros ("no-secret mode"); a secret on only
one side is refused by that side.

After it, each request and reply is a frame: a 4-byte big-endian length and a msgpack
array. Requests are ``[op, *args]``; replies ``[0, result]`` or
``[1, kind, message]`` with kind ``"timeout"``, ``"value"``, ``"size"`` or ``"empty"``
(a non-blocking ``queue_pop`` of an empty queue).
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = [
    "MAGIC_SERVER", "MAGIC_CLIENT", "VERSION", "HELLO_LEN", "REPLY_LEN", "VERDICT_LEN",
    "resolve_token", "mac", "DEFAULT_MAX_VALUE_BYTES", "FRAME_OVERHEAD", "Op",
]

MAGIC_SERVER = b"JDST"
MAGIC_CLIENT = b"JDSC"
VERSION = 1
NONCE_LEN = 32
HELLO_LEN = 4 + 1 + 1 + NONCE_LEN
REPLY_LEN = 4 + 1 + NONCE_LEN + 32
VERDICT_LEN = 1 + 32
NO_MAC = bytes(32)

DEFAULT_MAX_VALUE_BYTES = 256 * 1024 * 1024
FRAME_OVERHEAD = 64 * 1024  # room for keys and msgpack headers around the values
HANDSHAKE_TIMEOUT_S = 30.0  # a connection that does not authenticate in time is dropped


class Op:
    """Request op codes (small ints keep frames short)."""

    SET = 1
    GET = 2
    ADD = 3
    CAS = 4
    WAIT = 5
    CHECK = 6
    DELETE = 7
    NUM_KEYS = 8
    LIST_KEYS = 9
    APPEND = 10
    MULTI_SET = 11
    MULTI_GET = 12
    JOIN = 13
    WAIT_WORKERS = 14
    PING = 15
    QUEUE_PUSH = 16
    QUEUE_POP = 17
    QUEUE_LEN = 18


def resolve_token(auth_token: str | bytes | None) -> bytes | None:
    """The shared secret: the argument, else ``$JDIST_AUTH_TOKEN``, else None."""
    if auth_token is None:
        auth_token = os.environ.get("JDIST_AUTH_TOKEN") or None
    if auth_token is None:
        return None
    if isinstance(auth_token, str):
        auth_token = auth_token.encode("utf-8")
    if not isinstance(auth_token, (bytes, bytearray)) or not auth_token:
        raise TypeError(f"auth_token must be a non-empty str or bytes, got {auth_token!r:.40}")
    return bytes(auth_token)


def mac(token: bytes | None, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 of ``label + first + second`` under ``token`` (zeros without one)."""
    if token is None:
        return NO_MAC
    return hmac.new(token, label + first + second, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_LEN)
