"""torch's ``rpc/dist_optimizer_test.py`` and ``nn/api/remote_module_test.py`` on jdist.

One launch of 3 real processes (``worker0..2``) runs every case (:class:`OptimCases`,
:class:`ModuleCases`; each named after the torch test it translates) in one RPC
session, on every rank as torch's ``dist_init`` does (the RemoteModule cases act on
rank 0 only, as torch's). torch's optimizers become optax factories (``TORCH_TO_OPTAX``,
checked against torch itself); its ``nn.Module`` s NNX modules; ``torch.ones(1)``
``np.ones(1)``. The result is ``{case: "ok" | traceback}`` per rank.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist import rpc
from jdist.rpc import DistributedOptimizer, RemoteModule, dist_autograd
from jdist.rpc._remote_module import PICKLED_ATTRIBUTES
from jdist.store import PrefixStore, TCPStore
from tests.helpers import run_procs

WS = 3


class Raises:
    """``assertRaisesRegex``: the body must raise ``exc_type`` matching ``regex``."""

    def __init__(self, exc_type, regex: str = ""):
        self.exc_type, self.regex = exc_type, regex

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            raise AssertionError(f"{self.exc_type.__name__} not raised (wanted {self.regex!r})")
        if not issubclass(et, self.exc_type):
            return False
        if not re.search(self.regex, str(ev)):
            raise AssertionError(f"{self.regex!r} not found in {str(ev)!r}")
        return True


def worker_name(r: int) -> str:
    return f"worker{r}"


# ------------------------------------------------------------ dist_optimizer_test
def _rand33(gen=None):
    import torch  # the oracle's inputs: torch.rand with torch's seeded generator

    if gen is None:
        gen = torch.Generator()
        gen.manual_seed(0)
    return torch.rand((3, 3), generator=gen).numpy()


def _t1_t2():
    import torch

    g = torch.Generator()
    g.manual_seed(0)
    return _rand33(g), _rand33(g)


class MyModule(nnx.Module):
    """torch's MyModule: ``w`` a Param, or (requires_grad=False) plain module state."""

    def __init__(self, requires_grad=True):
        kind = nnx.Param if requires_grad else nnx.Variable
        self.w = kind(jnp.asarray(_rand33()))

    def forward(self, t1):
        return jnp.matmul(self.w[...], t1)

    def get_w(self):
        return self.w


def failing_optimizer():
    """torch's FailingOptimizer: ``step`` raises."""
    def update(updates, state, params=None):
        raise ValueError("Error running optimizer.")

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optimizer_failing_on_constructor():
    raise ValueError("Error creating optimizer.")


def _call_method(method, obj_rref, *args, **kwargs):
    return method(obj_rref.local_value(), *args, **kwargs)


def remote_method(method, obj_rref, *args, **kwargs):
    return rpc.remote(obj_rref.owner(), _call_method, args=[method, obj_rref] + list(args),
                      kwargs=kwargs)


def rpc_async_method(method, obj_rref, *args, **kwargs):
    return rpc.rpc_async(obj_rref.owner(), _call_method,
                         args=[method, obj_rref] + list(args), kwargs=kwargs)


def adamw_amsgrad(learning_rate, weight_decay=1e-2):
    """torch ``AdamW(lr, amsgrad=True)`` (decoupled weight decay 1e-2)."""
    return optax.chain(optax.scale_by_amsgrad(), optax.add_decayed_weights(weight_decay),
                       optax.scale(-learning_rate))


def sgd_weight_decay(learning_rate, momentum, weight_decay, nesterov):
    """torch ``SGD(lr, momentum, weight_decay, nesterov)``: decay added to the gradient."""
    return optax.chain(optax.add_decayed_weights(weight_decay),
                       optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov))


def torch_rprop(learning_rate, etas=(0.5, 1.2), step_sizes=(1e-6, 50.0)):
    """torch's ``Rprop`` (optax.rprop's first step differs from torch's)."""
    lo, hi = step_sizes

    def init(params):
        return (jax.tree.map(jnp.zeros_like, params),
                jax.tree.map(lambda p: jnp.full_like(p, learning_rate), params))

    def one(g, prev, step):
        s = jnp.sign(g * prev)
        step = jnp.clip(jnp.where(s > 0, step * etas[1], jnp.where(s < 0, step * etas[0],
                                                                    step)), lo, hi)
        g = jnp.where(s < 0, 0.0, g)
        return -jnp.sign(g) * step, g, step

    def update(grads, state, params=None):
        out = jax.tree.map(one, grads, *state)
        pick = [jax.tree.map(lambda t, i=i: t[i], out, is_leaf=lambda t: isinstance(t, tuple))
                for i in range(3)]
        return pick[0], (pick[1], pick[2])

    return optax.GradientTransformation(init, update)


