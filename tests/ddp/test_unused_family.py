"""find_unused_parameters over its family: {flat, not flat} x {hook, none} x {every way a
parameter gets no gradient} x {bucket per parameter, one bucket} x {1 process x 2 and 4
devices, 2 processes}, each against plain single-device training (torch's
test_ignored_output_with_unused_parameters, test_ddp_shared_grad_acc_unused_params,
test_global_local_unused_params_grad, test_find_unused_parameters_when_unused_parameters_empty
and test_dataclass_output_unused_param are members)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jdist.collectives._group import ProcessGroup, make_mesh
from tests.ddp import unused_cases
from tests.ddp.models import max_diff
from tests.helpers import run_procs

_REFS: dict = {}


def _reference(usage):
    if usage not in _REFS:
        _REFS[usage] = unused_cases.reference(usage)
    return _REFS[usage]


def _group(n):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"unused{n}")


def _check(case, got):
    assert not isinstance(got, str), f"{case}: {got}"
    losses, params = got
    ref_losses, ref_params = _reference(case[2])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6, err_msg=str(case))
    assert max_diff(params, ref_params) < 1e-5, case
    if case[2] in ("unused", "stop_gradient", "ignored_output", "shared"):
        init = unused_cases.make_model(case[2]).b  # b never moves
        np.testing.assert_array_equal(params["b"]["kernel"], np.asarray(init.kernel[...]))


# the cases the 2-process job does not run (there each (flat, hook, usage) runs with one
# bucket cap, here with the other), on 2 and 4 devices in turn: every case runs once
ONE_PROCESS = [c for c in unused_cases.CASES if c not in unused_cases.MP_CASES]


@pytest.mark.parametrize("case", ONE_PROCESS, ids=str)
def test_one_process_devices(case):
    n = 2 if ONE_PROCESS.index(case) % 2 else 4
    _check(case, unused_cases.run_case(case, group=_group(n)))


def test_the_two_layouts_cover_every_case():
    both = ONE_PROCESS + unused_cases.MP_CASES
    assert sorted(both, key=str) == sorted(unused_cases.CASES, key=str)
    assert len(ONE_PROCESS) == 20


def test_two_processes_every_case():
    res = run_procs(unused_cases.run_all, 2, timeout=300)
    assert len(unused_cases.MP_CASES) == 20
    for case in unused_cases.MP_CASES:
        for r in res:
            _check(case, r[case])
        assert res[0][case][0] == res[1][case][0]  # the same mean loss on both ranks
        assert max_diff(res[0][case][1], res[1][case][1]) == 0
