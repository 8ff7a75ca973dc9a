"""Agent behaviour on the in-process transport: calls, errors, timeouts, RRefs, failures."""

from __future__ import annotations

import gc
import operator
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.errors import (
    RemoteError,
    RendezvousError,
    RpcTimeoutError,
    RRefError,
    WorkerUnavailableError,
)
from jdist.rpc import Future, WorkerInfo
from jdist.rpc import _protocol as P
from jdist.rpc.functions import async_execution
from tests.rpc.conftest import make_agents, stop_all

# ---- functions run remotely (module level, so they pickle by reference) ----
_EVENTS: dict[str, threading.Event] = {}


def echo(x):
    return x


def boom(msg):
    raise ValueError(msg)


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


def raise_odd():
    raise NeedsTwoArgs(1, 2)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def wait_event(name, timeout=10.0):
    return _EVENTS[name].wait(timeout)


def kind_of(x):
    return "jax" if isinstance(x, jax.Array) else type(x).__name__, str(getattr(x, "dtype", "")), [
        str(d) for d in getattr(x, "devices", lambda: [])()]


@async_execution
def async_add(agent_name, to, x):
    agent = _AGENTS[agent_name]
    return agent.rpc_async(to, operator.add, (x, 1)).then(lambda f: f.wait() * 10)


class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k):
        self.n += k
        return self.n


def hold(rrefs):
    """Third worker receives forks; returns how many it could read (then drops them)."""
    return len(rrefs)


def all_owned(rrefs):
    return all(r.is_owner() for r in rrefs)


def fetch_sum(rref):
    return float(np.sum(rref.to_here()))


_AGENTS: dict = {}


@pytest.fixture
def agents(agents3):
    _AGENTS.clear()
    _AGENTS.update({a.info.name: a for a in agents3})
    return agents3


def counted(send, ops):
    """``send_control`` that records each op it sends in ``ops``."""
    def send_control(to, op, *rest):
        ops.append(op)
        return send(to, op, *rest)
    return send_control


def holds_empty(agent, timeout=10.0):
    deadline = time.monotonic() + timeout
    while agent.rrefs.holds and time.monotonic() < deadline:
        time.sleep(0.02)
    return not agent.rrefs.holds


