"""torch's DDP tests of ``distributed_test.py`` that need no second process, for jdist.

torch runs them on one GPU per rank; here the ranks are the replicas of one process
(2 virtual CPU devices: the embedded default, where a process drives several devices).
Each test keeps torch's model, inputs, iteration counts and assertions. torch's
``p += p.grad`` update is written as :func:`_add_grads`; torch's ``p.grad is None`` for
parameters without gradient is a zero gradient here (JAX gradients are dense). The cases
that need several processes are in ``test_dist_ddp_multiproc.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp import SyncBatchNorm, convert_sync_batchnorm
from jdist.errors import UnusedParametersError
from tests.ddp.models import max_diff

WORLD = 2  # torch's ranks, as replicas


def _group(n=WORLD, axis="dp"):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs, axis), axis_name=axis,
                        backend="local", devices_per_rank=(devs,), name=f"h4-{axis}{n}")


def _params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _add_grads(model, grads):
    """torch's ``_model_step``: ``p += p.grad`` for every parameter."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p + g, state, grads))


@functools.cache
def _jitted_grad(loss):
    return nnx.jit(nnx.grad(loss))


def _local_grads(model, loss, *args):
    """Local (one-device) gradients of ``loss`` over the whole batch."""
    return _jitted_grad(loss)(model, *args)


def _close(a, b, tol=1e-5):
    assert max_diff(a, b) < tol, (a, b)


# --------------------------------------------------------------------------- models
class Net(nnx.Module):
    """torch's test ``Net``: three bias-free Linears, ReLU, softmax."""

    def __init__(self, seed=0):
        r = nnx.Rngs(seed)
        self.fc1 = nnx.Linear(2, 10, use_bias=False, rngs=r)
        self.fc2 = nnx.Linear(10, 50, use_bias=False, rngs=r)
        self.fc3 = nnx.Linear(50, 4, use_bias=False, rngs=r)

    def __call__(self, x):
        x = jax.nn.relu(self.fc1(x))
        x = jax.nn.relu(self.fc2(x))
        return jax.nn.softmax(self.fc3(x), axis=1)


class BatchNormNet(nnx.Module):
    """torch's ``BatchNormNet``: BatchNorm1d(4) over (N, 4, 10), features last here."""

    def __init__(self, affine=True, dtype=jnp.float32):
        r = nnx.Rngs(0)
        kw = {"dtype": dtype, "param_dtype": dtype}
        self.fc1 = nnx.Linear(2, 40, use_bias=False, rngs=r, **kw)
        self.bn = nnx.BatchNorm(4, use_scale=affine, use_bias=affine, momentum=0.9,
                                epsilon=1e-5, rngs=r, **kw)
        self.fc2 = nnx.Linear(40, 4, use_bias=False, rngs=r, **kw)

    def __call__(self, x):
        x = self.fc1(x).reshape(-1, 10, 4)
        x = self.bn(x).reshape(-1, 40)
        return jax.nn.softmax(self.fc2(x), axis=1)


