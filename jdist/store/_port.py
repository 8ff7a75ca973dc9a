"""``free_port``: a TCP port to hand to a store server, a coordinator or a test."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it).

    Another process may take it before you bind it; servers that must not race
    (``TCPStore(port=0)``) bind port 0 themselves instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