# torch optimizer (dist_optimizer_test's arguments) -> optax factory and arguments
TORCH_TO_OPTAX = {
    "Adagrad": ({"lr": 0.05}, optax.adagrad,
                dict(learning_rate=0.05, initial_accumulator_value=0.0, eps=1e-10)),
    "Adam": ({"lr": 1e-2, "amsgrad": True}, optax.amsgrad, dict(learning_rate=1e-2)),
    "AdamW": ({"lr": 0.05, "amsgrad": True}, adamw_amsgrad, dict(learning_rate=0.05)),
    "SGD": ({"lr": 0.05}, optax.sgd, dict(learning_rate=0.05)),
    "SGD-nesterov": ({"lr": 1e-3, "momentum": 1, "weight_decay": 1, "nesterov": True},
                     sgd_weight_decay,
                     dict(learning_rate=1e-3, momentum=1.0, weight_decay=1.0, nesterov=True)),
    "Adadelta": ({"rho": 0.95}, optax.adadelta, dict(learning_rate=1.0, rho=0.95, eps=1e-6)),
    "RMSprop": ({"lr": 0.05}, optax.rmsprop,
                dict(learning_rate=0.05, decay=0.99, eps=1e-8, eps_in_sqrt=False)),
    "Adamax": ({"lr": 0.05}, optax.adamax, dict(learning_rate=0.05)),
    "Rprop": ({"lr": 0.05}, torch_rprop, dict(learning_rate=0.05)),
}


def _torch_step(name, requires_grad2=True):
    """torch's local version of the test: the weights after one step."""
    import torch

    kw = TORCH_TO_OPTAX[name][0]
    cls = getattr(torch.optim, name.split("-")[0])
    w1 = torch.tensor(_rand33(), requires_grad=True)
    w2 = torch.tensor(_rand33(), requires_grad=requires_grad2)
    opt = cls([w1, w2], **kw)
    t1, t2 = (torch.tensor(t) for t in _t1_t2())
    torch.add(torch.mm(w2, torch.mm(w1, t2)), t1).sum().backward()
    opt.step()
    return w1.detach().numpy(), w2.detach().numpy()


def _local_step(name, requires_grad2=True):
    """The same step with optax in this process (the local reference)."""
    _, factory, kw = TORCH_TO_OPTAX[name]
    tx = factory(**kw)
    t1, t2 = _t1_t2()
    params = [jnp.asarray(_rand33()), jnp.asarray(_rand33())]

    def loss(ps):
        w2 = ps[1] if requires_grad2 else jax.lax.stop_gradient(ps[1])
        return jnp.sum(w2 @ (ps[0] @ t2) + t1)

    grads = jax.grad(loss)(params)
    if not requires_grad2:
        grads[1] = jnp.zeros_like(grads[1])  # no gradient: torch skips it, unchanged
    updates, _ = tx.update(grads, tx.init(params), params)
    return [np.asarray(p) for p in optax.apply_updates(params, updates)]


def _owners(env):
    return worker_name((env.rank + 1) % WS), worker_name((env.rank + 2) % WS)


def _close(a, b, what):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                               err_msg=what)


