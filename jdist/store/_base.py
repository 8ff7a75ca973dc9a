"""The store contract shared by every store kind, and its pure key-value core.

:class:`Store` is the base class of :class:`~jdist.store.TCPStore`,
:class:`~jdist.store.FileStore`, :class:`~jdist.store.HashStore` and
:class:`~jdist.store.PrefixStore`. It normalises arguments (keys are ``str``;
values are ``bytes``, and ``str`` values are encoded as UTF-8, as torch does) and turns
timeouts into :class:`jdist.errors.StoreTimeoutError`.

The functions ``kv_*`` apply one store operation to a plain ``dict[str, bytes]``. They
are the single definition of the semantics (torch 2.13's, quirks included), used by
the in-memory store, by the TCP server and when replaying the file store's log.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from datetime import timedelta

from jdist.errors import QueueEmptyError, StoreTimeoutError

__all__ = ["Store", "DEFAULT_TIMEOUT", "Timeout", "Value"]

DEFAULT_TIMEOUT = timedelta(seconds=300)
Timeout = timedelta | float | int | None
Value = bytes | bytearray | memoryview | str

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_STOLL = re.compile(rb"\s*([+-]?\d+)")


# ----------------------------------------------------------------------------- normalising

def to_key(key: object) -> str:
    """``key`` checked to be a ``str`` (torch accepts only strings)."""
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, got {type(key).__name__} {key!r}; "
                        f"convert it with str(key)")
    return key


def to_keys(keys: object) -> list[str]:
    """A list of keys; a bare string is refused (it would be split into characters)."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"expected a list of keys, got the single key {keys!r}; pass [{keys!r}]")
    return [to_key(k) for k in keys]  # type: ignore[union-attr]


