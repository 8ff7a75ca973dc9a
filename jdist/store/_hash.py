"""``HashStore``: an in-process store (a dict guarded by a condition variable)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from jdist.store._base import (
    DEFAULT_TIMEOUT,
    Store,
    Timeout,
    Value,
    kv_add,
    kv_append,
    kv_compare_set,
    kv_delete,
    queue_empty_error,
    timeout_error,
    to_key,
    to_keys,
    to_value,
)

__all__ = ["HashStore"]


class HashStore(Store):
    """A thread-safe in-memory store, shared by the threads of one process.

    Same methods and semantics as ``torch.distributed.HashStore``: blocking ``get`` and
    ``wait`` return as soon as another thread sets the keys, or raise
    :class:`jdist.errors.StoreTimeoutError` after the timeout (default 300 s).
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT):
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._cond = threading.Condition()

    def _is_set(self, key: str) -> bool:
        return key in self._data or bool(self._queues.get(key))

    def _wait_locked(self, keys: list[str], timeout: Timeout, queues: bool = False) -> None:
        secs = self._wait_seconds(timeout)
        start = time.monotonic()
        if queues:  # wait/check: a non-empty queue counts as set (torch)
            ready = lambda: all(self._is_set(k) for k in keys)  # noqa: E731
        else:
            ready = lambda: all(k in self._data for k in keys)  # noqa: E731
        if not self._cond.wait_for(ready, secs):
            raise timeout_error(keys, time.monotonic() - start)

    def set(self, key: str, value: Value) -> None:
        key, value = to_key(key), to_value(value)
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        key = to_key(key)
        with self._cond:
            self._wait_locked([key], None)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        key = to_key(key)
        with self._cond:
            new = kv_add(self._data, key, amount)
            self._cond.notify_all()
            return new

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        key, exp, des = to_key(key), to_value(expected_value), to_value(desired_value)
        with self._cond:
            out = kv_compare_set(self._data, key, exp, des)
            self._cond.notify_all()
            return out

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        keys = to_keys(keys)
        with self._cond:
            self._wait_locked(keys, timeout, queues=True)

    def check(self, keys: Sequence[str]) -> bool:
        keys = to_keys(keys)
        with self._cond:
            return all(self._is_set(k) for k in keys)

    def delete_key(self, key: str) -> bool:
        key = to_key(key)
        with self._cond:
            return kv_delete(self._data, key)

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def list_keys(self) -> list[str]:
        with self._cond:
            return list(self._data)

    def append(self, key: str, value: Value) -> None:
        key, value = to_key(key), to_value(value)
        with self._cond:
            kv_append(self._data, key, value)
            self._cond.notify_all()

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks, vs = self._pairs(keys, values)
        with self._cond:
            self._data.update(zip(ks, vs, strict=True))
            self._cond.notify_all()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = to_keys(keys)
        with self._cond:
            self._wait_locked(keys, None)
            return [self._data[k] for k in keys]

    def queue_push(self, key: str, value: Value) -> None:
        key, value = to_key(key), to_value(value)
        with self._cond:
            self._queues.setdefault(key, deque()).append(value)
            self._cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = to_key(key)
        with self._cond:
            if not self._queues.get(key):
                if not block:
                    raise queue_empty_error(key)
                secs, start = self._timeout_s, time.monotonic()
                if not self._cond.wait_for(lambda: bool(self._queues.get(key)), secs):
                    raise timeout_error([key], time.monotonic() - start)
            q = self._queues[key]
            value = q.popleft()
            if not q:
                del self._queues[key]
            return value

    def queue_len(self, key: str) -> int:
        key = to_key(key)
        with self._cond:
            return len(self._queues.get(key, ()))

    def clone(self) -> HashStore:
        """Another handle on the same keys (torch's per-thread ``clone()``).

        The clone shares this store's data; it starts with this store's timeout and has
        its own ``set_timeout``.
        """
        other = object.__new__(HashStore)
        other._timeout_s = self._timeout_s
        other._data, other._queues, other._cond = self._data, self._queues, self._cond
        return other

    def __repr__(self) -> str:
        return f"HashStore(num_keys={len(self._data)})"