class BN1d(nnx.Module):
    """``nn.BatchNorm1d(2)`` on its own."""

    def __init__(self):
        self.bn = nnx.BatchNorm(2, momentum=0.9, epsilon=1e-5, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(x)


def _mse(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


# ------------------------------------------------------------ torch's _test_DDP_niter
def _ddp_niter(make, x, y, *, local_bs, convert=False, n_iter=5, **ddp_kw):
    """A model on the whole batch and a DDP copy on each replica's ``local_bs`` rows,
    both updated with ``p += grad``, must hold the same parameters after every
    iteration; the batch is shuffled between iterations (torch's ``_test_DDP_niter``).
    Returns the largest difference seen."""
    base, dmodel = make(), make()
    if convert:
        dmodel = convert_sync_batchnorm(dmodel, ddp_kw.get("process_group"))
    ddp = DDP(dmodel, **ddp_kw)
    vg = ddp.value_and_grad(_mse)
    world = ddp.process_group.num_replicas
    rng = np.random.RandomState(0)
    worst = 0.0
    for _ in range(n_iter):
        _add_grads(base, _local_grads(base, _mse, (x, y)))
        rows = slice(0, local_bs * world)  # every replica's rows, in replica order
        _, grads = vg((x[rows], y[rows]))
        _add_grads(dmodel, grads)
        worst = max(worst, max_diff(_params(base), _params(dmodel)))
        perm = rng.permutation(len(x))
        x, y = x[perm], y[perm]
    return worst


def _data(n, din=2, dout=4, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, din).astype(np.float32), rng.randn(n, dout).astype(np.float32)


@pytest.mark.parametrize("flat", [True, False])
def test_DistributedDataParallelCPU_grad_is_view(flat):
    """``gradient_as_bucket_view=True`` is jdist's ``flat_buckets=False`` (no copy into
    a bucket buffer); either way DDP tracks the non-parallel model."""
    x, y = _data(2 * WORLD)
    assert _ddp_niter(Net, x, y, local_bs=2, process_group=_group(),
                      flat_buckets=flat) < 1e-5


@pytest.mark.parametrize("flat", [True, False])
def test_DistributedDataParallel(flat):
    """torch's GPU parity test (bucket views on and off; ``device_ids`` and
    ``output_device`` have no counterpart: the group's mesh places everything)."""
    x, y = _data(2 * WORLD, seed=1)
    assert _ddp_niter(Net, x, y, local_bs=2, process_group=_group(), flat_buckets=flat,
                      bucket_cap_mb=0.001) < 1e-5


def test_DistributedDataParallel_requires_grad():
    class Empty(nnx.Module):
        pass

    with pytest.raises(RuntimeError, match="DistributedDataParallel is not needed when a "
                       "module doesn't have any parameter that requires a gradient."):
        DDP(Empty(), process_group=_group())


def test_ddp_zero_output_features():
    class ToyModel(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.net1 = nnx.Linear(10, 10, rngs=r)
            # flax's default initializer divides by the fan-out: give it zeros
            self.net2 = nnx.Linear(10, 0, kernel_init=nnx.initializers.zeros_init(), rngs=r)

        def __call__(self, x):
            return self.net2(jax.nn.relu(self.net1(x)))

    ddp = DDP(ToyModel(), process_group=_group())  # torch: construction must not fail
    out = ddp(np.ones((4, 10), np.float32))
    assert out.shape == (4, 0)


def test_ddp_create_graph():
    """torch: ``backward(create_graph=True)`` six times. In JAX a loss that needs
    gradients of gradients takes them itself (``jax.grad`` inside the loss); DDP then
    reduces the outer gradient: loss p**2 + (d(p**2)/dp)**2 = 5 p**2, grad 10 p."""

    class Model(nnx.Module):
        def __init__(self):
            self.p = nnx.Param(jnp.asarray(1.0))

    def loss(m, batch):
        inner = jax.grad(lambda p: p ** 2)(m.p[...])
        return m.p[...] ** 2 + inner ** 2 + 0.0 * batch.sum()

    model = Model()
    vg = DDP(model, process_group=_group()).value_and_grad(loss)
    for _ in range(6):
        value, grads = vg(np.zeros((WORLD,), np.float32))
        p = float(model.p[...])
        assert float(value) == pytest.approx(5 * p ** 2)
        assert float(grads["p"][...]) == pytest.approx(10 * p)


@pytest.mark.parametrize("flat", [True, False])
def test_accumulate_gradients_no_sync(flat):
    """torch's ``_test_accumulate_gradients_no_sync`` (``_grad_is_view``: ``flat=False``):
    iteration 0 accumulates inside ``no_sync``, iteration 1 syncs; the synced gradients
    equal the non-parallel model's accumulated ones. A forward inside ``no_sync`` (torch:
    under ``no_grad``) accumulates nothing. Departure: inside ``no_sync`` jdist returns
    ``None`` instead of differing local ``.grad`` values."""
    model, dmodel = Net(), Net()
    ddp = DDP(dmodel, process_group=_group(), bucket_cap_mb=0.001, flat_buckets=flat)
    vg = ddp.value_and_grad(_mse)
    x, y = _data(WORLD, seed=2)
    with ddp.no_sync():
        ddp(x)
    acc = None
    rng = np.random.RandomState(1337)
    for it in range(2):
        g = _local_grads(model, _mse, (x, y))
        acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
        if it % 2 == 0:
            with ddp.no_sync():
                _, dg = vg((x, y))
            assert dg is None
        else:
            _, dg = vg((x, y))
            _close(nnx.to_pure_dict(acc), nnx.to_pure_dict(dg))
        perm = rng.permutation(WORLD)
        x, y = x[perm], y[perm]


# ---------------------------------------------------------------------- SyncBatchNorm
@pytest.mark.parametrize("affine", [True, False])
def test_DistributedDataParallel_SyncBatchNorm(affine):
    """``BatchNormNet`` converted to SyncBatchNorm, 2 rows per replica, against the plain
    model over the global batch (``_No_Affine``: ``affine=False``)."""
    x, y = _data(2 * WORLD, seed=3)
    g = _group()
    assert _ddp_niter(lambda: BatchNormNet(affine), x, y, local_bs=2, convert=True,
                      process_group=g) < 1e-5


def test_DistributedDataParallel_SyncBatchNorm_2D_Input():
    x, y = _data(2 * WORLD, din=2, dout=2, seed=4)
    assert _ddp_niter(BN1d, x, y, local_bs=2, convert=True, process_group=_group()) < 1e-5


def test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process():
    """One row per replica: only the synced statistics over both rows are defined."""
    x, y = _data(WORLD, din=2, dout=2, seed=5)
    assert _ddp_niter(BN1d, x, y, local_bs=1, convert=True, process_group=_group()) < 1e-5


def test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient():
    """Replicas with ``rank + 2`` rows (2 and 3): jdist pads to a common shape
    (``pad_batch_to``) and leaves the padding out of the loss and the statistics; the
    per-example loss scaled as torch's ``world_size * local_bs / global_bs`` is the mean
    over the global batch. ``p += grad`` is SGD with learning rate -1."""
    global_bs = 2 + 3
    x, y = _data(global_bs, seed=6)
    base = BatchNormNet()
    model = convert_sync_batchnorm(BatchNormNet(), _group())
    step = DDP(model, process_group=_group()).train_step(
        lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2, axis=1),
        nnx.Optimizer(model, optax.sgd(-1.0), wrt=nnx.Param), pad_batch_to=[6])
    for _ in range(5):
        _add_grads(base, _local_grads(base, _mse, (x, y)))
        step((x, y))
        _close(_params(base), _params(model))
        perm = np.random.RandomState(0).permutation(global_bs)
        x, y = x[perm], y[perm]


def test_DistributedDataParallel_SyncBatchNorm_half():
    model = convert_sync_batchnorm(BatchNormNet(dtype=jnp.float16), _group())
    ddp = DDP(model, process_group=_group())
    inp = np.random.RandomState(0).randn(2 * WORLD, 2).astype(np.float16)
    out = ddp(inp)
    assert out.dtype == jnp.float16
    _, grads = ddp.value_and_grad(lambda m, x: m(x).sum())(inp)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float16)}