class OptimCases:
    """DistOptimizerTest."""

    @staticmethod
    def test_dist_optim_exception(env):
        owner1, owner2 = _owners(env)
        rm1, rm2 = rpc.remote(owner1, MyModule), rpc.remote(owner2, MyModule)
        p1, p2 = remote_method(MyModule.get_w, rm1), remote_method(MyModule.get_w, rm2)
        dist_optim = DistributedOptimizer(failing_optimizer, [p1, p2])
        t1, t2 = _t1_t2()
        with dist_autograd.context() as context_id:
            def loss_fn():
                out1 = rpc_async_method(MyModule.forward, rm1, t2)
                out2 = rpc_async_method(MyModule.forward, rm2, out1.wait())
                return jnp.sum(jnp.add(out2.wait(), t1))

            dist_autograd.backward(context_id, loss_fn)
            with Raises(Exception, "Error running optimizer"):
                dist_optim.step(context_id)

    @staticmethod
    def test_dist_optim_exception_on_constructor(env):
        owner1, owner2 = _owners(env)
        rm1, rm2 = rpc.remote(owner1, MyModule), rpc.remote(owner2, MyModule)
        p1, p2 = remote_method(MyModule.get_w, rm1), remote_method(MyModule.get_w, rm2)
        with Raises(Exception, "Error creating optimizer."):
            DistributedOptimizer(optimizer_failing_on_constructor, [p1, p2])

    @staticmethod
    def _dist_optim_base(env, name):
        want = _local_step(name)
        for w, t, i in zip(want, _torch_step(name), (1, 2), strict=True):
            _close(w, t, f"{name}: optax mapping vs torch, w{i}")
        old = _rand33()
        owner1, owner2 = _owners(env)
        rm1, rm2 = rpc.remote(owner1, MyModule), rpc.remote(owner2, MyModule)
        p1, p2 = remote_method(MyModule.get_w, rm1), remote_method(MyModule.get_w, rm2)
        _close(p1.to_here()[...], old, "initial w1")
        _close(p2.to_here()[...], old, "initial w2")
        _, factory, kw = TORCH_TO_OPTAX[name]
        dist_optim = DistributedOptimizer(factory, [p1, p2], **kw)
        t1, t2 = _t1_t2()
        with dist_autograd.context() as context_id:
            def loss_fn():
                out1 = rpc_async_method(MyModule.forward, rm1, t2)
                out2 = rpc_async_method(MyModule.forward, rm2, out1.wait())
                return jnp.sum(jnp.add(out2.wait(), t1))

            dist_autograd.backward(context_id, loss_fn)
            dist_optim.step(context_id)
            new1 = rpc_async_method(MyModule.get_w, rm1).wait()[...]
            new2 = rpc_async_method(MyModule.get_w, rm2).wait()[...]
            assert not np.array_equal(old, new1) and not np.array_equal(old, new2), name
            _close(new1, want[0], f"{name}: w1 remote vs local")
            _close(new2, want[1], f"{name}: w2 remote vs local")

    @staticmethod
    def test_dist_optim(env):
        if env.rank != 0:  # torch runs it on every rank at once; the other cases do that
            return  # here, this one (9 optimizers, compiled on every owner) on one
        for name in ("Adagrad", "Adam", "AdamW", "SGD", "SGD-nesterov", "Adadelta",
                     "RMSprop", "Adamax", "Rprop"):
            OptimCases._dist_optim_base(env, name)

    @staticmethod
    def _dist_optim_none_grads(env, name):
        want = _local_step(name, requires_grad2=False)
        for w, t, i in zip(want, _torch_step(name, False), (1, 2), strict=True):
            _close(w, t, f"{name}: optax mapping vs torch, w{i}")
        old = _rand33()
        owner1, owner2 = _owners(env)
        rm1 = rpc.remote(owner1, MyModule)
        rm2 = rpc.remote(owner2, MyModule, args=(False,))
        p1, p2 = rm1.remote().get_w(), rm2.remote().get_w()
        _close(p1.to_here()[...], old, "initial w1")
        _close(p2.to_here()[...], old, "initial w2")
        _, factory, kw = TORCH_TO_OPTAX[name]
        dist_optim = DistributedOptimizer(factory, [p1, p2], **kw)
        t1, t2 = _t1_t2()
        with dist_autograd.context() as context_id:
            def loss_fn():
                out1 = rm1.rpc_async().forward(t2)
                out2 = rm2.rpc_async().forward(out1.wait())
                return jnp.sum(jnp.add(out2.wait(), t1))

            dist_autograd.backward(context_id, loss_fn)
            dist_optim.step(context_id)
            new1 = rm1.rpc_async().get_w().wait()[...]
            new2 = rm2.rpc_async().get_w().wait()[...]
            assert not np.array_equal(old, new1), name
            np.testing.assert_array_equal(new2, old, err_msg=name)
            _close(new1, want[0], f"{name}: w1 remote vs local")
            _close(new2, want[1], f"{name}: w2 remote vs local")

    @staticmethod
    def test_dist_optim_none_grads(env):
        for name in ("SGD", "RMSprop", "Rprop", "Adadelta"):
            OptimCases._dist_optim_none_grads(env, name)


# ------------------------------------------------------------ remote_module_test
PARAM_VAL = np.ones(1, np.float32)


class RMModule(nnx.Module):
    """torch's MyModule of remote_module_test (a Dropout gives NNX's train/eval mode)."""

    def __init__(self, first_arg, first_kwarg=-1):
        self.param1 = nnx.Param(jnp.asarray(PARAM_VAL))
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, tensor, number, word="default"):
        return word, number, tensor


