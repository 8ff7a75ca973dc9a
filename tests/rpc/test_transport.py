"""One transport test suite, run against every registered scheme (tcp and inproc), and
tcp with its Unix socket for local peers turned off (plain TCP, as between machines)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from jdist.rpc.transport import CommClosedError, _tcp, get_transport, parse_address

ADDRS = {"tcp": "tcp://127.0.0.1:0", "tcp-only": "tcp://127.0.0.1:0", "inproc": "inproc://"}


class LoopThread:
    """An event loop running in a daemon thread (what the agent does)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@contextlib.contextmanager
def _listening(address):
    """(transport, server loop, client loop, listener, server comms, accepted event) for
    a listener on ``address``; all stopped and closed afterwards."""
    transport = get_transport(parse_address(address)[0])
    server, client = LoopThread(), LoopThread()
    accepted: list = []
    got = threading.Event()

    async def handler(comm):
        accepted.append(comm)
        got.set()

    listener = server.run(transport.listen(address, handler, max_message_bytes=1 << 20))
    try:
        yield transport, server, client, listener, accepted, got
    finally:
        server.run(listener.stop())
        for comm in accepted:
            comm.close()
        server.run(asyncio.sleep(0.01))
        server.stop()
        client.stop()


@pytest.fixture(params=sorted(ADDRS))
def pair(request, monkeypatch):
    """(transport, server loop, client loop, listener, queue of server comms)."""
    if request.param == "tcp-only":
        monkeypatch.setattr(_tcp, "LOCAL_SOCKETS", False)
    with _listening(ADDRS[request.param]) as p:
        yield p


def _connect(pair_):
    transport, server, client, listener, accepted, got = pair_
    comm = client.run(transport.connect(listener.address, timeout=5.0,
                                        max_message_bytes=1 << 20))
    assert got.wait(5)
    return comm, accepted[-1]


def test_listener_address_is_concrete(pair):
    listener = pair[3]
    scheme, loc = parse_address(listener.address)
    assert scheme in ADDRS
    if scheme == "tcp":
        hostport, local = _tcp.split_local(loc)
        assert hostport.startswith("127.0.0.1:") and not hostport.endswith(":0")
        assert (local is not None) == _tcp.LOCAL_SOCKETS


@pytest.mark.parametrize("local", [True, False], ids=["local-sockets", "tcp-only"])
def test_which_socket_local_peers_and_other_machines_use(local, monkeypatch):
    """With local sockets, a peer on this machine connects to the listener's Unix socket,
    and an address whose local socket does not exist here (a peer on another machine)
    is reached by TCP; without them, every connection is TCP."""
    local = local and _tcp.LOCAL_SOCKETS  # (abstract Unix sockets are Linux's)
    monkeypatch.setattr(_tcp, "LOCAL_SOCKETS", local)
    with _listening("tcp://127.0.0.1:0") as (transport, server, client, listener, accepted,
                                            got):
        assert ("#local=jdist-rpc-" in listener.address) == local
        elsewhere = listener.address.split("#local=")[0] + "#local=jdist-rpc-" + "0" * 32
        expect = [(listener.address, socket.AF_UNIX if local else socket.AF_INET),
                  (elsewhere, socket.AF_INET)]
        for address, family in expect:
            got.clear()
            comm_c = client.run(transport.connect(address, timeout=5.0,
                                                  max_message_bytes=1 << 20))
            assert got.wait(5)
            comm_s = accepted[-1]
            assert comm_c.sock.family == comm_s.sock.family == family
            assert comm_c.peer.startswith(
                "local socket jdist-rpc-" if family == socket.AF_UNIX else "127.0.0.1:")
            comm_c.send([b"ping", b"x" * 300_000])
            assert [len(f) for f in server.run(comm_s.recv())] == [4, 300_000]
            comm_s.send([b"pong"])
            assert [bytes(f) for f in client.run(comm_c.recv())] == [b"pong"]
            comm_c.close()


def test_roundtrip_frames_both_directions(pair):
    comm_c, comm_s = _connect(pair)
    _, server, client, *_ = pair
    arr = np.arange(100_000, dtype=np.float32)  # 400 kB: bigger than the staging buffer
    frames = [b"header", b"", memoryview(arr).cast("B")]
    comm_c.send(frames)
    got = server.run(comm_s.recv())
    assert [bytes(f) for f in got[:2]] == [b"header", b""]
    np.testing.assert_array_equal(np.frombuffer(got[2], np.float32), arr)
    # writable and independent of the sender, so numpy arrays built on it are too
    assert not memoryview(got[2]).readonly
    np.frombuffer(got[2], np.float32)[:] = -1
    assert arr[0] == 0
    comm_s.send([b"reply", b"x" * 10])
    back = client.run(comm_c.recv())
    assert [bytes(f) for f in back] == [b"reply", b"x" * 10]


