"""torch's own collective test cases on jdist, in one 4-process job.

The cases (``conformance_cases.py``) follow ``distributed_test.py`` and
``test_c10d_gloo.py`` with torch's inputs and assertions: complex dtypes, ``[]`` lists
on non-root ranks, uneven ``reduce_scatter``, both ``reduce_scatter_tensor`` input
forms, ``get_backend`` and collectives on non-members, ``scatter_object_list``'s
wording, the five ``monitored_barrier`` cases, torch's barrier-timeout cases, and a lone
``barrier`` on a group with a 1 s timeout (issue #15).
"""

from __future__ import annotations

import pytest

from tests.collectives.conformance_cases import conformance
from tests.helpers import run_procs


@pytest.mark.slow(seconds=34)  # a long end-to-end run
def test_torch_collective_cases_4_processes():
    res = run_procs(conformance, 4, timeout=300)
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    lone = res[0]["lone_barrier_s"]
    assert 0.9 < lone < 10, lone  # the group's 1 s, not XLA's process-wide timeout
