"""The mismatch-check mode in force when a collective is *issued* governs it
(``jdist/collectives/_fingerprint.py`` ``issued``, used by ``Queues.submit``).

A checked call runs other programs than an unchecked one, so a program that switches
``JDIST_DEBUG`` between issuing an async collective and its execution on the group's
worker thread used to have ranks run different programs and hang (seen in CI as a
gloo timeout in ``test_staging.py``). ``Work.wait()`` also keeps an operation's own
timeout error instead of relabelling it as its own wait's timeout.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import threading

import numpy as np
import pytest

from jdist.collectives import _fingerprint as fpr
from jdist.collectives._work import Queues, Work
from jdist.errors import CollectiveTimeoutError
from tests.helpers import run_procs


@pytest.mark.parametrize("at_issue,later", list(itertools.product(["ON", "OFF", ""], repeat=2)))
def test_a_queued_call_runs_under_the_mode_it_was_issued_in(monkeypatch, at_issue, later):
    q = Queues()
    gate = threading.Event()
    try:
        q.submit("k", gate.wait)  # holds the worker so the next call runs after the flip
        monkeypatch.setenv("JDIST_DEBUG", at_issue)
        fut = q.submit("k", fpr.debug_enabled)
        monkeypatch.setenv("JDIST_DEBUG", later)
        gate.set()
        assert fut.result(10) == (at_issue != "OFF")
        # the pin does not leak into later work on that thread, nor into this one
        assert q.submit("k", fpr.debug_enabled).result(10) == (later != "OFF")
        assert fpr.debug_enabled() == (later != "OFF")
    finally:
        gate.set()
        q.shutdown()


def test_wait_keeps_an_operations_own_timeout_error():
    fut: cf.Future = cf.Future()
    fut.set_exception(CollectiveTimeoutError("all_reduce (collective #3) timed out: rank 1 "
                                             "is still at #2"))
    with pytest.raises(CollectiveTimeoutError, match="rank 1 is still at #2"):
        Work(fut, "all_reduce").wait()
    pending: cf.Future = cf.Future()
    with pytest.raises(CollectiveTimeoutError, match="did not complete within 0.05 s"):
        Work(pending, "all_reduce").wait(0.05)


def _child(modes: tuple):
    import time

    import jdist

    jdist.init_process_group()
    rank = jdist.get_rank()
    got = []
    for step, (first, second) in enumerate(modes):
        if rank == 1:
            time.sleep(0.3)  # rank 0's worker stays inside the first call meanwhile
        os.environ["JDIST_DEBUG"] = first
        w1 = jdist.all_reduce(np.full(3, rank + step, np.float32), async_op=True)
        os.environ["JDIST_DEBUG"] = second
        w2 = jdist.all_reduce(np.full(5, rank * step, np.float32), async_op=True)
        if rank == 1:
            w2.wait(60)  # rank 1 runs both calls before it flips the mode
        # rank 0 flips the mode again while its second call still waits in the queue
        os.environ["JDIST_DEBUG"] = "OFF" if second != "OFF" else "ON"
        got.append((np.asarray(w1.wait(60)).tolist(), np.asarray(w2.wait(60)).tolist()))
    jdist.destroy_process_group()
    return got


def test_ranks_that_flip_the_mode_after_issuing_still_run_the_same_programs():
    modes = tuple(itertools.product(["ON", "OFF"], repeat=2))
    got = run_procs(_child, 2, args=(modes,), timeout=120)
    want = [([float(1 + 2 * s)] * 3, [float(s)] * 5) for s in range(len(modes))]
    assert got == [want, want]