def test_many_messages_keep_order(pair):
    comm_c, comm_s = _connect(pair)
    server = pair[1]
    for i in range(200):
        comm_c.send([str(i).encode(), bytes(i)])

    async def read_all():
        return [await comm_s.recv() for _ in range(200)]

    msgs = server.run(read_all())
    assert [int(m[0]) for m in msgs] == list(range(200))
    assert [len(m[1]) for m in msgs] == list(range(200))


def test_concurrent_senders_keep_messages_whole(pair):
    comm_c, comm_s = _connect(pair)
    server = pair[1]
    payload = {t: bytes([t]) * 50_000 for t in range(4)}

    def sender(t):
        for _ in range(20):
            comm_c.send([bytes([t]), payload[t]])

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()

    async def read_all():
        return [await comm_s.recv() for _ in range(80)]

    msgs = server.run(read_all(), timeout=20)
    for t in threads:
        t.join()
    for tag, body in msgs:
        assert bytes(body) == payload[tag[0]]


def test_oversized_message_refused_and_closed(pair):
    comm_c, comm_s = _connect(pair)
    server = pair[1]
    try:
        comm_c.send([b"x" * ((1 << 20) + 1)])
    except CommClosedError:
        pass  # the receiver may already have hung up
    with pytest.raises(CommClosedError, match="max_frame_bytes"):
        server.run(comm_s.recv())
    assert comm_s.closed


def test_close_ends_pending_recv_and_send_fails(pair):
    comm_c, comm_s = _connect(pair)
    _, server, client, *_ = pair
    fut = asyncio.run_coroutine_threadsafe(comm_s.recv(), server.loop)
    comm_c.close()
    with pytest.raises(CommClosedError):
        fut.result(5)
    with pytest.raises(CommClosedError):
        comm_c.send([b"late"])
    comm_c.close()  # idempotent


def test_connect_to_nothing_fails_fast(pair):
    transport, _, client, listener, *_ = pair
    scheme = parse_address(listener.address)[0]
    dead = "tcp://127.0.0.1:1" if scheme == "tcp" else "inproc://nobody-listens"
    with pytest.raises(CommClosedError, match="nobody|connect"):
        client.run(transport.connect(dead, timeout=2.0, max_message_bytes=100))


def test_parse_address_rejects_missing_scheme():
    with pytest.raises(ValueError, match="tcp://127.0.0.1:29500"):
        parse_address("127.0.0.1:29500")


def test_address_of_another_scheme_is_refused():
    tcp, inproc = get_transport("tcp"), get_transport("inproc")

    async def nothing(comm):
        return None

    with pytest.raises(ValueError, match="InprocTransport cannot listen on 'tcp://"):
        asyncio.run(inproc.listen("tcp://127.0.0.1:0", nothing, max_message_bytes=1024))
    with pytest.raises(ValueError, match="TCPTransport cannot listen on 'inproc://x'"):
        asyncio.run(tcp.listen("inproc://x", nothing, max_message_bytes=1024))
    with pytest.raises(ValueError, match="TCPTransport cannot connect to 'inproc://x'"):
        asyncio.run(tcp.connect("inproc://x", timeout=1.0, max_message_bytes=1024))


def test_unknown_scheme_lists_known():
    with pytest.raises(ValueError, match="inproc.*tcp"):
        get_transport("carrier-pigeon")


def test_start_receiving_delivers_in_order_then_closes(pair):
    comm_c, comm_s = _connect(pair)
    server = pair[1]
    got, closed = [], threading.Event()
    reasons = []

    async def start():
        comm_s.start_receiving(got.append, lambda why: (reasons.append(why), closed.set()))

    comm_c.send([b"early"])  # may arrive before the callbacks are installed
    server.run(start())
    for i in range(50):
        comm_c.send([str(i).encode(), b"x" * (i * 1000)])
    comm_c.close()
    assert closed.wait(10)
    assert [bytes(m[0]) for m in got] == [b"early"] + [str(i).encode() for i in range(50)]
    assert [len(m[1]) for m in got[1:]] == [i * 1000 for i in range(50)]
    assert len(reasons) == 1


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def _receiving(pair_):
    """A connected pair whose server side delivers to ``got`` as ``(reading thread id,
    first frame)`` and sets ``closed`` when the peer goes."""
    scheme = parse_address(pair_[3].address)[0]
    comm_c, comm_s = _connect(pair_)
    got, closed = [], threading.Event()

    async def start():
        comm_s.start_receiving(lambda m: got.append((threading.get_ident(), bytes(m[0]))),
                               lambda why: closed.set())

    pair_[1].run(start())
    return scheme, comm_c, comm_s, got, closed


