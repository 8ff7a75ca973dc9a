"""Security on the real TCP transport: secrets, garbage, oversized frames, bad headers."""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import socket
import threading

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.errors import RpcAuthError
from jdist.rpc import _protocol as P
from jdist.rpc._auth import client_handshake, mac
from jdist.rpc.transport import CommClosedError, encode_prefix, get_transport
from jdist.rpc.transport._tcp import LOCAL_SOCKETS, split_host_port, split_local
from tests.rpc.conftest import SECRET, make_agents, stop_all


class Evil:
    """Unpickling this creates a file: proof that a payload was (or was not) unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_call_frames(path):
    return P.encode(P.Call(1, "builtins.print"), pickle.dumps(Evil(path)))


class Client:
    """A raw client on its own loop thread, speaking frames to an agent."""

    def __init__(self, address, max_bytes=1 << 20):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.comm = self.run(get_transport("tcp").connect(address, timeout=5,
                                                          max_message_bytes=max_bytes))

    def run(self, coro, timeout=10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def recv(self, timeout=10):
        return self.run(self.comm.recv(), timeout)

    def close(self):
        self.comm.close()
        self.run(asyncio.sleep(0.01))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def tcp_agents():
    agents = make_agents(2, transport="tcp", max_frame_bytes=1 << 16)
    yield agents
    stop_all(agents, graceful=False)


def still_serving(agents):
    return agents[0].rpc_async("w1", sum, ([1, 2, 3],)).wait(10) == 6


def test_listens_on_loopback_by_default(tcp_agents):
    assert all(a.address.startswith("tcp://127.0.0.1:") for a in tcp_agents)


def test_evil_payload_is_live(tmp_path):
    path = tmp_path / "pwned-locally"
    pickle.loads(pickle.dumps(Evil(str(path)))).close()
    assert path.exists()  # so its absence below proves nothing was unpickled


def test_wrong_secret_refused_before_unpickling(tcp_agents, tmp_path):
    target = tcp_agents[1].address
    # 1) a client with the wrong secret cannot even trust the server ...
    c = Client(target)
    with pytest.raises(RpcAuthError, match="does not know this job's secret"):
        c.run(client_handshake(c.comm, b"wrong", 0, target))
    c.close()
    # 2) ... and one that answers the challenge wrongly and sends a payload anyway is
    # told DENIED and cut off; the payload is never unpickled
    path = tmp_path / "pwned-after-bad-auth"
    c = Client(target)
    nonce = os.urandom(32)
    c.comm.send([b"JDIST-HELLO", nonce, b"0"])
    tag, nonce_s, _ = c.recv()
    assert bytes(tag) == b"JDIST-CHALLENGE"
    c.comm.send([b"JDIST-AUTH", mac(b"wrong", b"client", bytes(nonce_s), nonce, b"0")])
    try:
        c.comm.send(evil_call_frames(str(path)))
    except CommClosedError:
        pass
    assert [bytes(f) for f in c.recv()] == [b"JDIST-DENIED"]
    with pytest.raises(CommClosedError):
        c.recv()
    c.close()
    # 3) a client that skips the handshake and sends a call straight away
    path2 = tmp_path / "pwned-no-auth"
    c = Client(target)
    c.comm.send(evil_call_frames(str(path2)))
    with pytest.raises(CommClosedError):
        c.recv()
    c.close()
    assert not path.exists() and not path2.exists()
    assert still_serving(tcp_agents)


def _raw_connections(address: str) -> list:
    """Plain sockets to an agent: its TCP port and, where it has one, its local socket."""
    loc, local = split_local(address[len("tcp://"):])
    host, port = split_host_port(loc)
    out = [lambda: socket.create_connection((host, port), timeout=5)]
    if local is not None:
        def unix():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect("\0" + local)
            return s
        out.append(unix)
    return out


def test_random_bytes_and_truncated_frames_do_not_hurt(tcp_agents):
    connections = _raw_connections(tcp_agents[1].address)
    assert len(connections) == (2 if LOCAL_SOCKETS else 1)
    for blob, connect in itertools.product(
            [os.urandom(5000), b"JR\x01\x00\x00\x00\x00\x02" + b"\x00" * 7,
             encode_prefix([b"x" * 100]) + b"x" * 10, b"GET / HTTP/1.1\r\n\r\n"],
            connections):
        with connect() as s:
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except (ConnectionResetError, TimeoutError):
                pass
    assert still_serving(tcp_agents)


def test_oversized_frame_refused_and_connection_closed(tcp_agents):
    c = Client(tcp_agents[1].address)
    c.run(client_handshake(c.comm, SECRET, 0, tcp_agents[1].address))
    try:
        c.comm.send([msgpack.packb([1, 1, "f"]), b"x" * (1 << 17)])  # cap is 64 KiB
    except CommClosedError:
        pass
    with pytest.raises(CommClosedError):
        c.recv()
    c.close()
    assert still_serving(tcp_agents)


def test_unknown_kind_and_bad_headers_answered_not_fatal(tcp_agents):
    c = Client(tcp_agents[1].address)
    c.run(client_handshake(c.comm, SECRET, 0, tcp_agents[1].address))
    c.comm.send([msgpack.packb([99, 7])])  # unknown kind: answered with a Failure for id 7
    reply = c.recv()
    assert P.decode_header(reply) == P.Failure(7)
    assert "unknown message kind 99" in pickle.loads(reply[1])["repr"]
    c.comm.send([b"\xc1 not msgpack"])  # no id to answer: dropped, connection kept
    c.comm.send([msgpack.packb([P.Kind.CALL, 8, "f"]), b"not a pickle"])
    reply = c.recv()
    assert P.decode_header(reply) == P.Failure(8)
    assert "could not decode the call" in pickle.loads(reply[1])["repr"]
    c.close()
    assert still_serving(tcp_agents)


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.binary(max_size=64),
    st.builds(lambda xs: msgpack.packb(xs),
              st.lists(st.one_of(st.integers(-5, 10), st.text(max_size=3),
                                 st.lists(st.integers(-2**63, 2**63 - 1), max_size=3),
                                 st.none()), max_size=7))))
def test_header_decoder_fuzz(blob):
    try:
        P.decode_header([blob, b"payload"])
    except P.ProtocolError:
        pass


def test_server_raises_the_frame_cap_before_it_says_ok():
    """The client sends its first request as soon as it reads OK: the server's cap must
    already be the post-handshake one (a 6.7 KB RemoteModule constructor call was
    refused as 'exceeds max_frame_bytes=4096' when the reader won that race)."""
    import asyncio

    from jdist.rpc import _auth

    key, nonce_c = b"k" * 32, b"n" * 32
    sent, events = [], []

    class FakeComm:
        def send(self, frames):
            sent.append([bytes(f) for f in frames])
            events.append(("send", bytes(frames[0])))

        def set_max_message_bytes(self, n):
            events.append(("cap", n))

        def close(self):
            events.append(("close",))

        async def recv(self):
            if not sent:
                return [_auth._HELLO, nonce_c, b"1"]
            nonce_s = sent[-1][1]
            return [_auth._AUTH, _auth.mac(key, b"client", nonce_s, nonce_c, b"1")]

    peer = asyncio.run(_auth.server_handshake(FakeComm(), key, 1 << 20))
    assert peer == 1
    assert events == [("send", _auth._CHALLENGE), ("cap", 1 << 20), ("send", _auth._OK)]
