"""``free_port``: a TCP port to hand to a store server, a coordinator or a test."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_LOWEST = 20000  # below: registered ports of common services
_TRIES = 50
_RANDOM = random.SystemRandom()  # forked processes must not draw the same ports


def _ephemeral_start() -> int | None:
    """The first port of the OS's ephemeral range (where it picks the source ports of
    outgoing connections and the ports of ``bind(0)``), or None where it is unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Where the OS says where its ephemeral range starts (Linux), the port is drawn at
    random from below it (from 20000 up): a port inside that range can become the
    source port of any process's outgoing connection before you bind it, one below it
    only goes to a server that asks for it by number. Elsewhere the OS picks
    (``bind(0)``). Another process may still take the port first; servers that must not
    race (``TCPStore(port=0)``) bind port 0 themselves instead.
    """
    start = _ephemeral_start()
    if start is not None and start - _LOWEST >= 1000:
        for _ in range(_TRIES):
            port = _RANDOM.randrange(_LOWEST, start)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
