"""``jdist._mailbox.Mailbox`` (as ``jdist.ft`` subclasses it, with its errors, and as
it is, with the generic ones): two or three mailboxes in one process, on loopback.

Messages are filed under (key, sender); a peer without the job's secret is never
heard; a sender whose mailbox closes fails a pending ``take`` at once, not at its
deadline; ``forget`` drops old rounds. Deadlines are short, so the file runs in
seconds; the upper bounds on waits are loose (a loaded 2-core machine)."""

from __future__ import annotations

import socket
import threading
import time
import types

import numpy as np
import pytest

from jdist import _mailbox
from jdist.errors import CollectiveTimeoutError, FtError, PeerFailedError, ReplicaLostError
from jdist.ft._peers import Mailbox

TOKEN = b"test-secret-of-this-job"
LONG = 30.0  # a deadline that a passing test never reaches


@pytest.fixture
def boxes():
    """``make(replica, token=TOKEN, **kw)`` -> a Mailbox, closed after the test."""
    made: list[Mailbox] = []

    def make(replica: int, token: bytes = TOKEN, incarnation: int = 0, **kw) -> Mailbox:
        box = Mailbox(replica, incarnation, token, **kw)
        made.append(box)
        return box

    yield make
    for box in made:
        box.close()


def _post(src: Mailbox, dst: Mailbox, key: str, frames) -> None:
    src.post(dst.replica, dst.address, key, frames, timeout=10.0)


def _take(dst: Mailbox, key: str, src: Mailbox | int, within: float = LONG,
          check=lambda: None):
    sender = (src.replica, 0) if isinstance(src, Mailbox) else (src, 0)
    return dst.take(key, sender, time.monotonic() + within, check, f"test {key}")


