"""torch's distributed_test.py join/uneven-input DDP cases, for one shared 2-process
launch (tests/ddp/test_join_uneven.py).

torch's ``loss.backward(); _model_step(net)`` (``param += grad``) is
``ddp.train_step(loss, nnx.Optimizer(model, optax.sgd(-1.0)))``; tests that read
``param.grad`` use ``ddp.value_and_grad``. Each function returns plain values; the test
module asserts what torch asserts.
"""

from __future__ import annotations

import hashlib
import warnings
from contextlib import nullcontext

import numpy as np


def _nnx():
    import jax.numpy as jnp
    from flax import nnx

    return jnp, nnx


def _digest(module) -> str:
    """A hash of every parameter and buffer value (torch's validate_net_equivalence
    compares state dicts across ranks: equal digests on every rank)."""
    import jax
    from flax import nnx

    h = hashlib.sha1()
    for x in jax.tree.leaves(nnx.state(module)):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def _error(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the test side checks class and text
        return None, (type(e).__name__, str(e))


def _linear(din, dout, bias=False, seed=0):
    _, nnx = _nnx()
    return nnx.Linear(din, dout, use_bias=bias, rngs=nnx.Rngs(seed))


def _sum_loss(m, x):
    return m(x).sum()


# ---------------------------------------------------------------- models (torch's)
def batch_norm_net():
    """torch's BatchNormNet: Linear(2, 40) -> BatchNorm1d(4) over (-1, 4, 10) ->
    Linear(40, 4) -> softmax."""
    jnp, nnx = _nnx()
    import jax

    class BatchNormNet(nnx.Module):
        def __init__(self):
            self.fc1 = _linear(2, 40)
            self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
            self.fc2 = _linear(40, 4)

        def __call__(self, x):
            x = self.fc1(x).reshape(-1, 4, 10).transpose(0, 2, 1)  # channels last
            x = self.bn(x).transpose(0, 2, 1).reshape(-1, 40)
            return jax.nn.softmax(self.fc2(x), axis=1)

    del jnp
    return BatchNormNet()


def conv_model():
    """torch's large_conv_model (Conv 1->20->32->256, kernel 5, ReLU), on a 13x13 image
    instead of 1000x1000 (CPU budget)."""
    _, nnx = _nnx()
    import jax

    class Convs(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.c = nnx.List([nnx.Conv(1, 20, (5, 5), padding="VALID", rngs=r),
                               nnx.Conv(20, 32, (5, 5), padding="VALID", rngs=r),
                               nnx.Conv(32, 256, (5, 5), padding="VALID", rngs=r)])

        def __call__(self, x):
            for conv in self.c:
                x = jax.nn.relu(conv(x))
            return x

    return Convs()


def unused_param_module(unused_params_rank):
    """torch's UnusedParamModule: ``t1(t0(x))`` except on ``unused_params_rank``, where
    ``t1(x)``. One SPMD program runs on every rank, so the rank comes with the batch and
    selects the branch (t0 then gets zero gradients there, as torch's
    find_unused_parameters reduces zeros for it)."""
    jnp, nnx = _nnx()

    class Task(nnx.Module):
        def __init__(self):
            self.p = nnx.Param(jnp.ones((2, 2)))

        def __call__(self, x):
            return self.p[...] + x

    class UnusedParamModule(nnx.Module):
        def __init__(self):
            self.t0, self.t1 = Task(), Task()

        def __call__(self, x, rank):
            use = (rank[0] != unused_params_rank)
            return self.t1(jnp.where(use, self.t0(x), x))

    return UnusedParamModule()


DIM = 100  # torch's small_model is Linear(1000, 1000): 100 keeps the CPU budget


def _small():
    return _linear(DIM, DIM), np.ones((1, DIM), np.float32)


MODELS = {
    "batch_norm_net": lambda: (batch_norm_net(), np.ones((1, 2), np.float32)),
    "large_conv_model": lambda: (conv_model(), np.ones((1, 13, 13, 1), np.float32)),
    "small_model": _small,
    "unjoined_rank_with_unused_params_model": lambda: (unused_param_module(1), None),
    "joined_rank_with_unused_params_model": lambda: (unused_param_module(0), None),
    "small_model_allreduce_hook": _small,
    "small_model_power_sgd_hook": _small,
}
# torch runs no_sync every i + 2 steps for every model; these cover BatchNorm buffers,
# a plain model and unused parameters within the CPU budget
NO_SYNC_MODELS = ("batch_norm_net", "small_model", "joined_rank_with_unused_params_model")


def _hook(name):
    from jdist.ddp import hooks

    if name == "small_model_allreduce_hook":
        return None, hooks.allreduce_hook
    if name == "small_model_power_sgd_hook":
        return hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=1, warm_start=False,
                                   use_error_feedback=False), hooks.powerSGD_hook
    return None


class _Wrapped:
    """One DDP wrapper and its ``param += grad`` step for a torch test model."""

    def __init__(self, name, rank):
        import optax

        from jdist.ddp import DistributedDataParallel as DDP

        _, nnx = _nnx()
        model, inp = MODELS[name]()
        unused = "unused_params_model" in name
        if unused:
            inp = (np.ones((1, 2), np.float32), np.full((1,), rank, np.int32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # find_unused_parameters found none
            self.ddp = DDP(model, bucket_cap_mb=1, find_unused_parameters=unused)
        hook = _hook(name)
        if hook is not None:
            self.ddp.register_comm_hook(*hook)
        self.inp = inp

        def loss(m, batch):
            out = m(*batch) if isinstance(batch, tuple) else m(batch)
            return out.sum()

        opt = nnx.Optimizer(model, optax.sgd(-1.0), wrt=nnx.Param)
        self.step = self.ddp.train_step(loss, opt)


def run_uneven(w: _Wrapped, rank, world, mapping, sync_interval, throw):
    """torch's ``_run_uneven_inputs_test`` for one case; returns what it asserts on."""
    num_iters = mapping[rank]
    min_num_iters = min(mapping.values())
    total_iters = 0

    def body():
        nonlocal total_iters
        with w.ddp.join(throw_on_early_termination=throw):
            for i in range(num_iters):
                ctx = w.ddp.no_sync() if i % sync_interval != 0 else nullcontext()
                with ctx, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    w.step(w.inp)
                total_iters += 1

    _, err = _error(body)
    return {"total_iters": total_iters, "min_num_iters": min_num_iters, "error": err,
            "authoritative_rank": getattr(w.ddp, "_authoritative_rank", None),
            "digest": _digest(w.ddp.module)}


def uneven_inputs(rank, world):
    """torch's test_ddp_uneven_inputs: every model plain, the first ones under
    ``no_sync`` every k steps, and with ``throw_on_early_termination``; mappings with
    rank 0 joining 2 and 10 steps early and with no input at all."""
    out = {}
    mappings = {"5+2": {0: 5, 1: 7}, "5+10": {0: 5, 1: 15}, "0+3": {0: 0, 1: 3}}
    import time

    for i, name in enumerate(MODELS):
        c0 = time.process_time()
        w = _Wrapped(name, rank)
        runs = [("plain", "5+2", 1, False), ("throw", "5+2", 1, True)]
        if name in NO_SYNC_MODELS:
            runs.append(("no_sync", "5+2", i + 2, False))
        if name == "small_model":
            runs += [("plain", "5+10", 1, False), ("plain", "0+3", 1, False)]
        for variant, mkey, interval, throw in runs:
            out[name, variant, mkey] = run_uneven(w, rank, world, mappings[mkey], interval,
                                                  throw)
        out["cpu", name] = round(time.process_time() - c0, 2)
    return out


def grad_div(rank, world):
    """torch's test_ddp_grad_div_uneven_inputs: the gradients seen each step."""
    from jdist.ddp import DistributedDataParallel as DDP

    dim, grad_scale = 5, 50
    ddp = DDP(_linear(dim, dim), bucket_cap_mb=1)
    f = ddp.value_and_grad(_sum_loss)
    inp = np.ones((1, dim), np.float32) * grad_scale
    n_iters = 3 + (2 if rank > 0 else 0)
    seen = {}
    for divide in (False, True):
        grads = []
        with ddp.join(divide_by_initial_world_size=divide):
            for _ in range(n_iters):
                _, g = f(inp)
                grads.append(np.asarray(g["kernel"][...]))
        seen[divide] = grads
    return seen


def model_equivalence(rank, world):
    """torch's test_ddp_join_model_equivalence: (local model, DDP model) parameters."""
    import jax
    import optax

    from jdist.ddp import DistributedDataParallel as DDP

    jnp, nnx = _nnx()
    batch, dim, lr = 3, 10, 0.03
    inp = np.random.RandomState(0).rand(batch, dim).astype(np.float32)
    iters = {r: 2 * (r + 1) for r in range(world)}
    local = _linear(dim, dim)
    opt = nnx.Optimizer(local, optax.sgd(lr), wrt=nnx.Param)
    for _ in range(sum(iters.values())):
        grads = nnx.grad(lambda m: _sum_loss(m, jnp.asarray(inp)))(local)
        opt.update(local, grads)
    model = _linear(dim, dim)
    ddp = DDP(model)
    step = ddp.train_step(_sum_loss, nnx.Optimizer(model, optax.sgd(lr * world),
                                                   wrt=nnx.Param))
    with ddp.join():
        for _ in range(iters[rank]):
            step(inp)
    return [jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m)))
            for m in (local, model)]


