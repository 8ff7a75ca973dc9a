"""Mutual HMAC challenge-response run on every new connection before anything else.

Client -> ``[HELLO, nonce_c, id]``; server -> ``[CHALLENGE, nonce_s, mac_s]`` with
``mac_s = HMAC(key, "server" | nonce_c | nonce_s | id)``; the client checks it (the
server knows the secret) and answers ``[AUTH, mac_c]`` with the roles swapped; the
server checks that and says ``[OK]`` or ``[DENIED]`` and closes. Only raw bytes are
compared here: nothing from a peer is unpickled until this has succeeded, and messages
are capped at :data:`HANDSHAKE_MAX_BYTES` until then.
"""

from __future__ import annotations

import hmac
import secrets

from jdist._hmac import mac
from jdist.errors import RpcAuthError
from jdist.rpc.transport import Comm

__all__ = ["client_handshake", "server_handshake", "HANDSHAKE_MAX_BYTES", "mac"]

HANDSHAKE_MAX_BYTES = 4096
_HELLO, _CHALLENGE, _AUTH, _OK, _DENIED = (b"JDIST-HELLO", b"JDIST-CHALLENGE", b"JDIST-AUTH",
                                          b"JDIST-OK", b"JDIST-DENIED")
_NONCE = 32


def _expect(frames: list, tag: bytes, n: int, who: str) -> list[bytes]:
    if len(frames) != n or bytes(frames[0]) != tag:
        raise RpcAuthError(f"{who} broke the authentication handshake (expected {tag!r})")
    return [bytes(f) for f in frames]


async def client_handshake(comm: Comm, key: bytes, my_id: int, address: str) -> None:
    """Prove the secret to the server at ``address`` and check that it knows it too.

    Raises:
      RpcAuthError: the server failed the check or refused ours.
    """
    nonce_c = secrets.token_bytes(_NONCE)
    ident = str(int(my_id)).encode()
    comm.send([_HELLO, nonce_c, ident])
    _, nonce_s, mac_s = _expect(await comm.recv(), _CHALLENGE, 3, f"server at {address}")
    if len(nonce_s) != _NONCE or not hmac.compare_digest(
            mac_s, mac(key, b"server", nonce_c, nonce_s, ident)):
        raise RpcAuthError(
            f"worker at {address} does not know this job's secret; is it part of another job? "
            "Give every process the same JDIST_AUTH_TOKEN / RpcBackendOptions(auth_token=).")
    comm.send([_AUTH, mac(key, b"client", nonce_s, nonce_c, ident)])
    reply = await comm.recv()
    if len(reply) != 1 or bytes(reply[0]) != _OK:
        raise RpcAuthError(f"worker at {address} refused our secret; give every process the "
                           "same JDIST_AUTH_TOKEN / RpcBackendOptions(auth_token=)")


async def server_handshake(comm: Comm, key: bytes, max_message_bytes: int | None = None) -> int:
    """Check a new client's secret (and prove ours); return the worker id it claims.

    ``max_message_bytes``: the connection's cap once the client is authenticated, set
    before ``OK`` is sent (the client sends its first request as soon as it reads it,
    and the reader may decode that before this coroutine's caller runs again).

    Raises:
      RpcAuthError: the client does not know the secret (it was told ``DENIED``).
    """
    _, nonce_c, ident = _expect(await comm.recv(), _HELLO, 3, "client")
    if len(nonce_c) != _NONCE or not ident.isdigit() or len(ident) > 9:
        raise RpcAuthError("client sent a malformed hello")
    nonce_s = secrets.token_bytes(_NONCE)
    comm.send([_CHALLENGE, nonce_s, mac(key, b"server", nonce_c, nonce_s, ident)])
    frames = await comm.recv()
    ok = (len(frames) == 2 and bytes(frames[0]) == _AUTH and hmac.compare_digest(
        bytes(frames[1]), mac(key, b"client", nonce_s, nonce_c, ident)))
    if not ok:
        try:
            comm.send([_DENIED])
        finally:
            comm.close()
        raise RpcAuthError("client failed the shared-secret check; connection refused")
    if max_message_bytes is not None:
        comm.set_max_message_bytes(max_message_bytes)
    comm.send([_OK])
    return int(ident)
