"""torch's ``DistributedDataParallel(...)`` arguments in a ported call (jdist/ddp/_torch_args.py).

Generated from torch's own signature: every argument torch's DDP takes that jdist does
not name is handled (a new one in a later torch fails here, asking for a decision),
with torch's default; its default and its accepted values build a DDP whose step equals
a plain one; values asking for what jdist does not do raise ValueError naming the
argument and the fix.
"""

from __future__ import annotations

import inspect

import jax
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp._torch_args import TORCH_ONLY

_TORCH = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
_OURS = inspect.signature(DDP.__init__).parameters
_TORCH_ONLY = [n for n in _TORCH if n not in ("self", "module") and n not in _OURS]

ACCEPTED = {"device_ids": [0], "output_device": 0, "dim": 0, "check_reduction": True,
            "gradient_as_bucket_view": True, "static_graph": True,
            "skip_all_reduce_unused_params": True, "batched_grad_copy": True}
REFUSED = [("mixed_precision", object()), ("device_mesh", object()),
           ("delay_all_reduce_named_params", [("kernel", object())]),
           ("param_to_hook_all_reduce", object()), ("dim", 1), ("device_ids", [0, 1])]


def _group():
    devs = tuple(jax.devices()[:2])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs, "dp"), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name="torch-args")


def _step_params(**kwargs):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    step = DDP(model, process_group=_group(), **kwargs).train_step(
        lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
        nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 12
    step((x, np.ones((4, 2), np.float32)))
    return {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(model, nnx.Param)).items()}


def test_every_torch_argument_is_handled_with_torchs_default():
    assert sorted(_TORCH_ONLY) == sorted(TORCH_ONLY)
    for name in _TORCH_ONLY:
        assert _TORCH[name].default == TORCH_ONLY[name], name
    assert set(ACCEPTED) | {n for n, _ in REFUSED} == set(TORCH_ONLY)


@pytest.fixture(scope="module")
def plain():
    return _step_params()


@pytest.mark.parametrize("name", sorted(TORCH_ONLY))
def test_torch_default_changes_nothing(name, plain):
    got = _step_params(**{name: TORCH_ONLY[name]})
    for k in plain:
        np.testing.assert_array_equal(got[k], plain[k])


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_values_step_as_a_plain_ddp(name, plain):
    got = _step_params(**{name: ACCEPTED[name]})
    for k in plain:
        np.testing.assert_allclose(got[k], plain[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name, value", REFUSED)
def test_what_jdist_does_not_do_is_refused_naming_the_fix(name, value):
    with pytest.raises(ValueError, match=rf"DistributedDataParallel\({name}=") as e:
        DDP(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), process_group=_group(), **{name: value})
    assert any(w in str(e.value) for w in ("pass ", "drop ", "set ", "give ", "put ")), e.value


def test_bad_flag_types_unknown_names_and_conflicts():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"static_graph='yes'\): expected True or False"):
        DDP(model, process_group=_group(), static_graph="yes")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['bucket_cap'\]"):
        DDP(model, process_group=_group(), bucket_cap=25)
    with pytest.raises(ValueError, match="gradient_as_bucket_view=True, flat_buckets=True"):
        DDP(model, process_group=_group(), gradient_as_bucket_view=True, flat_buckets=True)
