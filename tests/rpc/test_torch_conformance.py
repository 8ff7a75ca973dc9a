"""torch's own RPC and distributed-autograd test cases on jdist (issue #16): one launch
of 3 real processes runs every case (see ``_conformance_workers``), then the graceful
shutdown of passive workers that wait for a master busier than their shutdown_timeout."""

from __future__ import annotations

import pytest

from tests.helpers import run_procs
from tests.rpc import _conformance_workers as W

EXPECTED = [f.__name__ for f in W._CASES]


@pytest.fixture(scope="module")
def results():
    return run_procs(W.run, W.WS, timeout=300)


@pytest.mark.parametrize("name", EXPECTED)
def test_case(results, name):
    for rank, res in enumerate(results):
        assert res["cases"].get(name) == "ok", f"rank {rank}: {res['cases'].get(name)}"


def test_graceful_shutdown_waits_for_busy_master(results):
    master = results[0]["shutdown"]
    assert master["master_calls"] == [0, 1, 2, 3, 9]
    assert master["master_worked"] > 3.0  # > the workers' shutdown_timeout of 1 s
    for rank in (1, 2):  # they called shutdown at once and waited for the master
        assert results[rank]["shutdown"]["shutdown_took"] >= master["master_worked"] - 0.5
