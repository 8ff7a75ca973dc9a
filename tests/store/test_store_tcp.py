"""TCPStore server: concurrency, authentication, hostile clients, size cap, lifetime."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import pytest

from jdist.errors import (
    StoreAuthError,
    StoreError,
    StoreTimeoutError,
    StoreValueTooLargeError,
)
from jdist.store import TCPStore, free_port
from jdist.store import _wire as wire

TOKEN = "secret-1"


@pytest.fixture
def master():
    m = TCPStore("127.0.0.1", 0, is_master=True, timeout=20, auth_token=TOKEN)
    yield m
    m.close()


def _client(port, **kw):
    kw.setdefault("timeout", 20)
    kw.setdefault("auth_token", TOKEN)
    return TCPStore("127.0.0.1", port, **kw)


def test_port_zero_and_join_of_workers(master):
    assert master.port > 0  # port=0 picked a free one
    port = free_port()
    m_box = {}
    t = threading.Thread(target=lambda: m_box.setdefault("m", TCPStore(
        "127.0.0.1", port, world_size=3, is_master=True, timeout=20, auth_token=TOKEN)))
    t.start()  # the master waits in its constructor until 3 store users joined
    time.sleep(0.05)
    assert t.is_alive()
    a, b = _client(port), _client(port)
    t.join(10)
    assert not t.is_alive()
    assert m_box["m"].port == port
    a.set("x", "1")
    assert b.get("x") == b"1"
    with pytest.raises(StoreTimeoutError, match="waited .* for 2 store users"):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.3, auth_token=TOKEN)
    with pytest.raises(ValueError, match="port=0"):
        TCPStore("127.0.0.1", 0, auth_token=TOKEN)


def test_free_port_is_below_the_ephemeral_range_and_bindable(monkeypatch):
    from jdist.store import _port

    start = _port._ephemeral_start()
    if start is None:  # not Linux: only the OS's pick exists
        assert free_port() > 0
        return
    ports = [free_port() for _ in range(40)]
    assert all(_port._LOWEST <= p < start for p in ports), (ports, start)
    assert len(set(ports)) > 30  # drawn at random, not one port again and again
    with socket.socket() as s:  # free: a server can bind it
        s.bind(("127.0.0.1", ports[0]))
        taken = ports[0]
        monkeypatch.setattr(_port, "_RANDOM", type("R", (), {
            "randrange": staticmethod(lambda lo, hi: taken)})())
        # every draw is the bound port: it is never returned, the OS picks instead
        assert free_port() >= start
    monkeypatch.setattr(_port, "_ephemeral_start", lambda: None)
    assert free_port() >= start  # range unknown: bind(0)


def test_eight_clients_adding_concurrently_give_the_exact_total(master):
    clients = [_client(master.port) for _ in range(8)]
    errors = []

    def work(c):
        try:
            for _ in range(500):
                c.add("total", 1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert int(master.get("total")) == 4000
    assert master.add("total", 0) == 4000


def test_seventy_blocked_clients_do_not_block_the_server(master):
    clients = [_client(master.port) for _ in range(70)]
    got = [None] * 70

    def blocked(i):
        got[i] = clients[i].get("go")

    threads = [threading.Thread(target=blocked, args=(i,)) for i in range(70)]
    for t in threads:
        t.start()
    other = _client(master.port)
    # while 70 clients wait, a 71st is served at once
    t0 = time.monotonic()
    other.set("unrelated", "1")
    assert other.get("unrelated") == b"1"
    assert time.monotonic() - t0 < 5
    master.set("go", "now")
    for t in threads:
        t.join(30)
    assert got == [b"now"] * 70
    # a clone serves another thread while the original is blocked in get
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("v", other.get("later")))
    th.start()
    twin = other.clone()
    twin.set("later", "L")
    th.join(10)
    assert box["v"] == b"L"


def test_secrets_are_checked_both_ways(master, monkeypatch):
    monkeypatch.delenv("JDIST_AUTH_TOKEN", raising=False)
    with pytest.raises(StoreAuthError, match="refused this client's secret"):
        _client(master.port, auth_token="wrong")
    with pytest.raises(StoreAuthError, match="requires a shared secret"):
        _client(master.port, auth_token=None)
    open_master = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)  # no-secret mode
    with pytest.raises(StoreAuthError, match="has no shared secret"):
        _client(open_master.port)
    TCPStore("127.0.0.1", open_master.port, timeout=5).set("k", "v")
    assert open_master.get("k") == b"v"
    monkeypatch.setenv("JDIST_AUTH_TOKEN", TOKEN)  # the environment supplies the token
    env_client = TCPStore("127.0.0.1", master.port, timeout=5)
    env_client.set("via-env", "1")
    assert master.get("via-env") == b"1"


def _raw(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s, s.recv(wire.HELLO_LEN)


def _raw_authed(port):
    s, hello = _raw(port)
    cn = os.urandom(32)
    s.sendall(wire.MAGIC_CLIENT + b"\x01" + cn + wire.mac(TOKEN.encode(), b"client",
                                                          hello[6:], cn))
    verdict = s.recv(wire.VERDICT_LEN)
    assert verdict[0] == 1
    return s


def test_garbage_and_dying_clients_leave_the_server_serving(master):
    good = _client(master.port)
    good.set("k", "v")
    waiter_box = {}
    waiter = threading.Thread(target=lambda: waiter_box.setdefault("v", good.clone().get("w")))
    waiter.start()
    rng = __import__("random").Random(0)
    hostile = []
    for _ in range(5):  # random bytes before authenticating
        s, _ = _raw(master.port)
        s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4000))))
        hostile.append(s)
    s, _ = _raw(master.port)  # connects and says nothing
    hostile.append(s)
    s = _raw_authed(master.port)  # authenticated, then garbage msgpack
    s.sendall((7).to_bytes(4, "big") + b"\xc1\xc1\xc1\xc1\xc1\xc1\xc1")
    hostile.append(s)
    s = _raw_authed(master.port)  # authenticated, well-formed frame, nonsense request
    body = msgpack.packb([99, "x"])
    s.sendall(len(body).to_bytes(4, "big") + body)
    hostile.append(s)
    s = _raw_authed(master.port)  # dies half-way through a frame
    body = msgpack.packb([wire.Op.SET, "half", b"x" * 1000])
    s.sendall(len(body).to_bytes(4, "big") + body[:500])
    s.close()
    s = _raw_authed(master.port)  # announces a 2 GiB frame
    s.sendall((2**31).to_bytes(4, "big") + b"x" * 100)
    hostile.append(s)
    s = _raw_authed(master.port)  # parks a wait, then vanishes
    body = msgpack.packb([wire.Op.WAIT, ["never"], None])
    s.sendall(len(body).to_bytes(4, "big") + body)
    s.close()
    good.set("big", b"b" * 2_000_000)
    s = _raw_authed(master.port)  # floods requests and never reads the answers
    body = msgpack.packb([wire.Op.GET, "big", None])
    s.sendall((len(body).to_bytes(4, "big") + body) * 2000)
    hostile.append(s)
    # the server still serves everyone else
    assert good.get("k") == b"v"
    assert good.add("c", 3) == 3
    assert not good.check(["half"])
    fresh = _client(master.port)
    fresh.set("w", "done")
    waiter.join(10)
    assert waiter_box["v"] == b"done"
    for s in hostile:
        s.close()
    assert _client(master.port).get("k") == b"v"


def test_oversized_values_are_refused(master):
    small = _client(master.port, max_value_bytes=1000)
    with pytest.raises(StoreValueTooLargeError, match="1001 bytes exceeds max_value_bytes=1000"):
        small.set("big", b"x" * 1001)
    small.set("ok", b"x" * 1000)
    capped = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, auth_token=TOKEN,
                      max_value_bytes=10_000)
    eager = _client(capped.port, max_value_bytes=10_000_000)
    with pytest.raises(StoreValueTooLargeError, match="refused the request"):
        eager.set("big", b"x" * 1_000_000)
    eager.set("after", "1")  # reconnects and works again
    assert capped.get("after") == b"1"
    assert not capped.check(["big"])


def test_binds_to_the_given_host_only_and_stops_with_its_master():
    m = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token=TOKEN)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", m.port), timeout=2).close()
    port = m.port
    c = _client(port)
    m.close()
    del m
    import gc

    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the server kept listening after its master store was closed")
    t0 = time.monotonic()
    for _ in range(2):  # the lost connection, then a failed reconnect: both fail fast
        with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
            c.set("k", "v")
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=f"127.0.0.1:{port}.*MASTER_ADDR"):
        TCPStore("127.0.0.1", port, timeout=0.5, auth_token=TOKEN)
    assert time.monotonic() - t0 < 5


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:"))


def test_a_flood_of_unauthenticated_connections_costs_little(master):
    """1000 connections that never authenticate (half of them stop half-way through
    the handshake): the server in this process grows by < 20 MB and serves its clients,
    a parked wait included."""
    good = _client(master.port)
    good.set("k", "v")
    waiter_box = {}
    waiter = threading.Thread(target=lambda: waiter_box.setdefault("v", good.clone().get("w")))
    waiter.start()
    before = _rss_mb()
    flood = []
    for i in range(1000):
        s, hello = _raw(master.port)
        if i % 2:  # the magic and half a nonce, then silence
            s.sendall(wire.MAGIC_CLIENT + b"\x01" + os.urandom(16))
        flood.append(s)
    grown = _rss_mb() - before
    assert good.get("k") == b"v"
    fresh = _client(master.port)
    fresh.set("w", "done")
    waiter.join(10)
    assert waiter_box["v"] == b"done"
    for s in flood:
        s.close()
    assert grown < 20, f"{grown:.1f} MB for 1000 unauthenticated connections"
