"""RRef loss race: thousands of remote/forward/fetch operations over fresh RPC sessions,
three real processes, zero losses and nothing left in any owner table."""

from __future__ import annotations

from tests.helpers import run_procs
from tests.rpc._stress_workers import run_sessions

SESSIONS, CYCLES, TTL = 8, 40, 3


def test_no_rref_lost_across_fresh_sessions():
    results = run_procs(run_sessions, 3, args=(SESSIONS, CYCLES, TTL), timeout=240)
    losses = [loss for r in results for loss in r["losses"]]
    assert losses == [], f"{len(losses)} RRef losses, first: {losses[:3]}"
    assert sum(r["ops"] for r in results) >= 2000
    for r in results:
        assert all(not any(left) for left in r["leftovers"]), r["leftovers"]
