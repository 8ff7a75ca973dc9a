"""torch's own store test cases (``test/distributed/test_store.py``), on jdist's stores.

Each test names the torch test it follows; inputs and assertions are torch's, with
``dist.X`` read as ``jdist.store.X``. Where jdist departs on purpose (``num_keys()``
counting, ``use_libuv``), the test checks the departure the migration guide names.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from jdist.errors import QueueEmptyError, StoreError, StoreListenError, StoreTimeoutError
from jdist.store import FileStore, HashStore, PrefixStore, Store, TCPStore, free_port


def _tmpname() -> str:
    f = tempfile.NamedTemporaryFile(delete=False)
    f.close()
    return f.name


def _file_store():
    store = FileStore(_tmpname(), 1)
    store.set_timeout(timedelta(seconds=300))
    return store


def _hash_store():
    store = HashStore()
    store.set_timeout(timedelta(seconds=300))
    return store


def _tcp_store():
    store = TCPStore("localhost", 0, 1, True)
    store.set_timeout(timedelta(seconds=300))
    return store


def _prefix_file_store():
    return PrefixStore("test_prefix", _file_store())


def _prefix_tcp_store():
    return PrefixStore("test_prefix", _tcp_store())


MAKERS = {"file": _file_store, "hash": _hash_store, "tcp": _tcp_store,
          "prefix_file": _prefix_file_store, "prefix_tcp": _prefix_tcp_store}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_store_base_cases(kind):
    """StoreTestBase: test_set_get_check, test_compare_set, test_simple_wait,
    test_append, test_multi_set, test_multi_get, test_clone, for every store class."""
    fs = MAKERS[kind]()
    # test_set_get_check
    fs.add("key", 1)
    fs.add("key", 2)
    fs.add("key", 3)
    fs.set("key0", "value0")
    fs.add("key3", 1)
    fs.set("key1", "value1")
    fs.add("key3", 2)
    fs.set("key2", "value2")
    for i in (3, 4, 5, 6):
        fs.add("key3", i)
    # departure (migration guide, "Stores"): torch counts an internal key in FileStore
    # and TCPStore (6); jdist counts only the user's keys
    assert fs.num_keys() == 5
    assert fs.get("key") == b"6"
    assert fs.get("key0") == b"value0"
    assert fs.get("key1") == b"value1"
    assert fs.get("key2") == b"value2"
    assert fs.get("key3") == b"21"
    assert fs.check(["key3"])
    assert not fs.check(["Randomkey3"])
    fs.set("-key3", "7")
    assert fs.get("-key3") == b"7"
    fs.delete_key("-key3")
    assert fs.num_keys() == 5
    # test_compare_set
    assert fs.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    fs.set("cs_key0", "value0")
    assert fs.get("cs_key0") == b"value0"
    assert fs.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert fs.get("cs_key0") == b"value0"
    assert fs.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert fs.get("cs_key0") == b"new_value0"
    assert fs.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert fs.get("cs_key1") == b"new_value1"
    # test_simple_wait: a RuntimeError whose text matches torch's regex
    with pytest.raises(RuntimeError, match="[t -i]imeout"):
        fs.wait(["bad_key"], timedelta(seconds=0.25))
    fs.add("good_key", 1)
    fs.wait(["good_key"])
    # test_append / test_multi_set / test_multi_get
    assert fs.has_extended_api()
    fs.set("foo", "po")
    fs.append("foo", "tato")
    fs.append("bar", "po")
    fs.append("bar", "tato")
    assert fs.get("foo") == b"potato" and fs.get("bar") == b"potato"
    fs.multi_set(["foo", "bar"], ["po", "tato"])
    assert fs.get("foo") == b"po" and fs.get("bar") == b"tato"
    assert fs.multi_get(["foo", "bar"]) == [b"po", b"tato"]
    # test_clone
    b = fs.clone()
    assert isinstance(b, Store)
    fs.set("foo", "bar")
    assert b.get("foo") == b"bar"


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_store_queues(kind):
    """StoreTestBase: test_queues, test_queues_nonblocking, test_queues_bidirectional,
    test_queues_timeout. torch's FileStore has no queues (its tests skip): neither has
    jdist's, with torch's NotImplementedError."""
    store = MAKERS[kind]()
    if kind.endswith("file"):
        with pytest.raises(NotImplementedError, match="queue support is not implemented"):
            store.queue_push("test_queue_support", "1")
        return
    # test_queues
    assert not store.check(["foo"])
    assert store.queue_len("foo") == 0
    store.queue_push("foo", "1")
    store.queue_push("foo", "2")
    assert store.check(["foo"])
    assert store.queue_len("foo") == 2
    store.wait(["foo"])
    assert store.queue_pop("foo") == b"1"
    assert store.queue_pop("foo") == b"2"
    assert not store.check(["foo"])
    assert store.queue_len("foo") == 0
    # test_queues_nonblocking
    with pytest.raises(QueueEmptyError, match="empty"):
        store.queue_pop("foo", block=False)
    store.queue_push("foo", "a")
    assert store.queue_pop("foo", block=False) == b"a"
    # test_queues_bidirectional

    def worker_a():
        local = store.clone()
        local.queue_push("a", "a1")
        assert local.queue_pop("b") == b"b1"

    def worker_b():
        local = store.clone()
        assert local.queue_pop("a") == b"a1"
        local.queue_push("b", "b1")

    with ThreadPoolExecutor(max_workers=2) as pool:
        for fut in [pool.submit(worker_a), pool.submit(worker_b)]:
            fut.result(timeout=60)
    # test_queues_timeout
    store.set_timeout(timedelta(seconds=0.01))
    with pytest.raises(StoreTimeoutError, match="timeout"):
        store.queue_pop("non_existant")
    assert isinstance(QueueEmptyError("x"), StoreError)  # torch: a DistStoreError
    # a queue lives beside the keys: a plain key of the same name is untouched
    store.set("k", "v")
    store.queue_push("k", "x")
    assert store.get("k") == b"v" and store.queue_len("k") == 1


def test_clone_from_another_thread():
    """test_clone's purpose: a clone waits in its own thread while the original sets."""
    for make in (_hash_store, _tcp_store, _file_store):
        a = make()
        got = []

        def waiter(store=a.clone(), out=got):
            out.append(store.get("late"))

        t = threading.Thread(target=waiter)
        t.start()
        a.set("late", "x")
        t.join(30)
        assert got == [b"x"], make


