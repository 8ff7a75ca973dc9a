"""torch's test/distributed/algorithms/test_join.py on jdist's generic Join.

torch's nine cases run in one shared launch of 2 processes (torch's CPU world size);
the cheap argument checks run in-process.
"""

from __future__ import annotations

import numpy as np
import pytest

from jdist.algorithms.join import Join, Joinable, JoinHook
from tests.algorithms import join_cases as jc
from tests.helpers import run_procs

EXHAUSTED = "Rank 0 exhausted all inputs."
DETECTED = "Detected at least one rank that exhausted inputs. Throwing across all ranks."


@pytest.fixture(scope="module")
def ranks():
    return run_procs(jc.main, 2, timeout=240)


def _expected_total(rank, world):
    """Non-joined processes all-reduce a 1: this rank's total is the number of inputs
    processed by all processes before it joined (torch's formula)."""
    total = world * jc.BASE_NUM_INPUTS
    for num_joined in range(1, rank + 1):
        total += (world - num_joined) * jc.OFFSET
    return total


def _check(ranks, name, expected_total=None, post_hooks=False):
    for rank, r in enumerate(ranks):
        got = r[name]
        assert got["before"] == [jc.BEFORE_CONSTANT] * len(got["before"])
        assert got["error"] is None, got["error"]
        if expected_total is not None:
            assert got["total"] == expected_total(rank, r["world"])
        if post_hooks:
            assert got["after"] == [jc.AFTER_CONSTANT] * len(got["after"])


def _check_throw(ranks, name):
    for rank, r in enumerate(ranks):
        cls, msg = r[name]["error"]
        assert cls == "JoinError"  # a RuntimeError, as torch's
        assert msg == (EXHAUSTED if rank == 0 else DETECTED)


def test_single_joinable_main_hooks(ranks):
    _check(ranks, "single_joinable_main_hooks", _expected_total)


def test_single_joinable_post_hooks(ranks):
    _check(ranks, "single_joinable_post_hooks")


def test_single_joinable(ranks):
    _check(ranks, "single_joinable", _expected_total, post_hooks=True)


def test_multiple_joinables(ranks):
    _check(ranks, "multiple_joinables", lambda r, w: 3 * _expected_total(r, w),
           post_hooks=True)


def test_single_joinable_disable(ranks):
    _check(ranks, "single_joinable_disable", lambda r, w: w * jc.BASE_NUM_INPUTS)


def test_multiple_joinable_disable(ranks):
    _check(ranks, "multiple_joinable_disable", lambda r, w: 3 * w * jc.BASE_NUM_INPUTS)


def test_single_joinable_throw(ranks):
    _check_throw(ranks, "single_joinable_throw")


def test_multiple_joinables_throw(ranks):
    _check_throw(ranks, "multiple_joinables_throw")


def test_join_kwargs(ranks):
    _check(ranks, "join_kwargs", lambda r, w: 2 * _expected_total(r, w))


# ---------------------------------------------------------------- in-process checks
class _Plain(Joinable):
    def __init__(self, group=None, call_base=True):
        if call_base:
            super().__init__()
        self.group = group

    def join_hook(self, **kwargs):
        return JoinHook()

    @property
    def join_device(self):
        return None

    @property
    def join_process_group(self):
        return self.group


def test_join_needs_a_joinable():
    with pytest.raises(ValueError, match="requires at least one joinable"):
        Join([])


def test_join_rejects_two_process_groups():
    with pytest.raises(ValueError, match="multiple process groups"):
        Join([_Plain("a"), _Plain("b")])


def test_notify_needs_the_joinable_constructor():
    with pytest.raises(AssertionError, match="calls the ``Joinable`` constructor"):
        Join.notify_join_context(_Plain(call_base=False))


def test_notify_outside_a_context_is_vacuous():
    assert Join.notify_join_context(_Plain()) is None


def test_hooks_default_to_nothing():
    hook = JoinHook()
    assert hook.main_hook() is None and hook.post_hook(True) is None
    assert np.isscalar(jc.AFTER_CONSTANT)


def test_warns_on_a_skew_over_the_threshold(monkeypatch):
    """torch's warning once a joined process shadowed more than 1000 iterations."""
    from jdist.algorithms import _join

    counts = iter([1] * (_join.WARN_THRESHOLD + 1) + [0])
    monkeypatch.setattr(Join, "_get_num_nonjoined_procs", lambda self: next(counts))
    monkeypatch.setattr(_join, "_collectives", lambda: _FakeCollectives)
    with pytest.warns(UserWarning, match="Detected uneven input skew of greater than 1000"):
        with Join([_Plain(_FakeGroup())]):
            pass


class _FakeGroup:
    rank = 0


class _FakeCollectives:
    ProcessGroup = _FakeGroup
