"""The replica check is a collective, so every process must decide alike whether a DDP
call runs it (jdist/ddp/_replicas.py's invariant). Generated call sequences: each
process makes the same collective calls, with its own non-collective calls (a forward
on one rank) interleaved anywhere; the calls that check are the same on every process,
never a non-collective one: the first collective call, then a call after the parameters
changed outside DDP, at most once per CHECK_EVERY_CALLS collective calls.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jdist.ddp import _replicas
from jdist.ddp._replicas import CHECK_EVERY_CALLS, ProcessChecks


class _Group:
    def size(self):
        return 2


def _decisions(steps, monkeypatch):
    """Run one process's calls on its ProcessChecks: ``steps`` is a list of (forwards
    made alone before the collective call, index among them where the parameters
    change outside DDP or None). Returns the collective calls that checked."""
    checked = []
    monkeypatch.setattr(_replicas, "check_replicas", lambda group, placed: checked.append(1))
    checks, params = ProcessChecks(_Group()), [np.zeros(1)]
    for n, (alone, change_at) in enumerate(steps):
        for j in range(alone + 1):
            if change_at == j:
                params = [np.zeros(1)]  # new arrays: an update outside DDP
            collective = j == alone
            before = len(checked)
            checks.replicas(params, params, collective=collective)
            checks.seen(params, collective=collective)
            assert collective or len(checked) == before  # never on a call made alone
        if len(checked) > before:
            yield n


# (monkeypatch sets the same stub for every example: nothing to reset)
@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changed=st.lists(st.booleans(), min_size=1, max_size=80), data=st.data())
def test_processes_check_at_the_same_collective_calls(changed, data, monkeypatch):
    runs = []
    for _ in range(2):  # two processes, each with its own forwards made alone
        steps = []
        for c in changed:
            alone = data.draw(st.integers(0, 2))
            steps.append((alone, data.draw(st.integers(0, alone)) if c else None))
        runs.append(list(_decisions(steps, monkeypatch)))
    assert runs[0] == runs[1]
    want, last = [], None  # the rule, read plainly
    for i, c in enumerate(changed):
        if (c or i == 0) and (last is None or i - last >= CHECK_EVERY_CALLS):
            want.append(i)
            last = i
    assert runs[0] == want