def stop_iteration_sync_bn(rank, world):
    """torch's test_ddp_uneven_inputs_stop_iteration_sync_bn: SyncBatchNorm and a model
    with its own collective (an in-graph all-reduce), throw_on_early_termination."""
    import optax

    from jdist.collectives import functional as F
    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.ddp import convert_sync_batchnorm

    _, nnx = _nnx()

    class ModelWithComm(nnx.Module):
        def __init__(self):
            self.lin = _linear(2, 40)

        def __call__(self, x):
            return F.all_reduce(self.lin(x), group=self.axis)

    out = {}
    x = np.random.RandomState(rank).randn(10, 2).astype(np.float32)
    import jdist

    comm = ModelWithComm()
    comm.axis = jdist.get_default_group().axis_name
    for name, model in (("bn", convert_sync_batchnorm(batch_norm_net())), ("comm", comm)):
        ddp = DDP(model)
        step = ddp.train_step(_sum_loss, nnx.Optimizer(model, optax.sgd(-1.0),
                                                       wrt=nnx.Param))
        num_iters = 5 if rank != 0 else 10
        n = 0

        def body(step=step, num_iters=num_iters, ddp=ddp):
            nonlocal n
            with ddp.join(throw_on_early_termination=True):
                for _ in range(num_iters):
                    step(x)
                    n += 1

        _, err = _error(body)
        out[name] = {"n": n, "error": err, "digest": _digest(model)}
    return out