def test_a_failed_send_still_delivers_what_the_peer_sent_before_it_closed(pair):
    """The peer answers (say, a refusal) and closes while this side still sends: the
    send fails (at once on a Unix socket, after the reset on TCP), and the answer is not
    lost with it."""
    comm_c, comm_s = _connect(pair)
    comm_s.send([b"DENIED"])
    comm_s.close()
    with pytest.raises(CommClosedError):  # sent before this side's loop read the answer
        for _ in range(100):
            comm_c.send([b"x" * 65536])
            time.sleep(0.01)
    assert [bytes(f) for f in pair[2].run(comm_c.recv())] == [b"DENIED"]
    with pytest.raises(CommClosedError):
        pair[2].run(comm_c.recv())


def test_wait_until_sleeps_on_the_socket_and_reads_in_the_waiting_thread(pair):
    """A thread waiting for a message that comes later sleeps in poll(2) and reads it
    itself (tcp; inproc returns at once); it wakes for a message, notices ``done()`` set
    elsewhere within a slice, returns after its bound when nothing comes, and a closed
    peer still closes the comm."""
    scheme, comm_c, comm_s, got, closed = _receiving(pair)
    me = threading.get_ident()
    late = threading.Timer(0.1, lambda: comm_c.send([b"late"]))
    late.start()
    t0 = time.monotonic()
    comm_s.wait_until(lambda: len(got) >= 1, 10.0)
    late.join()
    assert _wait_for(lambda: len(got) == 1)
    assert (got[0][0] == me) == (scheme == "tcp")
    if scheme != "tcp":
        return
    assert 0.09 <= time.monotonic() - t0 < 5.0  # woken by the message, not the bound
    t0 = time.monotonic()
    comm_s.wait_until(lambda: False, 0.05)  # nothing comes: returns after its bound
    assert 0.04 <= time.monotonic() - t0 < 2.0
    flag = []
    threading.Timer(0.05, lambda: flag.append(1)).start()
    t0 = time.monotonic()
    comm_s.wait_until(lambda: bool(flag), 10.0)  # done() set by another thread
    assert time.monotonic() - t0 < 2.0  # noticed within slices, not after the bound
    comm_c.send([b"after"])
    assert _wait_for(lambda: len(got) == 2) and got[1][0] != me  # the loop reads again
    comm_c.close()
    comm_s.wait_until(closed.is_set, 10.0)
    assert closed.wait(10)


def test_poll_until_reads_in_the_polling_thread_then_hands_back_to_the_loop(pair):
    """A thread polling a comm gets the messages that arrive meanwhile (tcp; inproc cannot
    be polled and returns at once); afterwards, and for anything left unread, the loop
    delivers again; a peer closing while polled still closes the comm."""
    scheme, comm_c, comm_s, got, closed = _receiving(pair)
    me = threading.get_ident()
    polling = threading.Event()
    if scheme != "tcp":
        polling.set()  # poll_until returns at once, without asking done()
    sender = threading.Thread(target=lambda: polling.wait(10) and comm_c.send([b"a"]))
    sender.start()
    comm_s.poll_until(lambda: polling.set() or len(got) >= 1, 10.0)  # tcp: a arrives here
    sender.join(10)
    assert _wait_for(lambda: len(got) == 1)
    comm_s.poll_until(lambda: False, 0.001)  # nothing comes: returns after its bound
    comm_c.send([b"b"])
    assert _wait_for(lambda: len(got) == 2)  # the loop reads again after a poll
    sent = []

    def send_c_then_stop():
        # sent while the socket is muted (tcp: out of the loop's epoll set, white-box
        # checked) and never read by the poller: the loop gets it once re-armed
        if not sent:
            comm_c.send([b"c"])
            sent.append([fd for fd, _ in comm_s._epoll.poll(0.05)] if scheme == "tcp" else [])
        return True

    comm_s.poll_until(send_c_then_stop, 10.0)
    if not sent:
        comm_c.send([b"c"])
    elif scheme == "tcp":
        assert comm_s.sock.fileno() not in sent[0]
    assert _wait_for(lambda: len(got) == 3)
    assert [p for _, p in got] == [b"a", b"b", b"c"]
    threads = [t for t, _ in got]
    assert threads[1] != me and threads[2] != me
    assert threads[0] == me if scheme == "tcp" else threads[0] != me
    comm_c.close()
    comm_s.poll_until(closed.is_set, 10.0)
    assert closed.wait(10)
    with pytest.raises(CommClosedError):
        comm_s.send([b"late"])
