"""The comm-hook tests of torch's distributed_test.py (``hook|localSGD|get_future``).

torch runs them on WORLD_SIZE ranks; here 2 replicas on 2 local devices, each replica's
batch rows being its rank's inputs. torch's hooks return futures of process-group
all-reduces; jdist hooks run the collective inside the step
(``jdist.collectives.functional``) and may return a Future (``jdist.rpc.Future``) of
the buffer, so the ``then`` chains are kept as torch writes them.
"""

from __future__ import annotations

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdist
from jdist.collectives import functional as F
from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp import hooks as H
from jdist.rpc import Future

WORLD = 2


def group(n=WORLD):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"torch_dist{n}")


class Net(nnx.Module):
    """torch's ``Net``: 2 -> 10 -> 50 -> 4, no biases, relu, softmax."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.fc1 = nnx.Linear(2, 10, use_bias=False, rngs=rngs)
        self.fc2 = nnx.Linear(10, 50, use_bias=False, rngs=rngs)
        self.fc3 = nnx.Linear(50, 4, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.fc1(x))
        x = jax.nn.relu(self.fc2(x))
        return jax.nn.softmax(self.fc3(x), axis=1)


def mse(module, batch):
    return jnp.mean((module(batch["x"]) - batch["y"]) ** 2)


def _allclose(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _accumulate_gradients_no_sync(num_iters, ddp_comm_hook):
    """torch's ``_test_accumulate_gradients_no_sync``: even iterations accumulate locally
    under ``no_sync()``, odd ones reduce (accumulated + new) through the hook. torch's
    ``.grad`` keeps growing; jdist returns each synced step's gradients, so the check is
    against the full batch's gradients summed over the same window of iterations."""
    pg = group()
    model = Net()
    ddp = DDP(Net(), process_group=pg, bucket_cap_mb=0.001)
    ddp.register_comm_hook(pg, ddp_comm_hook)
    rng = np.random.RandomState(0)
    batch = {"x": rng.randn(WORLD, 2).astype(np.float32),
             "y": rng.randn(WORLD, 4).astype(np.float32)}
    # a forward under no_sync (torch: with no_grad) accumulates nothing
    with ddp.no_sync():
        ddp(batch["x"])
    f = ddp.value_and_grad(mse)
    full = nnx.jit(nnx.grad(mse))  # one program, not op by op
    window = None
    for iteration in range(num_iters):
        g = full(model, batch)
        window = g if window is None else jax.tree.map(jnp.add, window, g)
        if iteration % 2 == 0:
            with ddp.no_sync():
                _, grads = f(batch)
            assert grads is None  # local only: nothing reduced yet
        else:
            _, grads = f(batch)
            _allclose(grads, window)
            window = None
        perm = np.random.RandomState(1337 + iteration).permutation(WORLD)
        batch = {k: v[perm] for k, v in batch.items()}
    assert len(ddp.buckets.buckets) > 1  # bucket_cap_mb=0.001: several buckets


def test_accumulate_gradients_no_sync_allreduce_hook():
    def allreduce_hook(group_id, bucket: H.GradBucket) -> Future:
        tensors = [bucket.buffer / WORLD]
        fut = Future()
        fut.set_result([F.all_reduce(tensors[0], F.ReduceOp.SUM, group_id)])
        return fut.then(lambda fut: fut.value()[0])

    _accumulate_gradients_no_sync(4, allreduce_hook)


def test_accumulate_gradients_no_sync_allreduce_with_then_hook():
    def allreduce_with_then_hook(group_id, bucket: H.GradBucket) -> Future:
        fut = Future()
        fut.set_result([F.all_reduce(bucket.buffer, F.ReduceOp.SUM, group_id)])

        def mult(fut):
            return 2 * fut.wait()[0]  # multiply the result by 2

        def div(fut):
            return fut.wait() / (2 * WORLD)  # divide the result by 2 * world_size

        return fut.then(mult).then(div)

    _accumulate_gradients_no_sync(4, allreduce_with_then_hook)


# ------------------------------------------------------------------ hook parity
ITERS = 20  # torch runs 100 iterations of the same check; 20 here (suite budget)