def test_SyncBatchNorm_process_group():
    """``convert_sync_batchnorm(model, group)`` reaches BatchNorms nested in
    sub-sub-modules (torch: resnet50's ``layer1[0].bn1``) and gives them the group."""

    class Block(nnx.Module):
        def __init__(self):
            self.conv1 = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.bn1 = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

    class ResNetLike(nnx.Module):
        def __init__(self):
            self.bn1 = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
            self.layer1 = nnx.List([Block(), Block()])

    group = _group(1, axis="sub")
    model = convert_sync_batchnorm(ResNetLike(), group)
    for bn in (model.bn1, model.layer1[0].bn1, model.layer1[1].bn1):
        assert isinstance(bn, SyncBatchNorm) and bn.axis_name == group.axis_name == "sub"


# ------------------------------------------------------------------- buckets, inputs
class LargeNet(nnx.Module):
    def __init__(self):
        r = nnx.Rngs(0)
        self.fc1 = nnx.Linear(1000, 2000, use_bias=False, rngs=r)
        self.fc2 = nnx.Linear(2000, 500, use_bias=False, rngs=r)

    def __call__(self, x):
        return self.fc2(self.fc1(x))


def test_ddp_bucket_cap_mb_list():
    x = np.random.RandomState(0).randn(10, 1000).astype(np.float32)
    with_list = DDP(LargeNet(), process_group=_group(), bucket_cap_mb_list=[1, 2])
    vg = with_list.value_and_grad(lambda m, b: m(b).sum())
    for _ in range(2):
        vg(x)
    assert with_list.bucket_bytes_cap_list == [1 * 1024 * 1024, 2 * 1024 * 1024]
    # fc2 (4 MB, ready first) closes the 1 MiB bucket 0; fc1 fills bucket 1
    assert with_list.buckets.sizes() == [4_000_000, 8_000_000]
    without = DDP(LargeNet(), process_group=_group(), bucket_cap_mb=25)
    without.value_and_grad(lambda m, b: m(b).sum())(x)
    assert without.bucket_bytes_cap_list == []
    assert without.buckets.sizes() == [12_000_000]


