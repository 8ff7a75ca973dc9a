"""SyncBatchNorm over replicas with unequal and empty shares of the batch (torch's
SyncBatchNorm weighs ranks by their counts): a grid of row counts, variance modes and
input ranks, each one padded DDP step against a plain BatchNorm over the real rows (the
2-process cases share tests/ddp/test_flax_habits.py's launch)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jdist.collectives._group import ProcessGroup, make_mesh
from tests.ddp import syncbn_cases
from tests.ddp.models import max_diff


def _group(n):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"syncbn{n}")


def _check(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert max_diff(got[1], want[1]) < 1e-5


# 4 replicas of 2 rows each (pad to 8): n real rows leave replicas with
# [2,2,2,2], [2,2,1,0], [1,0,0,0], ... real rows
@pytest.mark.parametrize("n", [1, 3, 5, 8])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("ndim", [2, 4])
def test_padded_replicas_count_only_real_rows(n, fast, ndim):
    x = syncbn_cases.rows(n, ndim)
    got = syncbn_cases.ddp_step(x, 8, ndim, fast, group=_group(4))
    _check(got, syncbn_cases.reference([x], ndim, fast))


def test_plain_batchnorm_with_axis_name_is_converted():
    from flax import nnx

    from jdist.ddp import SyncBatchNorm, convert_sync_batchnorm

    m = syncbn_cases.make_model(2)
    bn = m.bn
    assert convert_sync_batchnorm(m, _group(2)) is m
    assert m.bn is bn and isinstance(bn, SyncBatchNorm) and bn.axis_name == "dp"
    assert isinstance(bn, nnx.BatchNorm)
