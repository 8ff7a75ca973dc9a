"""torch's in-place collectives on immutable jax arrays (issue 43, item 5): a statement
call whose output is a jax.Array would leave the old value to be read next (a silent
wrong result), so it raises ImmutableTargetError, on every rank and before anything is
sent (no rank waits on one that raised); a used result and a numpy output work.
Real processes (2, gloo); the worker is tests/collectives/inplace_cases.py."""

from __future__ import annotations

import numpy as np
import pytest

from jdist.collectives._inplace import result_discarded
from jdist.errors import ImmutableTargetError
from tests.collectives.inplace_cases import STATEMENTS, statement_calls
from tests.helpers import run_procs


def test_statement_calls_with_jax_outputs_are_refused_on_every_rank():
    res = run_procs(statement_calls, 2, timeout=240)
    names = [st.__name__ for st in STATEMENTS]
    for r in (0, 1):
        refused = res[r]["refused"]
        want = names + (["st_recv"] if r == 1 else [])
        assert [n for n, _, _ in refused] == want, refused
        for name, _, text in refused:
            op = name[3:]
            assert f"jdist.{op}(" in text and "called as a statement" in text
            assert f"= jdist.{op}(" in text and "numpy array" in text  # the two fixes
        for name, got, want_values in res[r]["used"]:
            np.testing.assert_allclose(got, want_values, err_msg=name)
        assert res[r]["numpy"] == [2.0] * 4
    assert res[1]["recv"] == (0, [0.0, 1.0, 2.0, 3.0])


@pytest.mark.parametrize("shape", ["statement", "assigned", "returned", "argument",
                                   "attribute", "in_loop"])
def test_a_discarded_result_is_read_from_the_callers_bytecode(shape):
    """The mechanism, per calling shape: only a popped value counts as discarded."""
    seen = []

    def probe():
        seen.append(result_discarded(1))
        return 0

    if shape == "statement":
        probe()
    elif shape == "assigned":
        _ = probe()
    elif shape == "returned":
        (lambda: probe())()
    elif shape == "argument":
        abs(probe())
    elif shape == "attribute":
        probe().real  # noqa: B018 - the value is used (its attribute read)
    else:
        for _ in range(2):
            probe()
    assert seen and all(s == (shape in ("statement", "in_loop")) for s in seen), seen


def test_the_error_is_a_typeerror_and_a_runtimeerror():
    assert issubclass(ImmutableTargetError, TypeError)
    assert issubclass(ImmutableTargetError, RuntimeError)