class BadModule:
    def __init__(self, first_arg, first_kwarg=-1):
        pass


def remote_device(module_rref):
    """(platform, local index) of the module's parameters on their worker."""
    for leaf in jax.tree.leaves(nnx.state(module_rref.local_value(), nnx.Param)):
        (dev,) = leaf.devices()
        return dev.platform, jax.local_devices(backend=dev.platform).index(dev)


def remote_module_attributes(remote_module):
    return remote_module.__dict__


def remote_forward(remote_module, args):
    return remote_module.forward(*args)


def remote_forward_async(remote_module, args):
    return remote_module.forward_async(*args).wait()


def get_remote_training_arg(module_rref):
    return not module_rref.local_value().dropout.deterministic


def _create_remote_module(remote_device):
    return RemoteModule(remote_device, RMModule, (1,), dict(first_kwarg=2))


def _same(ret, want):
    assert len(ret) == len(want), (ret, want)
    for a, b in zip(ret, want, strict=True):
        if isinstance(b, np.ndarray):
            np.testing.assert_array_equal(np.asarray(a), b)
        else:
            assert a == b, (ret, want)


def _on_rank0(fn):
    def run(env):
        if env.rank == 0:
            fn(env)

    run.__name__ = fn.__name__
    return staticmethod(run)