def test_file_store_refcount():
    """FileStoreTest.test_refcount: the file goes when the last of its users does."""
    name = _tmpname()
    store = FileStore(name, 1)
    store2 = FileStore(name, 1)
    del store
    assert os.path.exists(name)
    del store2
    assert not os.path.exists(name)
    # and the path can be used again afterwards, as a fresh store
    again = FileStore(name, 1)
    assert again.num_keys() == 0
    again.close()


def test_prefix_store_get_underlying_store():
    """PrefixStoreTest.test_get_underlying_store."""
    tcp_store = TCPStore(host_name="localhost", port=0, world_size=1, is_master=True)
    hash_store = HashStore()
    file_store = FileStore(_tmpname(), world_size=1)
    for store in (tcp_store, hash_store, file_store):
        assert PrefixStore("prefix", store).underlying_store is store
    with pytest.raises(ValueError, match="store argument cannot be None"):
        PrefixStore("prefix", None)
    # PrefixTCPStoreTest.test_underlying_non_prefix_store
    store = PrefixStore("test_prefix", tcp_store)
    wrapped = PrefixStore("test_prefix", PrefixStore("test_prefix", store))
    assert store._underlying_non_prefix_store is tcp_store
    assert wrapped._underlying_non_prefix_store is tcp_store


def test_tcp_store_address_already_in_use():
    """TCPStoreTest.test_address_already_in_use (and test_agent_store's first half)."""
    port = free_port()
    store1 = TCPStore("localhost", port, 1, True)
    with pytest.raises(RuntimeError,
                       match=f"^The server socket has failed to listen on any local .*{port}"
                       ) as info:
        TCPStore("localhost", port, 1, True)
    assert isinstance(info.value, StoreListenError) and isinstance(info.value, OSError)
    assert info.value.errno is not None
    assert store1.libuvBackend is False  # departure: use_libuv is accepted and ignored
    TCPStore("localhost", 0, 1, True, use_libuv=True).close()


def test_tcp_store_repr():
    """TCPStoreTest.test_repr."""
    import re

    store1 = _tcp_store()
    client = (r"TCPStore\(client=TCPClient\(SocketImpl\(fd=\d+, addr=\[?localhost\]?:\d+, "
              r"remote=\[?localhost\]?:\d+\)\), ")
    assert re.match(client + r"server=TCPServer\(port=\d+\)\)", repr(store1)), repr(store1)
    store2 = TCPStore(store1.host, store1.port, world_size=2, is_master=False)
    assert re.match(client + r"server=<nullptr>\)", repr(store2)), repr(store2)
    store2.close()
    store1.close()


def test_tcp_store_take_over_listen_socket():
    """TCPStoreTest.test_take_over_listen_socket."""
    import socket

    listen_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen_sock.bind(("localhost", 0))
    addr, port, *_ = listen_sock.getsockname()
    listen_fd = listen_sock.detach()
    store = TCPStore(addr, port, 1, is_master=True, master_listen_fd=listen_fd)
    store.set("key", "value")
    assert store.get("key") == b"value"
    client = TCPStore(addr, port, 1)
    assert client.get("key") == b"value"
    client.close()
    store.close()