def _ddp_hook_parity(state, hook, pg, num_validated_iters=ITERS):
    """torch's ``_test_ddp_hook_parity``: Linear(1, 5), each rank's input its rank; the
    weight gradient is the mean rank, with and without the hook, every iteration."""
    m = nnx.Linear(1, 5, rngs=nnx.Rngs(0))
    net_with_hook = DDP(copy.deepcopy(m), process_group=pg)
    net_with_hook.register_comm_hook(state=state, hook=hook)
    net_without_hook = DDP(copy.deepcopy(m), process_group=pg)
    batch = np.arange(WORLD, dtype=np.float32)[:, None]
    loss_sum = lambda module, x: jnp.sum(module(x))  # noqa: E731
    f_plain = net_without_hook.value_and_grad(loss_sum)
    f_hook = net_with_hook.value_and_grad(loss_sum)
    expected_grad = sum(range(WORLD)) / WORLD
    for i in range(ITERS):
        _, grad = f_plain(batch)
        _, grad_hook = f_hook(batch)
        avg = float(grad["kernel"][0, 0])
        avg_hook = float(grad_hook["kernel"][0, 0])  # torch's weight[0, 0]
        if i < num_validated_iters:
            assert avg_hook == expected_grad, (i, avg_hook)
            assert avg_hook == avg
    return net_with_hook


def test_ddp_hook_parity_allreduce():
    _ddp_hook_parity(None, H.allreduce_hook, group())


def test_ddp_hook_parity_allreduce_process_group():
    pg = group()  # the process group passed to both DDP and the hook
    _ddp_hook_parity(pg, H.allreduce_hook, pg)


def test_ddp_hook_parity_powerSGD():
    for warm_start in (True, False):
        state = H.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                start_powerSGD_iter=2, warm_start=warm_start)
        ddp = _ddp_hook_parity(state, H.powerSGD_hook, group())
        assert int(ddp.comm_hook_state.iter) == ITERS


def test_ddp_hook_pickling_powerSGD():
    """torch saves ``{state_dict, comm_hook, comm_hook_state}`` after 10 steps, loads it
    into a second DDP model, and checks both give the same gradients 10 steps later."""
    lr = 0.01
    rng = np.random.RandomState(0)
    x, y = rng.randn(7, 1).astype(np.float32), rng.randn(7, 5).astype(np.float32)
    batch = {"x": np.concatenate([x] * WORLD), "y": np.concatenate([y] * WORLD)}
    net = nnx.Linear(1, 5, rngs=nnx.Rngs(0))
    hook = H.powerSGD_hook
    hook_state = H.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                 start_powerSGD_iter=4)
    loss = lambda module, b: jnp.mean((module(b["x"]) - b["y"]) ** 2)  # noqa: E731

    def train(ddp, opt, steps):
        f, grads = ddp.value_and_grad(loss), None
        for _ in range(steps):
            _, grads = f(batch)
            opt.update(ddp.module, grads)
        return grads

    ddp_model = DDP(copy.deepcopy(net), process_group=group())
    dummy_ddp_model = DDP(copy.deepcopy(net), process_group=group())
    optimizer = nnx.Optimizer(ddp_model.module, optax.sgd(lr), wrt=nnx.Param)
    ddp_model.register_comm_hook(hook_state, hook)
    train(ddp_model, optimizer, 10)

    saved = pickle.dumps({"state_dict": jax.tree.map(np.asarray, nnx.state(ddp_model.module)),
                          "comm_hook": hook, "comm_hook_state": ddp_model.comm_hook_state})
    checkpoint = pickle.loads(saved)
    nnx.update(dummy_ddp_model.module, checkpoint["state_dict"])
    dummy_hook, dummy_hook_state = checkpoint["comm_hook"], checkpoint["comm_hook_state"]
    dummy_optimizer = nnx.Optimizer(dummy_ddp_model.module, optax.sgd(lr), wrt=nnx.Param)
    assert dummy_hook.__qualname__ == hook.__qualname__
    saved_state = ddp_model.comm_hook_state
    for name in ("process_group", "matrix_approximation_rank", "start_powerSGD_iter",
                 "min_compression_rate", "use_error_feedback", "warm_start",
                 "orthogonalization_epsilon", "random_seed", "layout"):
        assert getattr(dummy_hook_state, name) == getattr(saved_state, name), name
    _allclose(jax.tree.leaves((dummy_hook_state.iter, dummy_hook_state.error_dict,
                               dummy_hook_state.q_memory_dict)),
              jax.tree.leaves((saved_state.iter, saved_state.error_dict,
                               saved_state.q_memory_dict)), rtol=0, atol=0)
    dummy_ddp_model.register_comm_hook(dummy_hook_state, dummy_hook)
    grads = train(ddp_model, optimizer, 10)
    dummy_grads = train(dummy_ddp_model, dummy_optimizer, 10)
    _allclose(grads, dummy_grads, rtol=0, atol=0)