class ModuleCases:
    """RemoteModuleTest, ThreeWorkersRemoteModuleTest, CudaRemoteModuleTest (on CPU)."""

    @_on_rank0
    def test_bad_module(env):
        dst = f"{worker_name(1)}/cpu"
        for _ in range(2):
            with Raises(ValueError, r"Expect `module_cls\(\*args, \*\*kwargs\)` returns an "
                                    r"instance of <class nn.Module>,"):
                RemoteModule(dst, BadModule, (1,), dict(first_kwarg=2)).forward()

    @_on_rank0
    def test_forward_async(env):
        args = (np.ones(1, np.float32), 2, "3")
        ret = _create_remote_module(worker_name(1)).forward_async(*args).wait()
        _same(ret, tuple(reversed(args)))

    @_on_rank0
    def test_forward_sync(env):
        args = (np.ones(1, np.float32), 2, "3")
        _same(_create_remote_module(worker_name(1)).forward(*args), tuple(reversed(args)))

    @_on_rank0
    def test_forward_with_kwargs(env):
        args, kwargs = (np.ones(1, np.float32), 2), dict(word="3")
        rm = _create_remote_module(worker_name(1))
        _same(rm.forward_async(*args, **kwargs).wait(), tuple(reversed(args + ("3",))))
        _same(rm.forward(*args, **kwargs), tuple(reversed(args + ("3",))))

    @_on_rank0
    def test_remote_parameters(env):
        param_rrefs = _create_remote_module(worker_name(1)).remote_parameters()
        assert len(param_rrefs) == 1
        np.testing.assert_array_equal(param_rrefs[0].to_here()[...], PARAM_VAL)

    @_on_rank0
    def test_get_module_rref(env):
        rm = _create_remote_module(worker_name(1))
        rref = rm.get_module_rref()
        assert rref == rm.module_rref
        for param in jax.tree.leaves(nnx.state(rref.to_here(), nnx.Param)):
            np.testing.assert_array_equal(param, PARAM_VAL)

    @_on_rank0
    def test_train_eval(env):
        dst = worker_name(1)
        rm = _create_remote_module(dst)
        assert rm.train() is rm
        assert rpc.rpc_sync(dst, get_remote_training_arg, args=(rm.get_module_rref(),))
        rm.eval()
        assert not rpc.rpc_sync(dst, get_remote_training_arg, args=(rm.get_module_rref(),))

    @_on_rank0
    def test_unsupported_methods(env):
        rm = _create_remote_module(worker_name(1))

        def hook(module, grad_input, grad_output):
            pass

        calls = [("register_buffer", ("buffer", np.ones(5))),
                 ("register_parameter", ("param", nnx.Param(jnp.ones(1)))),
                 ("add_module", ("empty", None)), ("apply", (np.ones((3, 3)),)),
                 ("cuda", ()), ("cpu", ()), ("type", (jnp.float32,)), ("float", ()),
                 ("double", ()), ("bfloat16", ()), ("register_backward_hook", (hook,)),
                 ("register_forward_pre_hook", (hook,)), ("register_forward_hook", (hook,)),
                 ("state_dict", ()), ("load_state_dict", ({},)), ("named_parameters", ()),
                 ("buffers", ()), ("named_buffers", ()), ("children", ()),
                 ("named_children", ()), ("modules", ()), ("named_modules", ()),
                 ("requires_grad_", ()), ("zero_grad", ()), ("share_memory", ()),
                 ("extra_repr", ())]
        for name, args in calls:
            with Raises(ValueError, f"Method ``{name}`` not supported for RemoteModule"):
                getattr(rm, name)(*args)
        with Raises(ValueError, "Method ``to`` not supported for RemoteModule"):
            rm.to("cpu", dtype=jnp.int32)
        with Raises(ValueError, r"Method ``parameters`` not supported for RemoteModule. "
                                r"Please use ``remote_parameters`` instead."):
            rm.parameters()

    @_on_rank0
    def test_send_remote_module_with_a_new_attribute_not_pickled_over_the_wire(env):
        dst = worker_name(1)
        rm = _create_remote_module(dst)
        rm.new_attr = 1
        attrs = rpc.rpc_sync(dst, remote_module_attributes, (rm,))
        assert "new_attr" not in attrs

    @_on_rank0
    def test_remote_module_py_pickle_not_supported(env):
        rm = _create_remote_module(worker_name(1))
        with tempfile.TemporaryDirectory() as d, open(os.path.join(d, "f"), "wb") as f:
            with Raises(RuntimeError, "Cannot pickle RemoteModule in python pickler. "
                                      "RemoteModule can only be pickled when using RPC"):
                pickle.dump(rm, f)

    @_on_rank0
    def test_send_remote_module_over_the_wire(env):
        w1, w2 = worker_name(1), worker_name(2)
        rm = _create_remote_module(w1)
        attrs = rpc.rpc_sync(w2, remote_module_attributes, (rm,))
        # jdist: forward / forward_async are the class's methods, not instance attributes
        assert list(attrs.keys()) == list(PICKLED_ATTRIBUTES), list(attrs)
        assert attrs["on"] == "worker1" and attrs["device"] == "cpu"
        assert not attrs["is_device_map_set"] and not attrs["is_scriptable"]
        args = (np.ones(1, np.float32), 2, "3")
        _same(rpc.rpc_sync(w2, remote_forward, (rm, args)), tuple(reversed(args)))
        _same(rpc.rpc_sync(w2, remote_forward_async, (rm, args)), tuple(reversed(args)))

    @_on_rank0
    def test_create_remote_module_from_module_rref(env):
        w1, w2 = worker_name(1), worker_name(2)
        rm = _create_remote_module(w1)
        rm2 = rpc.rpc_sync(w2, RemoteModule.init_from_module_rref, (w2, rm.get_module_rref()))
        args = (np.ones(1, np.float32), 2, "3")
        ret1 = rpc.rpc_sync(w1, remote_forward, (rm, args))
        ret2 = rpc.rpc_sync(w2, remote_forward, (rm2, args))
        _same(ret1, ret2)

    @_on_rank0
    def test_valid_device(env):
        # torch: cuda:0; here the owner's first CPU device, by name and by rank
        for dev in (f"{worker_name(1)}/cpu:0", "rank:1/cpu:0"):
            rm = _create_remote_module(dev)
            assert rpc.rpc_sync(worker_name(1), remote_device, (rm.module_rref,)) == ("cpu", 0)

    @_on_rank0
    def test_invalid_devices(env):
        dst = worker_name(1)
        with Raises(RuntimeError, r"Expected one of .+ device type at start of device string"):
            _create_remote_module(f"{dst}/foo").forward()
        with Raises(RuntimeError, r"invalid device ordinal"):  # no 101st GPU (nor any)
            _create_remote_module(f"{dst}/cuda:100").forward()
        with Raises(RuntimeError, r"Invalid device string: 'cpu2'"):
            _create_remote_module(f"{dst}/cpu2").forward()
        with Raises(RuntimeError, r"Device string must not be empty"):
            _create_remote_module(f"{dst}/").forward()
        for bad in (f"{dst}/cuda:0/cuda:1", "/", "/cuda:0"):
            with Raises(ValueError, rf"Could not parse remote_device: {bad}. The valid format "
                                    r"is '<workername>/<device>'"):
                _create_remote_module(bad).forward()

    @_on_rank0
    def test_input_moved_to_cuda_device(env):
        # torch: inputs move to the module's cuda:0, results come back on the CPU; here
        # the module's device is the owner's cpu:0 and results come back as host arrays
        t1 = np.ones(1, np.float32)
        args, t2 = (t1, 2), t1 * 2
        rm = _create_remote_module(f"{worker_name(1)}/cpu:0")
        for ret in (rm.forward_async(*args, word=t2).wait(), rm.forward(*args, word=t2)):
            _same(ret, tuple(reversed(args + (t2,))))
            assert isinstance(ret[0], (np.ndarray, jax.Array))