def owned_empty(agent, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        if not agent.rrefs.owned and agent.pending_count() == 0:
            return True
        time.sleep(0.02)
    return False


# ---------------------------------------------------------------- calls
def test_to_accepts_name_rank_and_workerinfo(agents):
    a0 = agents[0]
    assert a0.rpc_async("w1", operator.add, (1, 2)).wait() == 3
    assert a0.rpc_async(2, operator.mul, (3, 4)).wait() == 12
    assert a0.rpc_async(WorkerInfo(1, "w1"), echo, kwargs={"x": "k"}).wait() == "k"
    assert a0.rpc_async("w0", echo, ("self",)).wait() == "self"
    with pytest.raises(ValueError, match="unknown worker name 'w9'.*w0"):
        a0.rpc_async("w9", echo, (1,))
    with pytest.raises(ValueError, match="unknown worker rank 7"):
        a0.rpc_async(7, echo, (1,))
    with pytest.raises(ValueError, match="name, rank or WorkerInfo"):  # torch: ValueError
        a0.rpc_async(1.5, echo, (1,))
    assert a0.worker_info("w2") == WorkerInfo(2, "w2")
    assert repr(a0.worker_info()) == "WorkerInfo(id=0, name=w0)"


def test_arrays_keep_their_type(agents):
    a0 = agents[0]
    x = np.arange(12, dtype=np.int16).reshape(3, 4)
    y = a0.rpc_async("w1", echo, (x,)).wait()
    assert type(y) is np.ndarray and y.dtype == np.int16
    np.testing.assert_array_equal(y, x)
    y[0, 0] = 99  # writable, and a copy (the sender's array is untouched)
    assert x[0, 0] == 0
    j = jnp.arange(6, dtype=jnp.bfloat16)
    mod, dtype, devs = a0.rpc_async("w1", kind_of, (j,)).wait()
    assert (mod, dtype) == ("jax", "bfloat16") and devs == [str(jax.devices()[0])]
    back = a0.rpc_async("w1", echo, ({"a": j, "b": [x, 3]},)).wait()
    assert isinstance(back["a"], jax.Array) and back["a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back["a"]), np.asarray(j))


def test_remote_exception_keeps_type_and_traceback(agents):
    with pytest.raises(ValueError) as ei:
        agents[0].rpc_async("w1", boom, ("remote boom",)).wait()
    msg = str(ei.value)
    assert msg.startswith("On WorkerInfo(id=1, name=w1):\nValueError('remote boom')")
    assert "Traceback (most recent call last)" in msg and "in boom" in msg
    with pytest.raises(RemoteError, match="NeedsTwoArgs"):
        agents[0].rpc_async("w1", raise_odd).wait()


def test_unpicklable_callables_fail_at_call_site(agents):
    with pytest.raises(TypeError, match="lambdas and nested functions.*module level"):
        agents[0].rpc_async("w1", lambda: 1)

    def nested():
        return 1

    with pytest.raises(TypeError, match="nested"):
        agents[0].rpc_async("w1", nested)
    with pytest.raises(TypeError, match="arguments of .*echo"):
        agents[0].rpc_async("w1", echo, (threading.Lock(),))
    with pytest.raises(TypeError, match="must be callable"):
        agents[0].rpc_async("w1", 42)


def test_timeout_names_worker_function_and_time(agents):
    t0 = time.monotonic()
    with pytest.raises(RpcTimeoutError, match=r"w2.*sleep_then.*0\.3 s"):
        agents[0].rpc_async("w2", sleep_then, (3, "late"), timeout=0.3).wait()
    assert time.monotonic() - t0 < 2.5
    # 0 = no timeout, -1 = default (20 s here)
    assert agents[0].rpc_async("w2", sleep_then, (0.4, "ok"), timeout=0).wait() == "ok"
    assert agents[0].rpc_async("w2", sleep_then, (0.1, "d"), timeout=-1).wait() == "d"
    with pytest.raises(ValueError, match="-1 for the default"):
        agents[0].rpc_async("w2", echo, (1,), timeout=-5)


def test_slow_function_does_not_delay_others(agents):
    _EVENTS["gate"] = threading.Event()
    slow = agents[0].rpc_async("w1", wait_event, ("gate",))
    t0 = time.monotonic()
    for _ in range(5):
        assert agents[0].rpc_async("w1", operator.add, (1, 1)).wait(timeout=5) == 2
    assert time.monotonic() - t0 < 5
    assert not slow.done()
    _EVENTS["gate"].set()
    assert slow.wait(5) is True


def test_async_execution_and_future_chaining(agents):
    assert agents[0].rpc_async("w1", async_add, ("w1", "w2", 4)).wait() == 50
    f = agents[0].rpc_async("w2", operator.add, (2, 3))
    g = f.then(lambda fut: fut.wait() * 2)
    seen = []
    done = threading.Event()
    f.add_done_callback(lambda fut: (seen.append(fut.value()), done.set()))
    assert g.wait(5) == 10 and done.wait(5) and seen == [5]


# ---------------------------------------------------------------- RRefs
def test_remote_rref_api(agents):
    a0 = agents[0]
    r = a0.remote("w1", Counter, (5,))
    assert not r.is_owner() and r.owner() == WorkerInfo(1, "w1") and r.owner_name() == "w1"
    assert r.rpc_sync().add(2) == 7
    assert r.rpc_async().add(3).wait() == 10
    r2 = r.remote().add(1)  # an RRef to the result, owned by w1
    assert r2.to_here() == 11 and r.to_here().n == 11
    deadline = time.monotonic() + 5
    while not r.confirmed_by_owner() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.confirmed_by_owner()
    with pytest.raises(RRefError,
                       match=r"can't call localValue\(\) on user WorkerInfo\(id=0, name=w0\)\. "
                             r"Call it on owner WorkerInfo\(id=1, name=w1\)"):
        r.local_value()
    with pytest.raises(RRefError, match="only be pickled as an argument"):
        import pickle

        pickle.dumps(r)
    bad = a0.remote("w2", boom, ("in remote",))
    with pytest.raises(ValueError, match="in remote"):
        bad.to_here()


def test_rref_to_self_and_local_rref(agents):
    a1 = agents[1]
    mine = a1.remote("w1", Counter, (1,))
    assert mine.is_owner() and mine.local_value().add(1) == 2
    assert a1.rpc_async("w0", fetch_sum, (a1.remote("w1", np.ones, (4,)),)).wait() == 4.0


def test_forks_to_third_worker_are_counted_and_freed(agents):
    a0, a1, a2 = agents
    rrefs = [a0.remote("w1", np.full, ((2,), i)) for i in range(50)]
    assert a0.rpc_async("w2", hold, (rrefs,)).wait() == 50  # user -> user forks
    assert a0.rpc_async("w1", all_owned, (rrefs[:5],)).wait()  # user -> owner
    back = a0.rpc_async("w1", echo, (rrefs[:5],)).wait()  # and owner -> user again
    assert not any(r.is_owner() for r in back) and len(a1.rrefs.owned) == 50
    del back
    assert [float(r.to_here()[0]) for r in rrefs[:3]] == [0.0, 1.0, 2.0]
    assert len(a1.rrefs.owned) == 50
    del rrefs
    assert owned_empty(a1), f"owner still holds {len(a1.rrefs.owned)} values"
    assert all(owned_empty(a) for a in agents)
    assert all(holds_empty(a) for a in agents)


def test_deleted_user_rrefs_travel_with_the_next_call_or_their_own_soon_after(
        agents, monkeypatch):
    """A dropped user RRef reaches its owner in the header of this worker's next call
    there (no USER_DELETE message and acknowledgement each), applied before that call
    runs; with no next call, a call of its own carries it within RELEASE_FLUSH_S."""
    from jdist.rpc import _client

    a0, a1, _ = agents
    sent = []
    real = _client.CallClient._send_notes
    monkeypatch.setattr(_client.CallClient, "_send_notes",
                        lambda self, to: sent.append((self.info.id, to)) or real(self, to))

    def made(n):
        rrefs = [a0.remote("w1", np.full, ((2,), i)) for i in range(n)]
        assert [float(r.to_here()[0]) for r in rrefs] == list(range(n))
        return rrefs, [r._rref_id for r in rrefs]

    def wait_for(cond, seconds):
        deadline = time.monotonic() + seconds
        while not cond() and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.002)
        return cond()

    monkeypatch.setattr(_client, "RELEASE_FLUSH_S", 30.0)  # only the next call tells w1
    rrefs, ids = made(10)
    del rrefs
    assert wait_for(lambda: len(a0.notes.controls_to.get(1, ())) >= 10, 10)
    assert all(i in a1.rrefs.owned for i in ids)  # w1 has not been told yet
    assert a0.rpc_async("w1", all_owned_gone, (ids,)).wait()  # applied before it ran
    assert 1 not in a0.notes.controls_to and (0, 1) not in sent

    monkeypatch.setattr(_client, "RELEASE_FLUSH_S", 0.02)  # nothing follows: a flush
    rrefs, ids = made(5)
    del rrefs
    began = time.monotonic()
    assert wait_for(lambda: not any(i in a1.rrefs.owned for i in ids), 10)
    # carried by a flush call of its own: well before the 30 s a next call would wait
    # (no tighter wall-clock bound: a loaded 2-core runner took 2.3 s here)
    assert time.monotonic() - began < 8.0 and (0, 1) in sent


def test_child_accept_travels_with_the_next_call_to_the_parent_or_its_own(
        agents, monkeypatch):
    """User w0 hands w1's RRefs to user w2: w2 asks the owner (FORK_REQUEST, answered),
    and the owner's CHILD_ACCEPT, which lets w0 drop its hold, rides on the owner's next
    call to w0 (no message and acknowledgement of its own), or a call of its own soon
    after."""
    from jdist.rpc import _client

    a0, a1, _ = agents
    ops = []

    for a in agents:
        monkeypatch.setattr(a, "send_control", counted(a.send_control, ops))
    monkeypatch.setattr(_client, "RELEASE_FLUSH_S", 30.0)
    rrefs = [a0.remote("w1", np.full, ((2,), i)) for i in range(10)]
    assert a0.rpc_async("w2", hold, (rrefs,)).wait() == 10  # ran once w1 confirmed
    assert len(a0.rrefs.holds) == 10 and len(a1.notes.controls_to[0]) == 10
    assert a1.rpc_async("w0", operator.add, (1, 2)).wait() == 3
    assert holds_empty(a0, timeout=0.0)  # applied before that call ran
    for a in agents:  # the notes still waiting for their 30 s timers (w2's deletions)
        a.send_all_notes()
    monkeypatch.setattr(_client, "RELEASE_FLUSH_S", 0.02)
    assert a0.rpc_async("w2", hold, (rrefs,)).wait() == 10
    began = time.monotonic()
    assert holds_empty(a0) and time.monotonic() - began < 2.0
    assert P.ControlOp.FORK_REQUEST in ops and P.ControlOp.CHILD_ACCEPT not in ops, ops
    del rrefs
    assert owned_empty(a1) and all(holds_empty(a) for a in agents)


def all_owned_gone(ids):  # runs on w1
    return not any(tuple(i) in _AGENTS["w1"].rrefs.owned for i in ids)


def test_owner_forks_to_users(agents):
    a0, a1, _ = agents
    r = a1.remote("w1", Counter, (0,))
    assert a1.rpc_async("w2", fetch_counter_n, (r,)).wait() == 0  # owner -> user fork
    del r
    assert owned_empty(a1)


_STASH: dict = {}


def give_back(key):
    """Return a stashed user RRef to its owner and drop ours at once (reply race)."""
    return _STASH.pop(key)


def own_rref_to_self(agent_name):
    """On the owner: make an RRef and return it to ourselves (pinned while in flight)."""
    return _AGENTS[agent_name].remote(agent_name, Counter, (7,))


def test_rref_returned_to_its_owner_survives_the_sender_dropping_it(agents):
    a0, a1, _ = agents
    for i in range(30):
        _STASH[i] = a0.remote("w1", Counter, (i,))
    got = [a1.rpc_async("w0", give_back, (i,)).wait() for i in range(30)]
    gc.collect()
    assert [r.local_value().n for r in got] == list(range(30))
    mine = [a1.rpc_async("w1", own_rref_to_self, ("w1",)).wait() for _ in range(30)]
    gc.collect()
    assert all(r.is_owner() and r.local_value().n == 7 for r in mine)
    del got, mine
    assert owned_empty(a1) and all(holds_empty(a) for a in agents)


def fetch_counter_n(rref):
    return rref.rpc_sync().add(0)


def stash_on_owner(key, rref, seconds=0.0):
    """On the owner: keep the owner-side handle of a user's RRef (after a while)."""
    time.sleep(seconds)
    _STASH[key] = rref
    return rref.is_owner()


def test_user_rref_sent_to_its_owner_is_released_by_the_reply(agents):
    """A user's RRef in a call to its owner: the reply tells the user that the owner
    has it (no CHILD_ACCEPT message), a late reply after a timeout too, and the value
    lives on in the owner's handle after the user drops every reference."""
    a0, a1, _ = agents
    ops = []

    for a in agents:
        a.send_control = counted(a.send_control, ops)
    rrefs = [a0.remote("w1", Counter, (i,)) for i in range(20)]
    assert all(a0.rpc_async("w1", stash_on_owner, (i, r)).wait()
               for i, r in enumerate(rrefs[:10]))
    assert holds_empty(a0, timeout=0.0)  # released before each reply's future is done
    assert all(a0.remote("w1", stash_on_owner, (i, r)).to_here()
               for i, r in enumerate(rrefs[10:], 10))
    assert holds_empty(a0)  # the remote()s' replies (they may come after to_here's)
    with pytest.raises(RpcTimeoutError):
        a0.rpc_async("w1", stash_on_owner, (20, rrefs[0], 0.5), timeout=0.1).wait()
    assert len(a0.rrefs.holds) == 1  # the owner may still decode it: held
    assert holds_empty(a0)  # until the late reply
    assert P.ControlOp.CHILD_ACCEPT not in ops, ops
    del rrefs
    gc.collect()
    assert [_STASH[i].local_value().n for i in range(20)] == list(range(20))
    assert len(a1.rrefs.owned) == 20
    _STASH.clear()
    assert owned_empty(a1) and all(holds_empty(a) for a in agents)


# ---------------------------------------------------------------- lifecycle / failures
def test_unique_names_enforced():
    from jdist.rpc._api import start_agent
    from jdist.rpc._options import RpcBackendOptions
    from jdist.store import HashStore

    store = HashStore()
    opts = RpcBackendOptions(transport="inproc", rpc_timeout=2, rendezvous_timeout=1)
    store.compare_set("jdist/rpc/name/dup", "", "0")  # rank 0 holds it and never comes
    with pytest.raises(RendezvousError, match="is not unique.*'dup' is already taken by rank 0"):
        start_agent("dup", 1, 2, opts, store, b"k")
    with pytest.raises(ValueError, match="worker name"):
        start_agent("bad name!", 0, 1, opts, store, b"k")


def test_dead_worker_fails_pending_and_new_calls_survivors_shut_down():
    agents = make_agents(3)
    try:
        _EVENTS["never"] = threading.Event()
        pending = agents[0].rpc_async("w2", wait_event, ("never", 30))
        time.sleep(0.1)
        t0 = time.monotonic()
        agents[2].close()  # dies without a graceful shutdown
        with pytest.raises(WorkerUnavailableError, match=r"WorkerInfo\(id=2, name=w2\)"):
            pending.wait(10)
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(WorkerUnavailableError, match="w2"):
            agents[0].rpc_async("w2", echo, (1,)).wait(2)
        with pytest.warns(RuntimeWarning, match="without these workers.*w2"):
            errs = stop_all(agents[:2], graceful=True, timeout=10)
        assert errs == {}
    finally:
        _EVENTS["never"].set()
        stop_all(agents, graceful=False)


def test_graceful_shutdown_drains_rref_deletions():
    agents = make_agents(3)
    seen = {}
    owner = agents[1]
    real_close = owner.close

    def close_and_record():
        seen["owned_at_close"] = len(owner.rrefs.owned)
        real_close()

    owner.close = close_and_record
    try:
        rrefs = [agents[0].remote("w1", Counter, (i,)) for i in range(40)]
        agents[0].rpc_async("w2", hold, (rrefs[:20],)).wait(10)
        deadline = time.monotonic() + 10
        while len(owner.rrefs.owned) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)  # remote() returns before the owner has the value
        assert len(owner.rrefs.owned) == 40
        del rrefs
        assert stop_all(agents, graceful=True, timeout=20) == {}
        assert seen["owned_at_close"] == 0
    finally:
        stop_all(agents, graceful=False)


