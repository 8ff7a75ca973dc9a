"""torch's snapshot idiom, ``if rank == 0: save(...)``, with real processes.

The grid {save on every rank, on rank 0 only, on rank 1 only} x {replicated values
and JSON only, plus a sampler (positions differ per rank), plus an array sharded over
both processes} x {sync, async} runs in one launch of 2 processes
(``rank0_cases.grid``). The oracle is what each rank saved: a save must either give a
checkpoint that every rank restores to those values, or raise a named error on the
calling rank within seconds and write nothing; and a save on every rank and a restore
afterwards must work (nothing waits on the one-rank save).
"""

from __future__ import annotations

import pytest

from tests.checkpoint.rank0_cases import PEER_TIMEOUT, grid
from tests.helpers import run_procs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rank0"))
    ranks = run_procs(grid, 2, args=(root,), timeout=300)
    return {(c["who"], c["kind"], c["async"]): (c, ranks[1][i])
            for i, c in enumerate(ranks[0])}


CASES = [(who, kind, a) for kind in ("replicated", "sampler", "sharded")
         for who in ("all", 0, 1) for a in (False, True)]


@pytest.mark.parametrize("who,kind,async_save", CASES)
def test_one_rank_save_restores_or_raises_at_once(results, who, kind, async_save):
    recs = results[(who, kind, async_save)]
    callers = [r for r in (0, 1) if who in ("all", r)]
    works = who == "all" or kind == "replicated"
    for r in callers:
        rec = recs[r]
        if works:
            assert "error" not in rec and rec["save"] is True, rec.get("error")
            assert rec["save_s"] < 15, rec["save_s"]
        else:  # a value of each rank's own: one rank cannot save it
            err = rec.get("error", "")
            assert "did not call it within" in err and "every rank" in err, rec
            assert ("state['sampler']" if kind == "sampler" else "state['shard']") in err
            assert rec["save_s"] < PEER_TIMEOUT + 5, rec["save_s"]
    source = recs[callers[0]]["saved"]
    for r in (0, 1):
        rec = recs[r]
        if works:
            assert rec["steps"] == [5] and rec["restored_step"] == 5, rec
            # every rank gets the saved values: its own when every rank saved,
            # the saving rank's (all replicated) when one did
            want = rec["saved"] if who == "all" else source
            assert rec["restored"] == want, (r, rec["restored"], want)
        else:  # nothing half-written: no part, no step, a fresh start
            assert rec["steps"] == [] and rec["restored_step"] is None, rec
            assert not any(e.startswith("rank_") for e in rec["entries"]), rec["entries"]
            assert rec["restored"]["w"] == [0.0] * 5
        after = rec["after"]
        assert after["step"] == 6 and after["view"] == rec["after_expect"], after
        assert after["s"] < 30, after["s"]
