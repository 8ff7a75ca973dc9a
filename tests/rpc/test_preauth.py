"""Connections that have not authenticated cost kilobytes and a bounded log (issue 41,
item 5): the reader's staging buffer is sized by the message cap in force (the
handshake's before authentication), at most ``MAX_HANDSHAKES`` connections may be
authenticating at once (a new one closes the oldest, so a flood cannot lock out a peer),
and refusals are logged at most once per interval with a count of the rest.
"""

from __future__ import annotations

import logging
import resource
import time

import pytest

from jdist.rpc._auth import HANDSHAKE_MAX_BYTES
from jdist.rpc._gate import MAX_HANDSHAKES, HandshakeGate
from jdist.rpc.transport._framing import FrameDecoder, encode_prefix
from tests.rpc.conftest import make_agents, stop_all
from tests.rpc.test_security import _raw_connections


@pytest.mark.parametrize("cap", [16, HANDSHAKE_MAX_BYTES, 1 << 16, 1 << 30])
def test_staging_buffer_follows_the_cap_and_messages_still_decode(cap):
    d = FrameDecoder(HANDSHAKE_MAX_BYTES)
    assert len(d.get_buffer()) <= 16 << 10  # a handshake's connection: kilobytes
    d.max_message_bytes = cap  # authenticated: the real cap
    assert len(d.get_buffer()) <= 256 << 10
    frames = [b"a" * min(cap // 4, 100_000), b"", b"b" * min(cap // 4, 50)]
    data = encode_prefix(frames) + b"".join(frames)
    out, i = [], 0
    while i < len(data):  # fed in uneven pieces, as a socket delivers them
        buf = d.get_buffer()
        n = min(len(buf), 777, len(data) - i)
        buf[:n] = data[i:i + n]
        out += d.buffer_updated(n)
        i += n
    assert [bytes(f) for f in out[0]] == frames


class _Conn:
    closed = False

    def close(self):
        self.closed = True


def test_gate_closes_the_oldest_over_the_limit_and_rate_limits_its_log(caplog):
    gate = HandshakeGate("w0", logging.getLogger("jdist.rpc"), limit=3, interval=60)
    conns = [_Conn() for _ in range(5)]
    with caplog.at_level(logging.WARNING, logger="jdist.rpc"):
        for c in conns:
            gate.admit(c)
        assert [c.closed for c in conns] == [True, True, False, False, False]
        assert gate.pending == 3
        gate.release(conns[2])
        gate.release(conns[0])  # already evicted: nothing happens
        assert gate.pending == 2
        for _ in range(100):
            gate.refused("wrong secret")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "the oldest was closed" in lines[0], lines
    gate._last -= 61  # the interval has passed: the next line counts the quiet ones
    with caplog.at_level(logging.WARNING, logger="jdist.rpc"):
        gate.refused("wrong secret")
    assert "(101 more refused since the last report)" in caplog.records[-1].getMessage()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_flood_of_half_open_connections_costs_little_and_logs_little(caplog):
    agents = make_agents(2, transport="tcp")
    try:
        connect = _raw_connections(agents[1].address)[0]  # its TCP port
        before = _rss_mb()
        socks = []
        with caplog.at_level(logging.WARNING, logger="jdist.rpc"):
            for _ in range(1000):  # connect, send nothing: each waits for its handshake
                try:
                    socks.append(connect())
                except OSError:
                    pass
            time.sleep(1.0)
            grown = _rss_mb() - before
            # the agent still serves its peer while the flood is there
            assert agents[0].rpc_async("w1", sum, ([1, 2],)).wait(10) == 3
        for s in socks:
            s.close()
        assert grown < 20, f"{grown:.0f} MB for 1000 half-open connections"
        refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
        assert 1 <= len(refusals) <= 3, [r.getMessage() for r in refusals]
        assert MAX_HANDSHAKES < 1000
    finally:
        stop_all(agents, graceful=False)