def _frames(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [np.asarray([seed], np.int64), rng.standard_normal((3, 4)).astype(np.float32),
            np.asarray(rng.integers(0, 100), np.int32), b"", bytes(range(seed, seed + 9)),
            np.zeros((0,), np.float64)]


def _as_bytes(frames) -> list[bytes]:
    return [bytes(memoryview(np.ascontiguousarray(f)).cast("B")) if isinstance(f, np.ndarray)
            else bytes(f) for f in frames]


def test_messages_arrive_under_key_and_sender(boxes):
    a, b, c = boxes(0), boxes(1), boxes(2)
    _post(a, b, "r0/grad", _frames(1))
    _post(c, b, "r0/grad", _frames(2))
    _post(a, b, "r0/heal", _frames(3))
    _post(b, a, "r0/grad", _frames(4))
    _post(b, c, "r0/grad", _frames(5))
    # taken in another order than sent: each waits for its own (key, sender)
    assert [bytes(f) for f in _take(b, "r0/heal", a)] == _as_bytes(_frames(3))
    assert [bytes(f) for f in _take(b, "r0/grad", c)] == _as_bytes(_frames(2))
    assert [bytes(f) for f in _take(b, "r0/grad", a)] == _as_bytes(_frames(1))
    assert [bytes(f) for f in _take(a, "r0/grad", b)] == _as_bytes(_frames(4))
    assert [bytes(f) for f in _take(c, "r0/grad", b)] == _as_bytes(_frames(5))
    with pytest.raises(ReplicaLostError):  # a taken message is gone
        _take(b, "r0/grad", c, within=0.2)
    big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: more than one socket buffer
    _post(c, a, "r1/grad", [big])
    np.testing.assert_array_equal(np.frombuffer(_take(a, "r1/grad", c)[0], np.float64), big)


def test_sender_id_comes_from_the_handshake_not_from_post(boxes):
    a, b = boxes(0), boxes(1)
    a.post(7, b.address, "r0/x", [b"hello"], timeout=10.0)  # ``peer`` names the target
    assert bytes(_take(b, "r0/x", a)[0]) == b"hello"


def test_peer_with_the_wrong_token_is_refused(boxes):
    a, b = boxes(0), boxes(1)
    intruder = boxes(2, token=b"another-jobs-secret")
    intruder.connect = _gated(intruder.connect, gate := threading.Event())
    _post(intruder, b, "r0/grad", [b"forged"])
    gate.set()  # (connect once the message is queued: see the bug below)
    start = time.monotonic()
    with pytest.raises(ReplicaLostError, match="replica 2"):
        _take(b, "r0/grad", intruder, within=0.5)
    assert time.monotonic() - start >= 0.5 - 1e-3  # it waited for the deadline
    # nor does the intruder hear a real replica
    _post(b, intruder, "r0/grad", [b"secret data"])
    with pytest.raises(ReplicaLostError):
        _take(intruder, "r0/grad", b, within=0.5)
    # the refused sender lists its message as not sent, saying why
    why = _poll(lambda: intruder.failure("r0/"))
    assert "secret" in why and "replica 1" in why
    # the refused attempts leave the listener working for the job's own replicas
    _post(a, b, "r0/grad", [b"real"])
    assert bytes(_take(b, "r0/grad", a)[0]) == b"real"


def _poll(fn, within: float = LONG):
    """``fn()``'s first truthy value, polled until ``within`` seconds pass."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.01)
    pytest.fail(f"nothing within {within} s")


def _refused_address() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_peer_is_listed_by_failure(boxes):
    a = boxes(0)
    address = _refused_address()
    # (connecting waits until the messages are queued: see the bug below)
    a.connect = _gated(a.connect, gate := threading.Event())
    for key in ("r2/grad", "r2/heal"):
        a.post(4, address, key, [b"lost"], timeout=5.0)
    gate.set()
    why = _poll(lambda: a.failure("r2/"))
    assert "replica 4" in why and address in why
    assert a.failure("r3/") is None
    a.forget(lambda key: int(key[1:].split("/")[0]) >= 3)  # an old round's failure goes
    assert a.failure("r2/") is None


def _gated(fn, gate: threading.Event):
    def gated(*args, **kwargs):
        gate.wait(LONG)
        return fn(*args, **kwargs)
    return gated


def test_message_to_a_peer_that_refuses_at_once_is_listed(boxes, monkeypatch):
    a = boxes(0)
    noted = threading.Event()
    note = a.note_failure

    def note_failure(keys, why):
        note(keys, why)
        noted.set()

    def refuse(address, timeout):
        raise ConnectionRefusedError(f"{address} refused (test)")

    class QueueAfterTheFailure(_mailbox.queue.SimpleQueue):
        """Queues once the sender has failed: the interleaving, made deterministic."""

        def put(self, item, *args, **kwargs):
            noted.wait(5.0)
            super().put(item, *args, **kwargs)

    monkeypatch.setattr(_mailbox, "queue", types.SimpleNamespace(
        SimpleQueue=QueueAfterTheFailure))
    a.note_failure, a.connect = note_failure, refuse
    a.post(4, _refused_address(), "r2/grad", [b"lost"], timeout=5.0)
    assert _poll(lambda: a.failure("r2/"), within=1.0)


def test_closed_mailbox_hears_nothing(boxes):
    a, b = boxes(0), boxes(1)
    _post(a, b, "r0/x", [b"before"])
    assert bytes(_take(b, "r0/x", a)[0]) == b"before"
    b.close()
    b.close()  # idempotent
    _post(a, b, "r1/x", [b"after"])  # on the old connection, or a new one: refused
    c = boxes(2)
    _post(c, b, "r1/x", [b"after"])
    for sender in (a, c):
        with pytest.raises(ReplicaLostError):
            _take(b, "r1/x", sender, within=0.5)


def test_garbage_connection_is_dropped(boxes):
    a, b = boxes(0), boxes(1)
    host, _, port = b.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\x00" * 64)
        s.settimeout(5)
        try:
            rest = s.recv(100)  # the mailbox closes it without a reply
        except (ConnectionResetError, TimeoutError):
            rest = b""
        assert rest == b""
    _post(a, b, "r0/x", [b"still fine"])
    assert bytes(_take(b, "r0/x", a)[0]) == b"still fine"


def test_closed_sender_fails_a_pending_take_fast(boxes):
    a, b = boxes(0), boxes(1)
    _post(a, b, "r0/grad", [b"first"])  # opens a's connection to b
    assert bytes(_take(b, "r0/grad", a)[0]) == b"first"
    outcome: dict = {}

    def waiter():
        start = time.monotonic()
        try:
            _take(b, "r1/grad", a, within=LONG)
        except BaseException as e:  # noqa: BLE001 - checked by the main thread
            outcome["error"] = e
        outcome["took"] = time.monotonic() - start

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    a.close()
    t.join(LONG + 5)
    assert not t.is_alive()
    assert isinstance(outcome.get("error"), ReplicaLostError), outcome
    assert "replica 0 was lost" in str(outcome["error"])
    assert outcome["took"] < LONG / 3, outcome  # at once, not at the deadline


def test_message_over_the_cap_ends_the_connection(boxes):
    a, b = boxes(0), boxes(1, max_message_bytes=100)
    _post(a, b, "r0/x", [b"small"])
    assert bytes(_take(b, "r0/x", a)[0]) == b"small"
    _post(a, b, "r0/y", [bytes(1000)])
    start = time.monotonic()
    with pytest.raises(ReplicaLostError, match="max_message_bytes=100"):
        _take(b, "r0/y", a, within=LONG)
    assert time.monotonic() - start < LONG / 3


def test_forget_drops_old_keys(boxes):
    a, b = boxes(0), boxes(1)
    for key in ("r1/grad", "r2/heal", "r3/grad", "r5/grad"):
        _post(a, b, key, [key.encode()])
    _post(a, b, "r9/mark", [b"m"])
    _take(b, "r9/mark", a)  # one connection keeps order: everything before is filed
    b.forget(lambda key: int(key[1:].split("/")[0]) >= 3)
    assert bytes(_take(b, "r5/grad", a, within=5)[0]) == b"r5/grad"
    assert bytes(_take(b, "r3/grad", a, within=5)[0]) == b"r3/grad"
    for key in ("r1/grad", "r2/heal"):
        with pytest.raises(ReplicaLostError):
            _take(b, key, a, within=0.2)


def test_check_runs_while_waiting_and_may_raise(boxes):
    _, b = boxes(0), boxes(1)
    calls = []

    def check():
        calls.append(time.monotonic())
        if len(calls) >= 3:
            raise ReplicaLostError("the heartbeat says replica 0 stopped")

    start = time.monotonic()
    with pytest.raises(ReplicaLostError, match="heartbeat"):
        _take(b, "r0/grad", 0, within=LONG, check=check)
    assert len(calls) == 3 and time.monotonic() - start < LONG / 3


def test_deadline_passes(boxes):
    _, b = boxes(0), boxes(1)
    start = time.monotonic()
    with pytest.raises(ReplicaLostError, match="before the deadline"):
        _take(b, "r0/grad", 0, within=0.3)
    took = time.monotonic() - start
    assert 0.3 - 1e-3 <= took < 10


@pytest.mark.parametrize("token", [b"", None])
def test_empty_token_raises(token):
    with pytest.raises(FtError, match="secret"):
        Mailbox(0, 0, token)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_bfloat16_frames_arrive(boxes):
    import ml_dtypes

    a, b = boxes(0), boxes(1)
    x = np.arange(4).astype(ml_dtypes.bfloat16)
    _post(a, b, "r0/grad", [x])
    got = _take(b, "r0/grad", a, within=1.0)
    np.testing.assert_array_equal(np.frombuffer(got[0], ml_dtypes.bfloat16), x)


def test_generic_mailbox_names_its_own_errors():
    """Outside jdist.ft the mailbox raises the generic classes: a silent sender is a
    timeout, a closed one a failed peer; ``poll`` takes a message only if it is here."""
    a = _mailbox.Mailbox(0, 0, TOKEN)
    b = _mailbox.Mailbox(1, 0, TOKEN)
    try:
        assert b.poll("k", 0) is None
        a.post(1, b.address, "k", [np.arange(3)], timeout=10.0)
        deadline = time.monotonic() + LONG
        while (got := b.poll("k", 0)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got is not None and bytes(got[0]) == np.arange(3).tobytes()
        with pytest.raises(CollectiveTimeoutError, match="peer 0 sent nothing"):
            b.take("never", (0, 0), time.monotonic() + 0.2, lambda: None, "test")
        a.close()
        with pytest.raises(PeerFailedError, match="peer 0 was lost"):
            b.take("after", (0, 0), time.monotonic() + LONG, lambda: None, "test")
    finally:
        a.close()
        b.close()
    with pytest.raises(PeerFailedError, match="JDIST_AUTH_TOKEN"):
        _mailbox.Mailbox(0, 0, b"")
