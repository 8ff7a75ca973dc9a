"""The HMAC of jdist's mutual challenge-response handshakes (RPC connections, the
authenticated mailbox ``jdist/_mailbox.py``): HMAC-SHA256 of a role label and
length-prefixed parts, so that no two different part lists hash alike. No JAX
(floor 0)."""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["mac"]


def mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``role`` and ``parts`` (each length-prefixed) under ``key``."""
    h = hmac.new(key, role, hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()
