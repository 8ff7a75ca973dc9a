"""Real processes: every public RPC function, 1000-RRef reference counting, a killed worker.

One launch of 3 workers (TCP, env:// rendezvous through the TCPStore on MASTER_PORT, the
launcher's JDIST_AUTH_TOKEN); the checks run in order inside it.
"""

from __future__ import annotations

import os
import signal

import numpy as np

from jdist.rpc import WorkerInfo
from tests.helpers import run_procs
from tests.rpc._mp_workers import run_rank


def test_three_workers_end_to_end():
    r0, r1, r2 = run_procs(run_rank, 3, timeout=150)
    assert r0["me"] == WorkerInfo(0, "w0") and r0["w2"] == WorkerInfo(2, "w2")
    np.testing.assert_array_equal(r0["np_add"], 2 * np.arange(6.0))
    assert r0["np_add"].dtype == np.float32
    assert r0["jax_type"] and list(r0["jax_val"]) == [0.0, 2.0, 4.0, 6.0]
    assert r0["then"] == 45.0 and r0["callback"] == [3.0]
    assert r0["wait_all"] == [7, 8] and r0["collect_all"] == [2]
    assert r0["remote_exc"].startswith("On WorkerInfo(id=1, name=w1):\nValueError('remote boom')")
    assert "Traceback" in r0["remote_exc"]
    msg, took = r0["timeout"]
    assert "WorkerInfo(id=1, name=w1)" in msg and "sleep" in msg and "0.5 s" in msg
    assert took < 4
    assert r0["async_relay"] == 50
    # a 0.5 ms reply: slept for with a plain gate (one 200 us window), polled for where
    # a core per RPC process lets the gate widen (jdist's default there). How many the
    # widened gate still sleeps for depends on the host's load (28 of 50 on a loaded
    # 2-core runner): fewer than the plain gate is the behaviour; the speed-up itself
    # is measured in benchmarks/, not here
    polls = r0["polls"]
    assert polls["widened"] == (3 <= len(os.sched_getaffinity(0))), polls
    assert polls["plain"] >= 45 and polls["widened_slept"] < polls["plain"], polls
    owner, owner_name, is_owner, a, b, c, n = r0["rref"]
    assert (owner, owner_name, is_owner) == (WorkerInfo(1, "w1"), "w1", False)
    assert (a, b, c, n) == (7, 8, 8, 8)
    assert r0["confirmed"] is True
    assert r0["local_value"].startswith("For UserRRef(rref_id=GloballyUniqueId(created_on=0, ")
    assert r0["local_value"].endswith(", can't call localValue() on user WorkerInfo(id=0, "
                                      "name=w0). Call it on owner WorkerInfo(id=1, name=w1)")
    # reference counting
    assert r0["kept"] == 1000 and r0["owned_peak"] >= 1000 and r0["sample"] == 999.0
    assert r0["owned_after"] == 0, f"owner table still has {r0['owned_after']} values"
    for w, rep in r0["leaks"].items():
        assert rep["holds"] == 0 and rep["ctl"] == 0, (w, rep)
        assert all("leak_report" in fn for fn in rep["pending"]), (w, rep)
    # killed worker: the pending call fails fast, naming it; new calls fail at once
    kill_msg, kill_latency = r0["kill"]
    assert "WorkerInfo(id=2, name=w2)" in kill_msg and "time.sleep" in kill_msg
    assert kill_latency < 2.0
    after_msg, after_latency = r0["after_kill"]
    assert "w2" in after_msg and after_latency < 1.0
    assert r2["child_returncode"] == -signal.SIGKILL
    # survivors shut down, bounded, naming the dead worker
    for res in (r0, r1):
        warns, took = res["shutdown"]
        assert took < 30
        assert any("WorkerInfo(id=2, name=w2)" in w for w in warns), warns
