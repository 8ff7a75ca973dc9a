"""``FileStore``: a store shared by the processes of one machine through a file.

The file is an append-only log of records (4-byte big-endian length + msgpack
``[op, key, value]``, ``op`` ``"s"`` = set, ``"d"`` = delete). Every process keeps a
replayed copy and reads only what was appended since its last look. Writers hold an
exclusive ``flock`` on the file, readers a shared one, so read-modify-write operations
(``add``, ``compare_set``, ``append``) are atomic across processes. A record left half
written by a crashed writer is cut off by the next writer.

As in torch, the store objects count themselves in the file; when the last one closes
(``close()`` or garbage collection) the file is deleted, and the next ``FileStore`` on
that path starts a fresh, empty store. ``world_size`` is recorded but, as in torch, not
enforced.

Differences from torch: the user count is hidden from ``num_keys``/``list_keys`` (torch
lists it), ``delete_key`` of a missing key returns False (torch: True), the file format
is jdist's own, and a timeout raises :class:`jdist.errors.StoreTimeoutError`.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Sequence

import msgpack

from jdist.errors import StoreError
from jdist.store._base import (
    DEFAULT_TIMEOUT,
    Store,
    Timeout,
    Value,
    kv_add,
    kv_append,
    kv_compare_set,
    timeout_error,
    to_key,
    to_keys,
    to_value,
)

__all__ = ["FileStore"]

_REFCOUNT = "\x00jdist/refcount"


def _hidden(key: str) -> bool:
    return key.startswith("\x00jdist/")


class FileStore(Store):
    """A store in the file ``file_name``, shared by every process that opens it.

    Args:
      file_name: path of the store file (created if missing). Use a fresh path per job:
        a file left by an earlier job still holds that job's keys.
      world_size: number of processes that will use the file; ``-1`` (default) means
        not fixed. Kept for torch's signature; like torch, more users are not refused.
      timeout: default timeout of ``get``/``wait`` (torch's FileStore takes it from
        ``set_timeout`` only; the argument is a jdist convenience).
    """

    def __init__(self, file_name: str | os.PathLike, world_size: int = -1,
                 timeout: Timeout = DEFAULT_TIMEOUT):
        super().__init__(timeout)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {world_size!r}")
        self._path = os.fspath(file_name)
        self._world_size = world_size
        self._lock = threading.RLock()
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self._closed = True
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:
            raise StoreError(f"FileStore cannot open {self._path!r}: {e}; pass a path in a "
                             f"writable directory") from e
        self._closed = False
        self._mutate(lambda d: kv_add(d, _REFCOUNT, 1))

    @property
    def path(self) -> str:
        """The store file's path."""
        return self._path

    # --- log handling --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"FileStore {self._path!r} is closed; open a new FileStore")

    def _replay(self) -> None:
        """Apply the records appended since the last look (caller holds the file lock)."""
        size = os.fstat(self._fd).st_size
        if size < self._offset:  # the file was truncated behind our back: start over
            self._data.clear()
            self._offset = 0
        if size == self._offset:
            return
        buf = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + 4 <= len(buf):
            n = int.from_bytes(buf[pos:pos + 4], "big")
            if pos + 4 + n > len(buf):
                break
            try:
                op, key, value = msgpack.unpackb(buf[pos + 4:pos + 4 + n])
            except Exception as e:  # a foreign or corrupt file
                raise StoreError(f"FileStore {self._path!r} holds a corrupt record at byte "
                                 f"{self._offset + pos}: {e}; use a fresh file") from e
            if op == "s":
                self._data[key] = value
            else:
                self._data.pop(key, None)
            pos += 4 + n
        self._offset += pos

    def _mutate(self, fn):
        """Run ``fn(data)`` under the exclusive lock and log the keys it changed."""
        with self._lock:
            self._check_open()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._replay()
                if os.fstat(self._fd).st_size > self._offset:  # a writer died mid-record
                    os.ftruncate(self._fd, self._offset)
                before = dict(self._data)
                out = fn(self._data)
                recs = []
                for k, v in self._data.items():
                    if before.get(k) != v:
                        recs.append(msgpack.packb(["s", k, v]))
                for k in before.keys() - self._data.keys():
                    recs.append(msgpack.packb(["d", k, b""]))
                if recs:
                    blob = b"".join(len(r).to_bytes(4, "big") + r for r in recs)
                    os.write(self._fd, blob)
                    self._offset += len(blob)
                return out
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read(self, fn):
        """Run ``fn(data)`` on an up-to-date copy under the shared lock."""
        with self._lock:
            self._check_open()
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                self._replay()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            return fn(self._data)

    def _wait(self, keys: list[str], timeout: Timeout) -> None:
        secs = self._wait_seconds(timeout)
        start = time.monotonic()
        pause = 0.001
        while not self._read(lambda d: all(k in d for k in keys)):
            waited = time.monotonic() - start
            if secs is not None and waited >= secs:
                raise timeout_error(keys, waited)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    # --- the contract --------------------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        key, value = to_key(key), to_value(value)
        self._mutate(lambda d: d.__setitem__(key, value))

    def get(self, key: str) -> bytes:
        key = to_key(key)
        self._wait([key], None)
        return self._read(lambda d: d[key])

    def add(self, key: str, amount: int) -> int:
        key = to_key(key)
        return self._mutate(lambda d: kv_add(d, key, amount))

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        key, exp, des = to_key(key), to_value(expected_value), to_value(desired_value)
        return self._mutate(lambda d: kv_compare_set(d, key, exp, des))

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        self._wait(to_keys(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        keys = to_keys(keys)
        return self._read(lambda d: all(k in d for k in keys))

    def delete_key(self, key: str) -> bool:
        key = to_key(key)
        return self._mutate(lambda d: d.pop(key, None) is not None)

    def num_keys(self) -> int:
        return self._read(lambda d: sum(1 for k in d if not _hidden(k)))

    def list_keys(self) -> list[str]:
        return self._read(lambda d: [k for k in d if not _hidden(k)])

    def append(self, key: str, value: Value) -> None:
        key, value = to_key(key), to_value(value)
        self._mutate(lambda d: kv_append(d, key, value))

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks, vs = self._pairs(keys, values)
        self._mutate(lambda d: d.update(zip(ks, vs, strict=True)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = to_keys(keys)
        self._wait(keys, None)
        return self._read(lambda d: [d[k] for k in keys])

    # --- lifetime ------------------------------------------------------------------------
    def clone(self) -> FileStore:
        """Another store object on the same file (one more user until it is closed)."""
        self._check_open()
        return FileStore(self._path, self._world_size, self.timeout)

    def close(self) -> None:
        """Stop using the file; the last user to close it deletes it (as torch does)."""
        with self._lock:
            if self._closed:
                return
            try:
                left = self._mutate(lambda d: kv_add(d, _REFCOUNT, -1))
                if left <= 0:
                    try:
                        os.unlink(self._path)
                    except FileNotFoundError:
                        pass
            finally:
                self._closed = True
                os.close(self._fd)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"