def join_disable(rank, world):
    """torch's test_ddp_uneven_input_join_disable: grads with enable=False."""
    from jdist.ddp import DistributedDataParallel as DDP

    ddp = DDP(_linear(1, 1, bias=True, seed=rank))
    f = ddp.value_and_grad(_sum_loss)
    inp = np.ones((1, 1), np.float32) * rank
    grads = []
    with ddp.join(enable=False):
        enabled_inside = ddp._join_config.enable
        for _ in range(5):
            _, g = f(inp)
            grads.append(float(np.asarray(g["kernel"][...]).item()))
    return {"grads": grads, "enable": enabled_inside, "digest": _digest(ddp.module)}


def uneven_exception(rank, world):
    """torch's test_ddp_uneven_input_exception: the body's error propagates."""
    from jdist.ddp import DistributedDataParallel as DDP

    jnp, nnx = _nnx()

    class ExceptionModule(nnx.Module):
        def __init__(self):
            self.param = nnx.Param(jnp.ones((1,)))

        def __call__(self, _):
            raise ValueError("Intentional error")

    ddp = DDP(ExceptionModule())
    f = ddp.value_and_grad(_sum_loss)

    def body():
        with ddp.join():
            f(np.ones((1, 1), np.float32))

    return _error(body)[1]


