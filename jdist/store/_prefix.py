"""``PrefixStore``: a view of another store with a key prefix."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from jdist.store._base import Store, Timeout, Value, to_key, to_keys, to_value

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """A view of ``store`` that puts ``prefix + "/"`` before every key.

    As in torch: ``num_keys()`` counts every key of the underlying store (not only
    this prefix's), while ``list_keys()`` lists only this prefix's keys, without the
    prefix. The timeout is the underlying store's.
    """

    def __init__(self, prefix: str, store: Store):
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be str, got {type(prefix).__name__} "
                            f"{prefix!r}")
        if store is None:
            raise ValueError("PrefixStore: store argument cannot be None; pass the store to "
                             "wrap (TCPStore, FileStore, HashStore or PrefixStore)")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore needs a jdist store (TCPStore, FileStore, "
                            f"HashStore, PrefixStore), got {type(store).__name__}")
        self._prefix = prefix
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store below that is not a PrefixStore (torch's private name)."""
        inner = self._store
        while isinstance(inner, PrefixStore):
            inner = inner._store
        return inner

    @property
    def prefix(self) -> str:
        """The prefix (without the ``/``)."""
        return self._prefix

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._store.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{to_key(key)}"

    def set(self, key: str, value: Value) -> None:
        self._store.set(self._k(key), to_value(value))

    def get(self, key: str) -> bytes:
        return self._store.get(self._k(key))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._k(key), amount)

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        return self._store.compare_set(self._k(key), to_value(expected_value),
                                       to_value(desired_value))

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        self._store.wait([self._k(k) for k in to_keys(keys)], timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check([self._k(k) for k in to_keys(keys)])

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def list_keys(self) -> list[str]:
        head = self._prefix + "/"
        return [k[len(head):] for k in self._store.list_keys() if k.startswith(head)]

    def append(self, key: str, value: Value) -> None:
        self._store.append(self._k(key), to_value(value))

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._store.multi_set([self._k(k) for k in to_keys(keys)], [to_value(v) for v in values])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._store.multi_get([self._k(k) for k in to_keys(keys)])

    def queue_push(self, key: str, value: Value) -> None:
        self._store.queue_push(self._k(key), to_value(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._store.queue_pop(self._k(key), block)

    def queue_len(self, key: str) -> int:
        return self._store.queue_len(self._k(key))

    def has_extended_api(self) -> bool:
        """The underlying store's answer."""
        return self._store.has_extended_api()

    def clone(self) -> PrefixStore:
        """A PrefixStore over a clone of the underlying store (for use in another thread)."""
        return PrefixStore(self._prefix, self._store.clone())

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"