def test_tcp_store_timeout_on_missing_clients():
    """TCPStoreTest.test_store_timeout_on_missing_clients."""
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError,
                       match=r"Timed out after \d+ seconds waiting for clients. \d+/\d+ "
                             r"clients joined.") as info:
        TCPStore("localhost", 0, 2, True, timeout=timedelta(seconds=2))
    assert "1/2 clients joined" in str(info.value)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, StoreError)
    assert 1.5 < time.monotonic() - start < 30
    # without wait_for_workers, no exception
    TCPStore("localhost", 0, 2, True, timeout=timedelta(seconds=2),
             wait_for_workers=False).close()


def test_tcp_store_world_size_0_raises():
    """TCPStoreTest.test_world_size_0_raises (client and master), and torch's other
    world sizes: None and any negative number mean "not fixed"."""
    for is_master in (False, True):
        with pytest.raises(ValueError, match="TCPStore world size cannot be 0"):
            TCPStore("localhost", 0, world_size=0, is_master=is_master)
    for ws in (None, -1, -5):
        s = TCPStore("localhost", 0, world_size=ws, is_master=True)
        s.set("k", "v")
        assert s.get("k") == b"v"
        s.close()


def test_tcp_store_numkeys_delkeys():
    """TCPStoreTest.test_numkeys_delkeys, with jdist's count (the departure): torch
    starts at 1 (an internal key), jdist at 0, so every count is one lower."""
    fs = _tcp_store()
    assert fs.num_keys() == 0
    fs.add("key", 1)
    fs.add("key", 2)
    fs.add("key", 3)
    fs.set("key0", "value0")
    fs.add("key3", 1)
    fs.set("key1", "value1")
    assert fs.num_keys() == 4
    fs.delete_key("key")
    assert fs.num_keys() == 3
    fs.set_timeout(timedelta(seconds=2))
    with pytest.raises(RuntimeError):
        fs.get("key")
    fs.delete_key("key0")
    fs.delete_key("key3")
    assert fs.num_keys() == 1
    fs.set("key4", "value2")
    assert fs.num_keys() == 2
    assert fs.get("key1") == b"value1"
    assert fs.get("key4") == b"value2"


@pytest.mark.parametrize("world_size", [5, None])
def test_tcp_store_multi_worker(world_size):
    """TCPStoreTest.test_multi_worker_with_fixed_world_size / _nonfixed_world_size."""
    server = TCPStore("localhost", 0, world_size, True, wait_for_workers=False)
    server.set("key", "value")
    for index in range(world_size or 1):
        client = TCPStore("localhost", server.port, world_size=world_size,
                          timeout=timedelta(seconds=10))
        assert client.get("key") == b"value"
        client.set(f"new_key{index}", f"new_value{index}")
        assert client.compare_set(f"new_key{index}", f"new_value{index}",
                                  f"next_value{index}") == f"next_value{index}".encode()
        client.close()


def test_tcp_store_timeout_message():
    """RendezvousTCPTest.test_tcp_store_timeout_set / _doest_break_client: the timeout
    text starts as torch's ("wait timeout after 100ms, keys: ...") and the client
    stays usable."""
    store = _tcp_store()
    store.set_timeout(timedelta(seconds=0.1))
    with pytest.raises(StoreTimeoutError, match="wait timeout after 1[0-9][0-9]ms, keys: "
                                                "'the_key'"):
        store.get("the_key")
    store.set("the_key", "x")
    assert store.get("the_key") == b"x"


class _DummyStore(Store):
    """test_store.py's DummyStore: records the extended calls it gets."""

    def __init__(self):
        self.appends, self.multi_sets, self.multi_gets, self.multi_get_res = [], [], [], []
        super().__init__()

    def append(self, key, value):
        self.appends.append((key, value))

    def multi_get(self, keys):
        self.multi_gets.append(keys)
        return self.multi_get_res.pop(0)

    def multi_set(self, keys, values):
        self.multi_sets.append((keys, values))


def test_python_store_subclasses():
    """TestPythonStore: test_optional_methods_fail, test_has_extended_api_passthrough,
    _roundtrip, test_append_roundtrip, test_multi_get_roundtrip, test_multi_set_roundtrip."""

    class TestStore(Store):
        pass

    for store in (TestStore(), PrefixStore("p", TestStore())):
        assert not store.has_extended_api()
        with pytest.raises(RuntimeError, match="Not implemented."):
            store.append("foo", "bar")
        with pytest.raises(RuntimeError, match="Not implemented."):
            store.multi_get(["foo", "bar"])
        with pytest.raises(RuntimeError, match="Not implemented."):
            store.multi_set(["foo", "bar"], [b"v", b"v"])
    store = _DummyStore()
    prefix = PrefixStore("p", store)
    assert prefix.has_extended_api()
    prefix.append("foo", "bar")
    assert store.appends == [("p/foo", b"bar")]
    store.multi_get_res.append([b"x", b"y"])
    assert prefix.multi_get(["foo", "bar"]) == [b"x", b"y"]
    assert store.multi_gets == [["p/foo", "p/bar"]]
    prefix.multi_set(["foo", "bar"], [b"x", b"y"])
    assert store.multi_sets == [(["p/foo", "p/bar"], [b"x", b"y"])]
