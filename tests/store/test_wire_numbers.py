"""Every numeric field of a store request is checked at the wire (issue 41, item 4).

An authenticated request whose timeout is NaN, an infinity, negative, a bool, a string
or absurdly large, or whose count / amount is out of range, drops that client only:
another client's ``wait(keys, 0.3)`` still times out after 0.3 s, and the server
serves everyone after the bad client left. The client refuses such a timeout itself,
with ``ValueError``, before sending anything. Generated over every op that takes a
number and every kind of bad number.
"""

from __future__ import annotations

import math
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.errors import StoreTimeoutError
from jdist.store import TCPStore
from jdist.store import _wire as wire
from tests.store.test_store_tcp import TOKEN, _client, _raw_authed

BAD_SECONDS = [math.nan, math.inf, -math.inf, -1.0, -1, True, "3", 1e300, [1]]
BAD_COUNTS = [2.5, math.nan, True, "3", 2**63, 2**64 - 1, [1]]  # also -1 for a count
OP = wire.Op
# each op that carries a number, with the bad value put where that number goes
SECONDS_FIELDS = [lambda x: [OP.GET, "k", x], lambda x: [OP.WAIT, ["k"], x],
                  lambda x: [OP.MULTI_GET, ["k"], x], lambda x: [OP.WAIT_WORKERS, 2, x],
                  lambda x: [OP.QUEUE_POP, "q", True, x]]
COUNT_FIELDS = [lambda x: [OP.WAIT_WORKERS, x, 1.0], lambda x: [OP.ADD, "n", x]]

bad_requests = st.one_of(
    st.tuples(st.sampled_from(SECONDS_FIELDS), st.sampled_from(BAD_SECONDS)),
    st.tuples(st.sampled_from(COUNT_FIELDS), st.sampled_from(BAD_COUNTS)),
    st.just((COUNT_FIELDS[0], -1)),
).map(lambda fv: fv[0](fv[1]))


@pytest.fixture(scope="module")
def master():
    m = TCPStore("127.0.0.1", 0, is_master=True, timeout=20, auth_token=TOKEN)
    yield m
    m.close()


@given(req=bad_requests)
@settings(max_examples=20)
def test_a_bad_number_drops_only_its_client(master, req):
    s = _raw_authed(master.port)
    body = msgpack.packb(req)
    s.sendall(len(body).to_bytes(4, "big") + body)
    s.settimeout(5)
    try:
        got = s.recv(1 << 16)  # the server closes the connection
    except OSError:
        got = b""
    assert got == b"", (req, got)
    s.close()
    other = _client(master.port)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        other.wait(["never-set"], 0.3)
    assert time.monotonic() - start < 3.0, req
    other.set("alive", "1")
    assert other.get("alive") == b"1"
    other.close()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.5])
def test_the_client_refuses_a_bad_timeout_before_sending(master, bad):
    c = _client(master.port)
    with pytest.raises(ValueError, match="finite number of seconds"):
        c.wait(["k"], bad)
    with pytest.raises(ValueError, match="finite number of seconds"):
        c.set_timeout(bad)
    with pytest.raises(ValueError, match="finite number of seconds"):
        TCPStore("127.0.0.1", master.port, timeout=bad, auth_token=TOKEN)
    assert c.check(["k"]) is False  # the connection was never used for the bad call
    c.close()