def to_value(value: object) -> bytes:
    """``value`` as bytes: bytes-like kept, ``str`` encoded as UTF-8."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be bytes or str, got {type(value).__name__} "
                    f"{value!r:.80}; encode it first (e.g. str(x) or pickle.dumps(x))")


def to_seconds(timeout: Timeout, default: float | None = None) -> float | None:
    """Seconds from a ``timedelta`` or a number; ``None`` gives ``default``.

    Zero means "no timeout" (wait forever), as torch's ``kNoTimeout``; the result is then
    ``None``.
    """
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds as a number, "
                        f"got {type(timeout).__name__} {timeout!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0 (0 = wait "
                         f"forever), got {seconds}")
    return None if seconds == 0 else seconds


def timeout_error(keys: Sequence[str], waited: float | None) -> StoreTimeoutError:
    """The error for keys that did not appear within ``waited`` seconds."""
    shown = ", ".join(repr(k) for k in keys)
    ms = "?" if waited is None else f"{waited * 1000:.0f}"
    return StoreTimeoutError(
        f"wait timeout after {ms}ms, keys: {shown} (no process set them in time; check "
        f"that the process that sets them is running, or raise the timeout with "
        f"store.set_timeout(...) / the timeout argument)")


def queue_empty_error(key: str) -> QueueEmptyError:
    """The error of a non-blocking pop from an empty queue."""
    return QueueEmptyError(f"queue is empty: queue_pop({key!r}, block=False) found no value; "
                           f"pop with block=True to wait, or check queue_len() first")


def parse_int(key: str, value: bytes) -> int:
    """The integer at the start of ``value``, parsed like C++ ``std::stoll``."""
    m = _STOLL.match(value)
    if m is None:
        raise ValueError(f"store.add({key!r}, ...): the key holds {value!r:.80}, which is not "
                         f"an integer; use a fresh key for counters")
    n = int(m.group(1))
    if not _INT64_MIN <= n <= _INT64_MAX:
        raise ValueError(f"store.add({key!r}, ...): the key holds {n}, outside int64")
    return n


# ----------------------------------------------------------------------------- pure core

def kv_add(d: dict[str, bytes], key: str, amount: int) -> int:
    """Add ``amount`` to the integer at ``key`` (0 if missing); return the new value."""
    new = (parse_int(key, d[key]) if key in d else 0) + int(amount)
    if not _INT64_MIN <= new <= _INT64_MAX:
        raise ValueError(f"store.add({key!r}, {amount}): the result {new} overflows int64")
    d[key] = str(new).encode()
    return new


def kv_compare_set(d: dict[str, bytes], key: str, expected: bytes, desired: bytes) -> bytes:
    """torch's ``compare_set``: set ``desired`` if the current value is ``expected``.

    A missing key counts as matching only an empty ``expected``; a missing key with a
    non-empty ``expected`` returns ``expected`` and sets nothing (torch's quirk). The
    result is the value the key holds afterwards.
    """
    current = d.get(key)
    if current is None:
        if expected == b"":
            d[key] = desired
            return desired
        return expected
    if current == expected:
        d[key] = desired
        return desired
    return current


def kv_append(d: dict[str, bytes], key: str, value: bytes) -> None:
    """Append ``value`` to ``key``'s bytes (set it if missing)."""
    d[key] = d.get(key, b"") + value


def kv_delete(d: dict[str, bytes], key: str) -> bool:
    """Remove ``key``; True if it existed."""
    return d.pop(key, None) is not None


# ----------------------------------------------------------------------------- base class

class Store:
    """Base class of jdist's key-value stores (torch's ``c10d::Store`` contract).

    Every method takes ``str`` keys; values are ``bytes`` or ``str`` (UTF-8). ``get``,
    ``wait`` and ``multi_get`` block until the keys exist or the timeout passes, then
    raise :class:`jdist.errors.StoreTimeoutError` naming the keys and the time waited.
    A timeout is a ``timedelta`` or seconds; 0 means wait forever (as in torch).
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT):
        secs = to_seconds(timeout, DEFAULT_TIMEOUT.total_seconds())
        self._timeout_s: float | None = secs

    # --- timeout -------------------------------------------------------------------------
    @property
    def timeout(self) -> timedelta:
        """The default timeout of blocking calls (``timedelta(0)`` = none)."""
        return timedelta(seconds=self._timeout_s or 0)

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default timeout of ``get``/``wait``/``multi_get`` (0 = wait forever)."""
        if timeout is None:
            raise TypeError("set_timeout(None): pass a timedelta or seconds (0 = forever)")
        self._timeout_s = to_seconds(timeout)

    def _wait_seconds(self, timeout: Timeout) -> float | None:
        return self._timeout_s if timeout is None else to_seconds(timeout)

    # --- the contract (subclasses implement) -------------------------------------------
    def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, overwriting any previous value."""
        raise self._missing("set")

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""
        raise self._missing("get")

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer counter ``key`` (created at 0); return the new value.

        Raises ``ValueError`` if the key holds something that is not an integer.
        """
        raise self._missing("add")

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        """Atomically set ``desired_value`` if ``key`` holds ``expected_value``.

        A missing key matches only ``expected_value == ""``. Returns the key's value
        afterwards; for a missing key and a non-empty ``expected_value`` it returns
        ``expected_value`` and sets nothing (torch's behaviour).
        """
        raise self._missing("compare_set")

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Block until every key in ``keys`` is set (``timeout`` defaults to the store's)."""
        raise self._missing("wait")

    def check(self, keys: Sequence[str]) -> bool:
        """True if every key in ``keys`` is set (no waiting)."""
        raise self._missing("check")

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        raise self._missing("delete_key")

    def num_keys(self) -> int:
        """How many keys the store holds."""
        raise self._missing("num_keys")

    def list_keys(self) -> list[str]:
        """Every key the store holds, in no particular order."""
        raise self._missing("list_keys")

    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the bytes at ``key`` (sets it if missing)."""
        raise self._missing("append")

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set several keys in one atomic step."""
        raise self._missing("multi_set")

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of several keys, waiting (store timeout) until all are set."""
        raise self._missing("multi_get")

    def queue_push(self, key: str, value: Value) -> None:
        """Append ``value`` to the queue ``key`` (queues live beside the keys: ``get``
        does not see them; ``check``/``wait`` count a non-empty queue as set)."""
        raise NotImplementedError(f"queue support is not implemented. ({type(self).__name__} "
                                  f"has no queues; use a TCPStore or HashStore)")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the oldest value of queue ``key``; with ``block``, wait up to the store
        timeout for one (``StoreTimeoutError``), else raise ``QueueEmptyError``."""
        raise NotImplementedError(f"queue support is not implemented. ({type(self).__name__} "
                                  f"has no queues; use a TCPStore or HashStore)")

    def queue_len(self, key: str) -> int:
        """How many values queue ``key`` holds."""
        raise NotImplementedError(f"queue support is not implemented. ({type(self).__name__} "
                                  f"has no queues; use a TCPStore or HashStore)")

    def clone(self) -> Store:
        """Another handle on the same store, for use from another thread (as torch's)."""
        raise self._missing("clone")

    def has_extended_api(self) -> bool:
        """Whether ``append``/``multi_get``/``multi_set`` are implemented.

        True for every jdist store; for a user's subclass, True when it defines all
        three (torch's rule for Python stores).
        """
        cls = type(self)
        return all(getattr(cls, m) is not getattr(Store, m)
                   for m in ("append", "multi_get", "multi_set"))

    def _missing(self, method: str) -> NotImplementedError:
        """The error of a contract method a subclass did not define (a RuntimeError)."""
        return NotImplementedError(
            f"Not implemented. {type(self).__name__}.{method}() is not defined; a Store "
            f"subclass implements the methods it is used with")

    # --- helpers for subclasses ----------------------------------------------------------
    @staticmethod
    def _pairs(keys: Iterable[str], values: Iterable[Value]) -> tuple[list[str], list[bytes]]:
        ks = to_keys(keys)
        vs = [to_value(v) for v in values]
        if len(ks) != len(vs):
            raise ValueError(f"multi_set got {len(ks)} keys but {len(vs)} values; "
                             f"pass one value per key")
        return ks, vs