def forward_sync_buffers_false(rank, world):
    """torch's test_ddp_join_respects_forward_sync_buffers_false: (before, after)."""
    from jdist.ddp import DistributedDataParallel as DDP

    jnp, nnx = _nnx()

    class NetWithBuffers(nnx.Module):
        def __init__(self):
            self.fc = _linear(10, 10)
            self.rank_local = nnx.BatchStat(jnp.asarray(
                np.random.RandomState(rank + 42).randn(10).astype(np.float32)))

        def __call__(self, x):
            return self.fc(x) + self.rank_local[...]

    model = NetWithBuffers()
    ddp = DDP(model, forward_sync_buffers=False)
    f = ddp.value_and_grad(_sum_loss)
    before = np.asarray(model.rank_local[...]).copy()
    rs = np.random.RandomState(rank)
    with ddp.join():
        for _ in range(rank + 1):
            f(rs.randn(2, 10).astype(np.float32))
    return before, np.asarray(model.rank_local[...])


def no_input_fresh(rank, world):
    """A fresh DDP module whose rank 0 has no input at all (its first step is inside the
    join context on every process): the final parameters on each rank."""
    import optax

    from jdist.ddp import DistributedDataParallel as DDP

    _, nnx = _nnx()
    model = _linear(3, 1)
    initial = np.asarray(model.kernel[...]).copy()
    ddp = DDP(model)
    step = ddp.train_step(_sum_loss, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with ddp.join():
        for i in range(0 if rank == 0 else 3):
            step(np.full((2, 3), i + 1.0, np.float32))
    fresh = np.asarray(model.kernel[...])
    # the same module with a user joinable in one context (torch's Join([model, optim])
    # shape): DDP's hook, then the all-reducer's, in the loop's order
    from tests.algorithms.join_cases import _classes

    Join, AllReducer = _classes()
    reducer, total = AllReducer(None, ddp.process_group), 0.0
    with Join([ddp, reducer]):
        for _ in range(2 + 2 * rank):
            step(np.full((2, 3), 1.0, np.float32))
            total += reducer(1)
    return initial, fresh, total, _digest(model)


def smaller_last_batch(rank, world):
    """Rank 1's last batch has 3 rows instead of 4 while rank 0 has joined: (initial
    kernel, final kernel)."""
    import optax

    from jdist.ddp import DistributedDataParallel as DDP

    _, nnx = _nnx()
    model = _linear(3, 1, seed=1)
    initial = np.asarray(model.kernel[...]).copy()
    ddp = DDP(model)
    step = ddp.train_step(_sum_loss, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    batches = [np.ones((4, 3), np.float32)] * 2
    if rank == 1:
        batches.append(np.full((3, 3), 2.0, np.float32))
    with ddp.join():
        for x in batches:
            step(x)
    return initial, np.asarray(model.kernel[...])


def main():
    """The shared launch: every case in turn on both ranks."""
    import time

    from tests.ddp.mp_cases import _finish, _init

    rank, world = _init()
    out, times = {"world": world}, {}
    for name, fn in (("grad_div", grad_div), ("model_equivalence", model_equivalence),
                     ("join_disable", join_disable), ("exception", uneven_exception),
                     ("buffers", forward_sync_buffers_false), ("fresh", no_input_fresh),
                     ("smaller_last", smaller_last_batch),
                     ("sync_bn", stop_iteration_sync_bn), ("uneven", uneven_inputs)):
        t0, c0 = time.perf_counter(), time.process_time()
        out[name] = fn(rank, world)
        times[name] = (round(time.perf_counter() - t0, 2), round(time.process_time() - c0, 2))
    out["times"] = times
    _finish()
    return out