def test_graceful_shutdown_names_live_missing_worker():
    agents = make_agents(2)
    try:
        t0 = time.monotonic()
        errs = stop_all(agents[:1], graceful=True, timeout=1.0)
        assert time.monotonic() - t0 < 5
        assert isinstance(errs[0], RpcTimeoutError)
        assert "WorkerInfo(id=1, name=w1)" in str(errs[0])
        assert agents[0].state == "closed"
    finally:
        stop_all(agents, graceful=False)


def test_graceful_shutdown_gives_up_on_a_silent_worker_only():
    """timeout=None waits for live workers while they answer pings; one whose I/O stops
    answering for shutdown_timeout is named. A worker that answers is waited for."""
    agents = make_agents(2, shutdown_timeout=1.0)
    hang = threading.Event()
    real = agents[1].rrefs.handle_control

    def stuck(op, *a):  # w1's I/O thread blocks on the first ping: a hung process
        if op == P.ControlOp.PING:
            hang.wait(30)
        return real(op, *a)

    late = threading.Timer(2.5, lambda: stop_all(agents[1:], graceful=True, timeout=None))
    try:
        late.start()  # w1 answers pings and calls shutdown after 2.5 s > shutdown_timeout
        t0 = time.monotonic()
        assert stop_all(agents[:1], graceful=True, timeout=None) == {}
        assert time.monotonic() - t0 >= 2.0
    finally:
        late.join(30)
        stop_all(agents, graceful=False)
    agents = make_agents(2, shutdown_timeout=1.0)
    agents[1].rrefs.handle_control = stuck
    _EVENTS["hung"] = threading.Event()
    try:
        pending = agents[0].rpc_async("w1", wait_event, ("hung", 30))  # drain waits on it
        t0 = time.monotonic()
        errs = stop_all(agents[:1], graceful=True, timeout=None)
        took = time.monotonic() - t0
        assert isinstance(errs[0], RpcTimeoutError), errs
        assert "WorkerInfo(id=1, name=w1)" in str(errs[0]) and "did not answer for 1 s" in \
            str(errs[0])
        assert 1.0 <= took < 10, took
        with pytest.raises(Exception, match="shut down|unavailable"):
            pending.wait(5)
    finally:
        hang.set()
        _EVENTS["hung"].set()
        stop_all(agents, graceful=False)


