"""Every store method on every store kind, checked against torch's stores as the oracle."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest

from jdist.errors import StoreError, StoreTimeoutError
from jdist.store import FileStore, HashStore, PrefixStore, TCPStore
from tests.helpers import run_procs

KINDS = ["hash", "file", "tcp", "prefix"]


@pytest.fixture(params=KINDS)
def pair(request, tmp_path):
    """Two handles on one store (for TCP: master + a client; for files: two openers)."""
    kind = request.param
    if kind == "hash":
        s = HashStore()
        yield kind, s, s
    elif kind == "file":
        path = str(tmp_path / "store")
        a, b = FileStore(path), FileStore(path)
        yield kind, a, b
        a.close()
        b.close()
        assert not os.path.exists(path), "the last FileStore user must delete the file"
    elif kind == "tcp":
        m = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, auth_token="t0k")
        c = TCPStore("127.0.0.1", m.port, timeout=10, auth_token="t0k")
        yield kind, m, c
        c.close()
        m.close()
    else:
        base = HashStore()
        yield kind, PrefixStore("job", base), PrefixStore("job", base)


def _torch_oracle(kind):
    import torch.distributed as dist

    base = dist.HashStore()
    return dist.PrefixStore("job", base) if kind == "prefix" else base


# A script of calls; results must equal torch's (quirks included).
_SCRIPT = [
    ("set", "a", "x"), ("get", "a"), ("set", "a", b"\x00\xff"), ("get", "a"),
    ("add", "n", 5), ("add", "n", -7), ("get", "n"), ("add", "fresh", 0),
    ("set", "s1", "3x"), ("add", "s1", 1), ("set", "s2", " 7"), ("add", "s2", 1),
    ("compare_set", "m1", "", "v"), ("get", "m1"),
    ("compare_set", "m2", "zz", "v"), ("check", ["m2"]),
    ("compare_set", "m1", "v", "w"), ("compare_set", "m1", "v", "q"), ("get", "m1"),
    ("check", ["a", "n"]), ("check", ["a", "nope"]), ("check", []),
    ("delete_key", "a"), ("delete_key", "a"), ("check", ["a"]),
    ("append", "ap", "1"), ("append", "ap", b"2"), ("get", "ap"),
    ("multi_set", ["k1", "k2"], ["v1", b"v2"]), ("multi_get", ["k2", "k1"]),
    ("set", "", "empty key"), ("get", ""), ("wait", ["k1", "n"]),
]


def test_methods_match_torch(pair):
    kind, s, other = pair
    ref = _torch_oracle(kind)
    for op, *args in _SCRIPT:
        ours = getattr(s, op)(*args)
        theirs = getattr(ref, op)(*args)
        assert ours == theirs, (op, args, ours, theirs)
        # every handle sees the same state
        if op == "get":
            assert other.get(*args) == theirs
    assert sorted(s.list_keys()) == sorted(ref.list_keys())
    assert s.num_keys() == ref.num_keys()
    assert sorted(other.list_keys()) == sorted(ref.list_keys())


def test_add_on_non_integer_is_a_value_error(pair):
    _, s, other = pair
    s.set("word", "hello")
    with pytest.raises(ValueError, match="word'.*not an integer"):
        other.add("word", 1)
    assert s.get("word") == b"hello"  # still usable afterwards
    assert other.add("ctr", 2) == 2


def test_bad_arguments_are_refused(pair):
    _, s, _ = pair
    with pytest.raises(TypeError, match="values must be bytes or str"):
        s.set("k", 5)
    with pytest.raises(TypeError, match="keys must be str"):
        s.get(b"k")
    with pytest.raises(TypeError, match="list of keys"):
        s.wait("abc")
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        s.multi_set(["a", "b"], ["x"])


def test_blocking_get_sees_a_later_set_and_timeouts_name_keys(pair):
    kind, s, other = pair
    s.set_timeout(timedelta(seconds=5))
    timer = threading.Timer(0.2, lambda: other.set("late", "v"))
    timer.start()
    t0 = time.monotonic()
    assert s.get("late") == b"v"
    assert time.monotonic() - t0 < 4.0
    timer.join()
    s.set_timeout(0.3)
    assert s.timeout == timedelta(seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"wait timeout after \d+ms, keys: '(job/)?nope'"):
        s.get("nope")
    assert 0.25 < time.monotonic() - t0 < 3.0
    with pytest.raises(TimeoutError, match=r"x1', '(job/)?x2'"):  # a TimeoutError
        s.wait(["late", "x1", "x2"], timedelta(seconds=0.2))
    with pytest.raises(StoreTimeoutError):
        s.multi_get(["late", "x3"])
    s.wait(["late"], 0.2)
    with pytest.raises(ValueError, match=">= 0"):
        s.wait(["late"], -1)


def test_prefix_store_keys_and_views():
    base = HashStore()
    p = PrefixStore("pre", base)
    nested = PrefixStore("a", PrefixStore("b", base))
    p.set("k", "v")
    nested.set("x", "1")
    base.set("other", "o")
    assert base.get("pre/k") == b"v"
    assert base.get("b/a/x") == b"1"
    assert p.list_keys() == ["k"]
    assert nested.list_keys() == ["x"]
    assert p.num_keys() == 3  # torch counts the underlying store's keys
    assert p.underlying_store is base
    p.set_timeout(0.1)
    assert base.timeout == timedelta(seconds=0.1)
    with pytest.raises(StoreTimeoutError, match="'pre/missing'"):
        p.get("missing")


def test_file_store_world_size_and_close(tmp_path):
    path = str(tmp_path / "fs")
    a = FileStore(path, world_size=2)
    b = FileStore(path, world_size=2)
    c = FileStore(path, world_size=2)  # a third user is not refused (torch neither)
    a.set("k", "v")
    a.close()
    c.close()
    assert b.get("k") == b"v"
    with pytest.raises(StoreError, match="closed"):
        a.get("k")
    b.close()
    assert not os.path.exists(path)
    fresh = FileStore(path, world_size=0)  # torch accepts 0 too; the old keys are gone
    assert not fresh.check(["k"]) and fresh.num_keys() == 0
    fresh.close()


def _count_across_processes(path, port, n):
    """Each process adds 1 n times to a FileStore and a TCPStore counter."""
    fs = FileStore(path)
    tcp = TCPStore("127.0.0.1", port, timeout=30)
    for _ in range(n):
        fs.add("ctr", 1)
        tcp.add("ctr", 1)
    fs.set(f"done{os.environ['RANK']}", "1")
    fs.wait(["done0", "done1"], 30)
    out = (int(fs.get("ctr")), int(tcp.get("ctr")))
    tcp.set(f"read{os.environ['RANK']}", "1")
    return out


def test_counters_are_exact_across_processes(tmp_path):
    token = "proc-token"
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30, auth_token=token)
    path = str(tmp_path / "shared")
    keep = FileStore(path)  # keeps the file alive until both ranks are done
    res = run_procs(_count_across_processes, 2, args=(path, master.port, 200), timeout=90,
                    env={"JDIST_AUTH_TOKEN": token})
    assert res == [(400, 400), (400, 400)]
    assert int(keep.get("ctr")) == 400
    assert int(master.get("ctr")) == 400
    keep.close()
    master.close()