NT0 = collections.namedtuple("NT0", ["a", "b"])


class NT1(typing.NamedTuple):
    """torch's second named-tuple flavour (``typing.NamedTuple``)."""

    a: typing.Any
    b: typing.Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TensorWrapper:
    """torch's custom input type; a JAX user registers it as a pytree."""

    t: jax.Array


def _validators():
    def pair(x):
        assert len(x) == 2
        return x[0] + x[1]

    return {tuple: pair, list: pair, NT0: lambda x: x.a + x.b, NT1: lambda x: x.a + x.b,
            dict: lambda x: x["a"] + x["b"], TensorWrapper: lambda x: x.t}


def test_ddp_device():
    """Inputs keep their container type (tuple, list, named tuples, dict, a registered
    custom type) when DDP splits them over replicas, for 4 training iterations each."""
    validators = _validators()
    seen = []

    class ToyModel(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            seen.append(type(x))
            return self.lin(validators[type(x)](x))

    ddp = DDP(ToyModel(), process_group=_group())
    vg = ddp.value_and_grad(lambda m, b: m(b).sum())
    rng = np.random.RandomState(0)
    a, b = (rng.rand(WORLD * 5, 10).astype(np.float32) for _ in range(2))
    for inp in [(a, b), [a, b], TensorWrapper(a), NT0(a, b), NT1(a, b), {"a": a, "b": b}]:
        for _ in range(4):
            _, grads = vg(inp)
            assert np.isfinite(np.asarray(grads["lin"]["kernel"][...])).all()
        assert ddp(inp).shape == (WORLD * 5, 10)
        assert type(inp) in seen
    # an unregistered container would be passed whole to every replica and compiled
    # per instance: DDP says how to register it
    with pytest.raises(TypeError, match="got a Opaque object.*register_dataclass"):
        ddp(type("Opaque", (), {})())


def test_ddp_namedtuple():
    rng = np.random.RandomState(1)
    a, b = (rng.rand(WORLD * 5, 10).astype(np.float32) for _ in range(2))

    class NamedTupleModule(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(10, 1, rngs=nnx.Rngs(0))

        def __call__(self, inp, expected_type):
            assert isinstance(inp, expected_type), type(inp)
            assert inp._fields == ("a", "b")
            return self.lin(inp.a * inp.b)

    model = NamedTupleModule()
    for kind in (NT0, NT1):
        ddp = DDP(model, process_group=_group())
        out = ddp.value_and_grad(lambda m, x, t=kind: m(x, t).sum())(kind(a, b))[0]
        local = float(jnp.sum(model.lin(a * b)))
        assert float(out) * WORLD == pytest.approx(local, rel=1e-5)  # mean of the halves


# ------------------------------------------------------------------ unused parameters
class ControlFlowToyModel(nnx.Module):
    def __init__(self):
        r = nnx.Rngs(0)
        self.lin1 = nnx.Linear(10, 10, use_bias=False, rngs=r)
        self.lin2 = nnx.Linear(10, 10, use_bias=False, rngs=r)

    def __call__(self, x, use_second_layer):
        if use_second_layer:
            return self.lin2(jax.nn.relu(self.lin1(x)))
        return jax.nn.relu(self.lin1(x))


def test_ddp_control_flow_same_across_ranks():
    """torch branches on the input's values; a traced JAX program branches on Python
    values, so the loss takes the branch as an argument (one program per branch). With
    ``find_unused_parameters=True`` lin2's gradient is zero on even iterations and the
    local one on odd ones; without it the first step raises naming ``lin2``."""
    rand = np.random.RandomState(0).randn(20, 10).astype(np.float32)
    ones = np.ones((20, 10), np.float32)
    model = ControlFlowToyModel()
    ddp = DDP(model, process_group=_group(), find_unused_parameters=True)
    losses = {flag: (lambda m, x, f=flag: m(x, f).sum()) for flag in (False, True)}
    for i in range(6):
        used = i % 2 == 1
        x = ones if used else rand
        _, grads = ddp.value_and_grad(losses[used])(x)
        want = _local_grads(model, losses[used], x)
        got = nnx.to_pure_dict(grads)
        _close(got, jax.tree.map(lambda g: g / WORLD, nnx.to_pure_dict(want)), 1e-4)
        assert bool(np.any(got["lin2"]["kernel"])) == used
    ddp = DDP(ControlFlowToyModel(), process_group=_group())
    with pytest.raises(RuntimeError, match=r"find_unused_parameters=True.*"
                       r"Expected to have finished reduction") as e:
        ddp.value_and_grad(losses[False])(rand)
    assert "lin2/kernel" in str(e.value) and "lin1" not in str(e.value)


def test_ddp_unused_params_rebuild_buckets_exception():
    """Departure: jdist raises at the first step (torch: the second), naming ``net2``."""

    class ToyModel(nnx.Module):
        def __init__(self):
            self.net1 = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(0))
            self.net2 = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.net1(x)

    ddp = DDP(ToyModel(), process_group=_group())
    with pytest.raises(UnusedParametersError, match=r"\['net2/kernel'\]") as e:
        ddp.value_and_grad(lambda m, x: m(x).sum())(np.ones((WORLD, 10), np.float32))
    assert isinstance(e.value, RuntimeError)
    assert "find_unused_parameters=True" in str(e.value)


def test_ddp_shared_grad_acc_unused_params():
    """``net1.bias`` and ``bias`` are one parameter, and unused with ``net1``: six
    iterations with ``find_unused_parameters=True`` and ``loss /= 10``."""

    class ToyModel(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.net1 = nnx.Linear(10, 5, use_bias=False, rngs=r)
            self.bias = nnx.Param(jnp.zeros(5))
            self.net1.bias = self.bias
            self.net2 = nnx.Linear(10, 5, rngs=r)

        def __call__(self, x):
            return self.net2(x).sum()

    model = ToyModel()
    ddp = DDP(model, process_group=_group(), find_unused_parameters=True)
    inp = np.random.RandomState(0).randn(20, 10).astype(np.float32)
    for _ in range(6):
        _, grads = ddp.value_and_grad(lambda m, x: m(x) / 10)(inp)
        want = nnx.to_pure_dict(_local_grads(model, lambda m, x: m(x) / 10, inp))
        got = nnx.to_pure_dict(grads)
        unused = {k: v for k, v in got.items() if k != "net2"}
        assert jax.tree.leaves(unused) and not any(np.any(g) for g in jax.tree.leaves(unused))
        _close(got["net2"], jax.tree.map(lambda g: g / WORLD, want["net2"]), 1e-4)


class UnusedParamTwoLinLayerNet(nnx.Module):
    def __init__(self):
        r = nnx.Rngs(0)
        self.a = nnx.Linear(10, 10, use_bias=False, rngs=r)
        self.b = nnx.Linear(10, 10, use_bias=False, rngs=r)
        self.c = nnx.Linear(5, 5, use_bias=False, rngs=r)

    def __call__(self, x):
        return self.a(x), self.b(x)


class DictOutputModule(nnx.Module):
    def __init__(self):
        self.module = UnusedParamTwoLinLayerNet()

    def __call__(self, x):
        predictions = self.module(x)
        return {"predictions": predictions, "loss": (predictions[0] + predictions[1]).sum()}


def _predictions(out):
    return out["predictions"] if isinstance(out, dict) else out


@pytest.mark.parametrize("module_cls", [UnusedParamTwoLinLayerNet, DictOutputModule],
                         ids=["tuple", "dict"])
def test_output_unused_in_loss(module_cls):
    """(``_tuple_module`` / ``_dict_module``) An output left out of the loss leaves its
    parameters without gradient, as in local training: zeros here (torch: ``None``)."""
    model = module_cls()
    ddp = DDP(model, process_group=_group(), find_unused_parameters=True)
    inp = np.random.RandomState(0).randn(WORLD * 10, 10).astype(np.float32)

    def both(m, x):
        a, b = _predictions(m(x))
        return (a @ b).sum()

    def b_only(m, x):
        return _predictions(m(x))[1].sum()

    for i in range(6):
        loss = both if i < 2 else b_only
        got = nnx.to_pure_dict(ddp.value_and_grad(loss)(inp)[1])
        # each replica's loss is over its half of the rows; DDP averages the two
        halves = [nnx.to_pure_dict(_local_grads(model, loss, h)) for h in np.split(inp, 2)]
        want = jax.tree.map(lambda *g: sum(g) / WORLD, *halves)
        _close(got, want, 1e-4)
        a_grad = jax.tree.leaves(got.get("module", got)["a"])[0]
        assert bool(np.any(a_grad)) == (i < 2)


def test_undefined_grad_parity_unused_parameters():
    """torch's ``UndefinedGrad`` on the output is ``stop_gradient`` here: every gradient
    is absent locally, and DDP's (with ``find_unused_parameters=True``) match: zeros."""
    x = np.ones((WORLD, 2), np.float32)
    model = Net()
    ddp = DDP(model, process_group=_group(), find_unused_parameters=True)

    def loss(m, x):
        return jax.lax.stop_gradient(m(x)).sum()

    got = nnx.to_pure_dict(ddp.value_and_grad(loss)(x)[1])
    want = nnx.to_pure_dict(_local_grads(model, loss, x))
    _close(got, want)
    assert not any(np.any(g) for g in jax.tree.leaves(got))


def test_ddp_multiple_nested_unused_params_error():
    """The error names every unused nested parameter and no used one."""

    class EmbeddingNet(nnx.Module):
        def __init__(self):
            self.embedding = nnx.Embed(10, 500, rngs=nnx.Rngs(0))
            self.lin = nnx.Linear(500, 1, rngs=nnx.Rngs(0))

    class TwoLin(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(10, 1, use_bias=False, rngs=nnx.Rngs(0))

    class SubModule(nnx.Module):
        def __init__(self):
            self.embedding_net = EmbeddingNet()
            self.lin = TwoLin()
            self.bn = BatchNormNet()
            self.lin_layer = nnx.Linear(4, 10, use_bias=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.lin.a(self.lin_layer(self.bn(x)))

    class MyModel(nnx.Module):
        def __init__(self):
            self.sub_module = SubModule()

        def __call__(self, x):
            return self.sub_module(x)

    unused = ["sub_module/embedding_net/embedding/embedding",
              "sub_module/embedding_net/lin/bias", "sub_module/embedding_net/lin/kernel",
              "sub_module/lin/b/kernel"]
    used = ["sub_module/lin/a/kernel", "sub_module/lin_layer/kernel",
            "sub_module/bn/fc1/kernel", "sub_module/bn/bn/scale", "sub_module/bn/fc2"]
    ddp = DDP(MyModel(), process_group=_group())
    with pytest.raises(UnusedParametersError) as e:
        ddp.value_and_grad(lambda m, x: m(x).sum())(np.ones((10, 2), np.float32))
    msg = str(e.value)
    assert f"DDP found {len(unused)} parameter(s)" in msg
    assert all(f"'{p}'" in msg for p in unused), msg
    assert not any(p in msg for p in used), msg


def test_ddp_returns_tensor_with_no_grad():
    """A module returning ``(stop_gradient(x), y)``: six iterations for every
    ``find_unused_parameters`` setting, gradients as local training."""

    class MyModel(nnx.Module):
        def __init__(self):
            self.fc1 = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(0))
            self.fc2 = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(1))

        def __call__(self, x):
            x = self.fc2(jax.nn.relu(self.fc1(x)))
            return jax.lax.stop_gradient(x), x

    def loss(m, x):
        out = m(x)
        return (out[0] + out[1]).sum()

    model = MyModel()
    inp = np.random.RandomState(0).randn(WORLD, 10).astype(np.float32)
    want = jax.tree.map(lambda g: g / WORLD, nnx.to_pure_dict(_local_grads(model, loss, inp)))
    for find_unused in (True, False):
        ddp = DDP(model, process_group=_group(), find_unused_parameters=find_unused)
        for _ in range(6):
            out = ddp(inp)
            assert isinstance(out, tuple) and len(out) == 2
            _close(nnx.to_pure_dict(ddp.value_and_grad(loss)(inp)[1]), want, 1e-4)


def _nested_loss(out):
    if isinstance(out, dict):
        return sum(_nested_loss(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return sum(_nested_loss(v) for v in out)
    return out.sum()


def test_ddp_static_graph_nested_types():
    """Outputs that are nested tuples, lists and dicts keep their types through DDP and
    train as the local model (torch also compares ``static_graph=True``, which jdist
    does not need: every step is one traced program)."""

    class NestedOutputModule(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(100, 1, use_bias=False, rngs=nnx.Rngs(0))

        def __call__(self, inp, output_type):
            y = self.lin(inp)
            if output_type == "tuple":
                return (y, (y, y))
            if output_type == "list":
                return [y, [y, y]]
            return {"a": y, "b": {"c": y}}

    inp = np.random.RandomState(0).randn(10, 100).astype(np.float32)
    local, model = NestedOutputModule(), NestedOutputModule()
    ddp = DDP(model, process_group=_group())
    for output_type, kind in (("list", list), ("tuple", tuple), ("dict", dict)):
        def loss(m, x, t=output_type):
            return _nested_loss(m(x, t))

        for _ in range(6):
            assert isinstance(ddp(inp, output_type), kind)
            _add_grads(model, ddp.value_and_grad(loss)(inp)[1])
            halves = [_local_grads(local, loss, h) for h in np.split(inp, WORLD)]
            _add_grads(local, jax.tree.map(lambda a, b: (a + b) / WORLD, *halves))
            _close(_params(model), _params(local), 1e-4)


def test_ddp_new_tensor_in_fwd():
    """Arrays created inside the forward (here ones; torch: randn) come back in their
    structure, need no gradient, and the loss over the first output trains
    (``_static_graph``: the same, jdist has no ``static_graph`` switch)."""

    class MyModel(nnx.Module):
        def __init__(self):
            self.fc1 = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(0))
            self.fc2 = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(1))

        def __call__(self, x, opt_1=None, opt_2=None, opt_nested=None):
            x = self.fc2(jax.nn.relu(self.fc1(x)))
            new = jnp.ones((x.shape[0], 10))
            return (x, new if opt_1 is None else opt_1, new if opt_2 is None else opt_2,
                    {"tensor": new if opt_nested is None else opt_nested})

    model = MyModel()
    for find_unused in (True, False):
        ddp = DDP(model, process_group=_group(), broadcast_buffers=False,
                  find_unused_parameters=find_unused)
        opt = [None, None, None]
        for _ in range(2):
            x = np.random.RandomState(0).randn(WORLD, 10).astype(np.float32)
            _, opt[0], opt[1], nested = ddp(x, *opt)
            opt[2] = nested["tensor"]
            assert all(o.shape == (WORLD, 10) for o in opt)
            _, grads = ddp.value_and_grad(lambda m, b, o: m(b, *o)[0].mean())(x, tuple(opt))
            assert all(np.any(g) for g in jax.tree.leaves(grads))


def test_static_graph_multi_forward():
    """The module called twice in one loss: gradients equal a local model's."""

    class Net2(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(10, 10, rngs=nnx.Rngs(42))

        def __call__(self, x):
            return jax.nn.relu(self.lin(x))

    def loss(m, x):
        return m(x).sum() + m(x).sum()

    model = Net2()
    ddp = DDP(model, process_group=_group())
    inp = np.ones((2 * WORLD, 10), np.float32)
    want = jax.tree.map(lambda g: g / WORLD,
                        nnx.to_pure_dict(_local_grads(model, loss, inp)))
    for _ in range(3):
        _close(nnx.to_pure_dict(ddp.value_and_grad(loss)(inp)[1]), want, 1e-4)


def test_ddp_inference():
    """Eval-mode forwards through DDP equal the local model's, six times (a plain net,
    and SyncBatchNorm in eval mode, which then uses running statistics and no
    collective)."""

    class SBN(nnx.Module):
        def __init__(self):
            self.bn = nnx.BatchNorm(2, momentum=0.01, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.bn(x)

    rng = np.random.RandomState(0)
    cases = [(Net(), rng.randn(10, 2).astype(np.float32)),
             (convert_sync_batchnorm(SBN(), _group()), rng.randn(10, 4, 4, 2).astype(np.float32))]
    for model, inp in cases:
        ddp = DDP(model, process_group=_group())
        model.eval()
        for _ in range(6):
            np.testing.assert_allclose(np.asarray(ddp(inp)), np.asarray(model(inp)),
                                       rtol=1e-5, atol=1e-6)


def test_ddp_python_error_logged():
    """An error raised after construction: a hook that is not callable."""

    class TwoLin(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(0))

    ddp = DDP(TwoLin(), process_group=_group())
    with pytest.raises(TypeError, match="must be callable"):
        ddp.register_comm_hook({}, {})


def test_ddp_broadcast_buffers_deprecation_warning():
    """Departure: ``broadcast_buffers`` is jdist's contract name, so it does not warn;
    ``forward_sync_buffers`` (torch 2.13) is accepted and wins when both are given."""
    import warnings

    for bb, fsb in ((False, True), (True, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ddp = DDP(Net(), process_group=_group(), broadcast_buffers=bb,
                      forward_sync_buffers=fsb)
        assert ddp.forward_sync_buffers is fsb and ddp.broadcast_buffers is fsb
    for kwargs, want in (({}, True), ({"broadcast_buffers": False}, False)):
        assert DDP(Net(), process_group=_group(), **kwargs).forward_sync_buffers is want
