"""Mismatch detection and dead peers, in real processes.

- Ranks calling different shapes / dtypes / collectives raise CollectiveMismatchError on
  every rank, quickly, naming each rank's call; the group stays usable afterwards;
  ``JDIST_DEBUG=OFF`` skips the check.
- A rank that never calls makes the other raise CollectiveTimeoutError after the group
  timeout, naming it and where it is.
- A rank killed with SIGKILL makes the survivor raise PeerFailedError naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import run_procs

TIMEOUT = 6  # seconds: the group timeout of the mismatch job


def _mismatch_child() -> dict:
    import jdist
    from jdist.collectives import _engine
    from jdist.errors import CollectiveMismatchError, CollectiveTimeoutError

    jdist.init_process_group(timeout=TIMEOUT)
    r = jdist.get_rank()
    out = {}
    cases = {
        "shape": lambda: jdist.all_reduce(np.ones(2 + r, np.float32)),
        "dtype": lambda: jdist.all_reduce(np.ones(3, np.float32 if r == 0 else np.int32)),
        "kind": lambda: (jdist.all_reduce(np.ones(3)) if r == 0
                         else jdist.broadcast(np.ones(3), src=0)),
        "op": lambda: jdist.all_reduce(np.ones(3), jdist.ReduceOp.MAX if r else
                                       jdist.ReduceOp.SUM),
        # above the fusing limit the check runs as its own program first
        "large": lambda: jdist.all_reduce(np.ones(100_000 + r, np.float32)),
        # a barrier meets another collective: found through the heartbeat, not the timeout
        "barrier": lambda: jdist.barrier() if r == 0 else jdist.all_reduce(np.ones(3)),
    }
    for name, call in cases.items():
        t = time.monotonic()
        try:
            call()
            out[name] = ("no error", 0.0)
        except CollectiveMismatchError as e:
            out[name] = (str(e), time.monotonic() - t)
    # the group is still usable and in step after the mismatches
    assert (jdist.all_reduce(np.full(4, r + 1.0)) == 3.0).all()
    g = jdist.get_default_group()
    stats = _engine.stats(g)
    before = (stats["calls"], stats["checked"])
    jdist.all_reduce(np.ones(4))
    out["checked_on"] = (stats["calls"] - before[0], stats["checked"] - before[1])
    os.environ["JDIST_DEBUG"] = "OFF"
    before = (stats["calls"], stats["checked"])
    jdist.all_reduce(np.ones(4))
    out["checked_off"] = (stats["calls"] - before[0], stats["checked"] - before[1])
    before = (stats["calls"], stats["checked"])
    jdist.all_reduce(np.ones(100_000, np.float32))
    out["checked_off_large"] = (stats["calls"] - before[0], stats["checked"] - before[1])
    try:  # a one-trip call carries its fingerprint anyway: compared with the check off
        jdist.all_reduce(np.ones(2 + r, np.float32))
        out["off_small"] = "no error"
    except CollectiveMismatchError as e:
        out["off_small"] = str(e)
    del os.environ["JDIST_DEBUG"]
    # a rank that never calls: the other raises after the group timeout, naming it
    if r == 0:
        t = time.monotonic()
        try:
            jdist.all_reduce(np.ones(4))
            out["straggler"] = ("no error", 0.0)
        except CollectiveTimeoutError as e:
            out["straggler"] = (str(e), time.monotonic() - t)
    else:
        time.sleep(TIMEOUT + 4)
    jdist.destroy_process_group()
    return out


def test_mismatch_raises_on_every_rank():
    results = run_procs(_mismatch_child, 2, timeout=120)
    for r, res in enumerate(results):
        msg, dt = res["shape"]
        assert "rank 0 is running all_reduce" in msg and "shape=(2,)" in msg, msg
        assert "rank 1 is running all_reduce" in msg and "shape=(3,)" in msg, msg
        assert dt < 10.0, (r, dt)
        msg, _ = res["dtype"]
        assert "dtype=float32" in msg and "dtype=int32" in msg, msg
        msg, _ = res["kind"]
        assert "running all_reduce" in msg and "running broadcast" in msg, msg
        msg, _ = res["op"]
        assert "op=SUM" in msg and "op=MAX" in msg, msg
        msg, _ = res["large"]
        assert "shape=(100000,)" in msg and "shape=(100001,)" in msg, msg
        msg, dt = res["barrier"]
        assert "running barrier" in msg and "running all_reduce" in msg, msg
        assert dt < TIMEOUT, (r, dt)  # before the group timeout
        # checked: one fused program run; JDIST_DEBUG=OFF: a call that fits one slot
        # still runs the one-trip program (compared for free), a larger one a plain run
        assert res["checked_on"] == (1, 1) and res["checked_off"] == (1, 1), res
        assert res["checked_off_large"] == (1, 0), res
        assert "shape=(2,)" in res["off_small"] and "shape=(3,)" in res["off_small"]
        assert "costs an exchange of its own" in res["off_small"], res["off_small"]
    msg, dt = results[0]["straggler"]
    assert "timed out" in msg and "rank 1 is still at collective #" in msg, msg
    assert TIMEOUT - 1 <= dt < TIMEOUT + 5, dt


def _dying_rank() -> None:
    """Grandchild acting as the victim: joins, does one collective, then is SIGKILLed."""
    import jdist

    jdist.init_process_group(timeout=30)
    jdist.all_reduce(np.ones(3))
    os.kill(os.getpid(), signal.SIGKILL)


def _survivor(call: str = "all_reduce") -> dict:
    import jdist
    from jdist.errors import PeerFailedError

    jdist.init_process_group(timeout=30)
    jdist.all_reduce(np.ones(3))
    t = time.monotonic()
    try:
        for _ in range(1000):
            if call == "barrier":  # the store-based arrival finds the dead pid
                jdist.barrier()
            jdist.all_reduce(np.ones(3))
            time.sleep(0.01)
        return {"error": "no error"}
    except PeerFailedError as e:
        return {"error": str(e), "seconds": time.monotonic() - t}


def _grandchild(fn: str) -> subprocess.CompletedProcess:
    code = (f"import json; from tests.collectives.test_mismatch import {fn}; "
            f"print(json.dumps({fn}()), flush=True)")
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ), timeout=90,
                          capture_output=True, text=True)


def _survivor_or_victim(victim: int) -> dict:
    """The victim runs as a child of its spawned process, so that spawn does not end the
    job when it dies. When rank 0 dies, JAX's coordination service (hosted in rank 0's
    process) dies with it and JAX's client aborts the survivor right after its error, so
    the survivor runs as a child too and reports what it printed."""
    rank = int(os.environ["RANK"])
    if rank == victim:
        return {"victim_exit": _grandchild("_dying_rank").returncode}
    if victim != 0:
        return _survivor("barrier")
    proc = _grandchild("_survivor")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return {**(json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}),
            "exit": proc.returncode}


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_is_named_by_survivor(victim):
    results = run_procs(_survivor_or_victim, 2, args=(victim,), timeout=120)
    survivor = results[1 - victim]
    assert results[victim]["victim_exit"] == -signal.SIGKILL, results
    assert f"rank {victim} is gone" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < 30, results
    if victim == 0:  # named before JAX's client (its service died with rank 0) aborts it
        assert survivor["exit"] in (0, -signal.SIGABRT), results
