"""Eager collectives in real processes against numpy references.

The 3-process launch runs the whole battery in ``eager_cases.py``: every collective x
every ReduceOp x {float32, int32, bool} (where valid), numpy and jax inputs, int64, async
work, objects of unequal sizes, a ring of send/recv and isend/irecv, recv from any
source, sub-groups, and no recompilation on repeated calls. The 2 x 2-device launch
runs the same battery over float32.
"""

from __future__ import annotations

import pytest

from tests.collectives.eager_cases import battery
from tests.helpers import run_procs


@pytest.mark.slow(seconds=18)  # the whole battery on 3 processes
def test_eager_battery_3_processes():
    res = run_procs(battery, 3, timeout=240)
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["local_devices"] == 1 for r in res)


def test_eager_battery_2_processes_2_devices_each():
    """Two devices per process lower each collective differently (a local stage); the
    element types were covered above, so float32 runs every op here."""
    res = run_procs(battery, 2, args=(True, ("float32",)), devices_per_proc=2, timeout=240)
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["local_devices"] == 2 for r in res)