# ---------------------------------------------------------- module hooks, errors
def relu_pre(x):
    return jax.nn.relu(x)


@jax.custom_vjp
def gelu_celu_backward(z):
    """torch's forward hook (gelu on the output) with the backward hook on it
    (``celu`` of the incoming gradient replaces gelu's own gradient)."""
    return jax.nn.gelu(z, approximate=False)


gelu_celu_backward.defvjp(lambda z: (gelu_celu_backward(z), None),
                          lambda _, ct: (jax.nn.celu(ct),))


class DummyTestModel(nnx.Module):
    """torch's module with forward pre-hook relu, forward hook gelu, backward hook
    celu: in JAX hooks are function composition and a ``custom_vjp``."""

    def __init__(self):
        self.fc = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return gelu_celu_backward(self.fc(relu_pre(x)))


def test_ddp_forward_backward_hook():
    local_model = DummyTestModel()
    ddp_model = DDP(DummyTestModel(), process_group=group())
    input_data = np.random.RandomState(0).rand(5, 2).astype(np.float32)
    per_rank = np.concatenate([input_data] * WORLD)  # each rank's own copy
    output_local = local_model(input_data)
    output_ddp = ddp_model(per_rank)
    np.testing.assert_allclose(np.asarray(output_ddp[:5]), np.asarray(output_local),
                               rtol=1e-6)
    sum_loss = lambda module, x: jnp.sum(module(x))  # noqa: E731
    local_grads = nnx.jit(nnx.grad(sum_loss))(local_model, input_data)
    _, ddp_grads = ddp_model.value_and_grad(sum_loss)(per_rank)
    _allclose(ddp_grads, local_grads, rtol=1e-6)


@jax.custom_vjp
def simulate_error(x):
    return x


def _raise(*_):
    raise RuntimeError("SimulateError.backward")


simulate_error.defvjp(lambda x: (x, None), _raise)


class ErrorModel(nnx.Module):
    def __init__(self):
        self.error = True
        self.fc1 = nnx.Linear(10, 10, rngs=nnx.Rngs(0))

    def __call__(self, inp):
        out = self.fc1(inp)  # JAX differentiates the parameters only: raise after fc1
        return simulate_error(out) if self.error else out


def test_ddp_remove_autograd_hooks():
    """A backward that raises leaves nothing behind: a new DDP on the same module
    trains (torch needs ``_remove_autograd_hooks()`` on the old instance first)."""
    model = ErrorModel()
    inp = np.random.RandomState(0).rand(10, 10).astype(np.float32)
    sum_loss = lambda module, x: jnp.sum(module(x))  # noqa: E731
    model_ddp1 = DDP(model, process_group=group())
    with pytest.raises(RuntimeError, match="SimulateError.backward"):
        model_ddp1.value_and_grad(sum_loss)(inp)
    model.error = False
    model_ddp2 = DDP(model, process_group=group())
    _, grads = model_ddp2.value_and_grad(sum_loss)(inp)
    assert np.isfinite(np.asarray(grads["fc1"]["kernel"])).all()


# ----------------------------------------------------------------------- get_future
def test_get_future(monkeypatch):
    """torch's test_get_future: ``then`` chains on an async all_reduce's future (one
    process here, so ``len(group) == 1``); also ``value``, ``wait`` and a callback's
    error reaching the chained future."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    if jdist.is_initialized():
        jdist.destroy_process_group()
    jdist.init_process_group()
    try:
        def mult(fut):
            return [t * 3 for t in fut.wait()]

        def add(fut):
            return [t + 1 for t in fut.wait()]

        inp = np.full((3, 3, 3), 2.0, np.float32)  # torch's _build_tensor(3, 2)
        fut = jdist.all_reduce(inp, async_op=True).get_future()
        res = fut.then(lambda f: [f.wait()]).then(mult).then(add).wait()
        expected = np.full((3, 3, 3), 2 * jdist.get_world_size() * 3 + 1, np.float32)
        np.testing.assert_array_equal(res[0], expected)
        np.testing.assert_array_equal(fut.value(), inp * jdist.get_world_size())

        def boom(f):
            raise ValueError("from the callback")

        with pytest.raises(ValueError, match="from the callback"):
            fut.then(boom).wait(timeout=60)
    finally:
        jdist.destroy_process_group()
