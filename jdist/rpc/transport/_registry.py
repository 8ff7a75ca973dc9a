"""Scheme -> transport registry (``"tcp"``, ``"inproc"``, and any you register)."""

from __future__ import annotations

import threading

from jdist.rpc.transport._base import Transport

__all__ = ["register_transport", "get_transport", "transport_schemes"]

_lock = threading.Lock()
_transports: dict[str, type[Transport]] = {}


def register_transport(scheme: str, cls: type[Transport]) -> None:
    """Make ``scheme://`` addresses use transport class ``cls``.

    Raises:
      ValueError: ``scheme`` is already registered to a different class.
    """
    with _lock:
        old = _transports.get(scheme)
        if old is not None and old is not cls:
            raise ValueError(f"transport scheme {scheme!r} is already registered to {old!r}")
        _transports[scheme] = cls


def transport_schemes() -> list[str]:
    """The registered schemes, sorted."""
    with _lock:
        return sorted(_transports)


def get_transport(scheme: str) -> Transport:
    """A new instance of the transport registered for ``scheme``.

    Raises:
      ValueError: no transport has that scheme (the message lists the known ones).
    """
    with _lock:
        cls = _transports.get(scheme)
    if cls is None:
        raise ValueError(
            f"unknown RPC transport {scheme!r}; known: {transport_schemes()}. "
            "Did you forget to call register_transport()?")
    return cls()