# ------------------------------------------------------------ the launch
CASES = [getattr(c, n) for c in (OptimCases, ModuleCases) for n in vars(c)
         if n.startswith("test_")]


def run() -> dict:
    rank = int(os.environ["RANK"])
    base = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WS, rank == 0)
    env = type("Env", (), {"rank": rank})()
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=WS,
                 rpc_backend_options=rpc.RpcBackendOptions(
                     init_method=PrefixStore("m", base), rpc_timeout=60))
    results: dict = {}
    times = results["_seconds"] = {}  # case -> (wall, this process's CPU)
    try:
        for fn in CASES:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                fn(env)
                results[fn.__name__] = "ok"
            except BaseException:  # noqa: BLE001 - reported per case
                results[fn.__name__] = traceback.format_exc()
            times[fn.__name__] = (time.perf_counter() - t0, time.process_time() - c0)
    finally:
        rpc.shutdown()
    return results


@pytest.fixture(scope="module")
def results():
    return run_procs(run, WS, timeout=300)


@pytest.mark.parametrize("name", [f.__name__ for f in CASES])
def test_case(results, name):
    for rank, res in enumerate(results):
        assert res.get(name) == "ok", f"rank {rank}: {res.get(name)}"


def test_remote_device_strings_follow_torch():
    """torch's ``_remote_device`` / ``torch.device`` rules, in this process (no RPC)."""
    from jdist.rpc._remote_device import local_device, parse_remote_device

    assert parse_remote_device("worker1") == ("worker1", "cpu")
    assert parse_remote_device("worker1/cuda:0") == ("worker1", "cuda:0")
    assert parse_remote_device("rank:3/cpu") == (3, "cpu")
    assert parse_remote_device(2) == (2, "cpu")
    for bad in ("rank:x/cpu", "a:b:c/cpu", "cpu"):  # "cpu": a device but no worker
        with pytest.raises(ValueError, match="Could not parse remote_device"):
            parse_remote_device(bad)
    for bad, text in (("w/cuda:01", "Invalid device string: 'cuda:01'"),
                      ("w/mps", "Expected one of cpu, cuda, gpu, tpu device type")):
        with pytest.raises(RuntimeError, match=re.escape(text)):
            parse_remote_device(bad)
    assert local_device("cpu") == jax.local_devices(backend="cpu")[0]
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        local_device("cpu:1000")


def test_a_parameter_without_gradient_keeps_its_value_as_torch_skips_it():
    """torch's optimizers skip a parameter without a gradient (no weight decay, no
    momentum step); the RPC DistributedOptimizer does too (three in-process agents)."""
    import torch

    from tests.rpc.conftest import make_agents, stop_all

    w = torch.tensor(_rand33(), requires_grad=True)
    frozen = torch.tensor(_rand33(), requires_grad=True)  # never used: no .grad
    opt = torch.optim.SGD([w, frozen], lr=1e-3, momentum=1, weight_decay=1, nesterov=True)
    (w * 2.0).sum().backward()
    opt.step()
    agents = make_agents(2)
    try:
        a0 = agents[0]
        used = a0.remote("w1", nnx.Param, (jnp.asarray(_rand33()),))
        unused = a0.remote("w1", nnx.Param, (jnp.asarray(_rand33()),))  # same owner
        _, factory, kw = TORCH_TO_OPTAX["SGD-nesterov"]
        dist_optim = DistributedOptimizer(factory, [used, unused], **kw)
        with dist_autograd.context(a0) as cid:
            dist_autograd.backward(cid, lambda: 2.0 * jnp.sum(
                a0.rpc_async("w1", _value, (used,)).wait()), agent=a0)
            dist_optim.step(cid)
        _close(used.to_here()[...], w.detach().numpy(), "the used parameter")
        np.testing.assert_array_equal(unused.to_here()[...], frozen.detach().numpy())
    finally:
        stop_all(agents, graceful=False)


def _value(rref):
    return rref.local_value()[...]