def test_calls_after_close_fail_clearly():
    agents = make_agents(2)
    errs = stop_all(agents, graceful=True, timeout=10)
    assert errs == {}
    f = agents[0].rpc_async("w1", echo, (1,))
    with pytest.raises(Exception, match="closed|shut down|unavailable"):
        f.wait(2)


def test_concurrent_close_tears_down_once_and_both_return():
    """A close() that overlaps a running one waits for it instead of closing again (the
    second used to wait out a 10 s teardown timeout on the stopped loop)."""
    agents = make_agents(2)
    a = agents[0]
    runs, started, release = [], threading.Event(), threading.Event()
    real = a._close

    def slow_close(pending):
        runs.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        real(pending)

    a._close = slow_close
    first = threading.Thread(target=a.close, name="first")
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=a.close, name="second")
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waiting for the first closer, not tearing down itself
    release.set()
    first.join(20)
    second.join(20)
    assert not first.is_alive() and not second.is_alive()
    assert runs == ["first"] and a.state == "closed"
    a.close()  # closing a closed agent is a no-op
    assert stop_all(agents[1:], graceful=False) == {}


def test_future_api_standalone():
    f: Future = Future()
    with pytest.raises(RuntimeError, match="before it completed"):
        f.value()
    with pytest.raises(RpcTimeoutError, match="timed out after 0.05"):
        f.wait(0.05)
    f.set_result(3)
    with pytest.raises(RuntimeError, match="only be marked completed once"):
        f.set_result(4)
    assert f.value() == 3 and f.done()
    g: Future = Future()
    g.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        g.wait()
    from jdist.rpc import collect_all, wait_all

    assert wait_all([f]) == [3]
    with pytest.raises(KeyError):
        wait_all([f, g])
    c = collect_all([f, g])
    assert c.wait(1) == [f, g]
    assert collect_all([]).wait(1) == []
