"""Code run inside real worker processes by ``test_multiprocess.py`` (importable by all).

Rank 0 drives the checks, rank 1 serves, and rank 2's process starts the real worker
``w2`` as a child process so rank 0 can SIGKILL it mid-call without the launcher
treating rank 2 as failed.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np

from jdist.errors import RpcTimeoutError, RRefError, WorkerUnavailableError
from jdist.rpc import (
    RpcBackendOptions,
    WorkerInfo,
    collect_all,
    functions,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
    wait_all,
)
from jdist.rpc._api import current_agent

_KEPT: list = []


def options():
    return RpcBackendOptions(rpc_timeout=30, max_frame_bytes=1 << 26, shutdown_timeout=60)


# ---- functions called remotely ----
class Counter:
    def __init__(self, start):
        self.n = start

    def add(self, k):
        self.n += k
        return self.n


def boom(msg):
    raise ValueError(msg)


def jax_double(x):
    import jax

    assert isinstance(x, jax.Array), type(x)
    return x * 2


@functions.async_execution
def async_relay(to, x):
    return rpc_async(to, np.add, (x, 1)).then(lambda f: f.wait() * 10)


def keep(rrefs):
    _KEPT.extend(rrefs)
    return len(_KEPT)


def drop():
    _KEPT.clear()
    gc.collect()
    return True


def owned_count():
    gc.collect()
    return len(current_agent().rrefs.owned)


def leak_report():
    a = current_agent()
    with a._lock:
        pending = [p.fn for p in a._pending.values()]
    return {"pending": pending, "holds": len(a.rrefs.holds), "ctl": len(a._ctl_pending)}


def serve_until_killed():
    init_rpc("w2", rank=2, world_size=3, rpc_backend_options=options())
    time.sleep(600)


def pause(seconds, value):
    time.sleep(seconds)
    return value


def _replies_slept_for(calls: int) -> int:
    """Of ``calls`` calls of a 0.5 ms function on w1 (after 10 to learn from), how
    many replies the caller slept for (``TCPComm.wait_until``) instead of polling."""
    from jdist.rpc.transport import _tcp

    me, slept, real = threading.get_ident(), [], _tcp.TCPComm.wait_until

    def spy(self, done, seconds):
        if threading.get_ident() == me:
            slept.append(1)
        return real(self, done, seconds)

    _tcp.TCPComm.wait_until = spy
    try:
        for i in range(10 + calls):
            if i == 10:
                slept.clear()
            assert rpc_sync("w1", pause, (5e-4, i)) == i
    finally:
        _tcp.TCPComm.wait_until = real
    return len(slept)


def _poll_lengths() -> dict:
    """The agent's default gate (widened where this host has a core per RPC process),
    and the replies slept for with a plain and with a widened gate."""
    from jdist.rpc._pollgate import PollGate

    agent = current_agent()
    gate = agent.poll_gate
    out = {"widened": gate.longest == agent.options.busy_poll_max_us * 1e-6}
    try:
        agent.poll_gate = PollGate(gate.window)
        out["plain"] = _replies_slept_for(50)
        agent.poll_gate = PollGate(gate.window, agent.options.busy_poll_max_us * 1e-6)
        out["widened_slept"] = _replies_slept_for(50)
    finally:
        agent.poll_gate = gate
    return out


# ---- per-rank entry points ----
def _poll(fn, ok, timeout):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if ok(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def _drive() -> dict:
    import jax
    import jax.numpy as jnp

    res: dict = {}
    res["me"] = get_worker_info()
    res["w2"] = get_worker_info("w2")
    x = np.arange(6.0, dtype=np.float32)
    res["np_add"] = rpc_sync("w1", np.add, (x, x))
    j = rpc_sync(1, jax_double, (jnp.arange(4.0),))
    res["jax_type"] = isinstance(j, jax.Array) and j.devices() == {jax.devices()[0]}
    res["jax_val"] = np.asarray(j)
    fut = rpc_async(WorkerInfo(2, "w2"), np.multiply, (x, 3))
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.value()[1]))
    res["then"] = fut.then(lambda f: float(f.wait().sum())).wait()
    res["wait_all"] = wait_all([rpc_async("w1", int, ("7",)), rpc_async("w2", int, ("8",))])
    res["collect_all"] = [f.value() for f in collect_all([rpc_async("w1", abs, (-2,))]).wait()]
    res["callback"] = _poll(lambda: list(seen), bool, 5)
    try:
        rpc_sync("w1", boom, ("remote boom",))
    except ValueError as e:
        res["remote_exc"] = str(e)
    t0 = time.monotonic()
    try:
        rpc_sync("w1", time.sleep, (5,), timeout=0.5)
    except RpcTimeoutError as e:
        res["timeout"] = (str(e), time.monotonic() - t0)
    res["async_relay"] = rpc_sync("w1", async_relay, ("w2", 4))
    res["polls"] = _poll_lengths()
    # RRef API
    r = remote("w1", Counter, (5,))
    res["rref"] = (r.owner(), r.owner_name(), r.is_owner(), r.rpc_sync().add(2),
                   r.rpc_async().add(1).wait(), r.remote().add(0).to_here(), r.to_here().n)
    res["confirmed"] = _poll(r.confirmed_by_owner, bool, 5)
    try:
        r.local_value()
    except RRefError as e:
        res["local_value"] = str(e)
    del r
    # reference counting: 1000 RRefs owned by w1, forked to w2, then dropped everywhere
    rrefs = [remote("w1", np.full, ((4,), i)) for i in range(1000)]
    res["kept"] = rpc_sync("w2", keep, (rrefs,))
    res["owned_peak"] = rpc_sync("w1", owned_count)
    res["sample"] = float(rrefs[999].to_here()[0])
    del rrefs
    rpc_sync("w2", drop)
    t0 = time.monotonic()
    res["owned_after"] = _poll(lambda: rpc_sync("w1", owned_count), lambda n: n == 0, 20)
    res["free_time"] = time.monotonic() - t0
    def settled(rep):  # only the report call itself may be pending (acks still in flight)
        return not rep["holds"] and not rep["ctl"] and all(
            "leak_report" in fn for fn in rep["pending"])

    res["leaks"] = {w: _poll(lambda w=w: rpc_sync(w, leak_report), settled, 10)
                    for w in ("w1", "w2")}
    res["leaks"]["w0"] = _poll(leak_report, settled, 10)
    # kill w2 in the middle of a call
    pid = rpc_sync("w2", os.getpid)
    fut = rpc_async("w2", time.sleep, (60,))
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        fut.wait()
    except WorkerUnavailableError as e:
        res["kill"] = (str(e), time.monotonic() - t0)
    t0 = time.monotonic()
    try:
        rpc_sync("w2", os.getpid)
    except WorkerUnavailableError as e:
        res["after_kill"] = (str(e), time.monotonic() - t0)
    return res


def run_rank() -> dict:
    rank = int(os.environ["RANK"])
    if rank == 2:
        child = subprocess.run([sys.executable, "-c",
                                "from tests.rpc._mp_workers import serve_until_killed as f; f()"],
                               timeout=120)
        return {"child_returncode": child.returncode}
    init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=options())
    res = _drive() if rank == 0 else {}
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shutdown(graceful=True, timeout=60)
    res["shutdown"] = ([str(w.message) for w in caught], time.monotonic() - t0)
    return res
