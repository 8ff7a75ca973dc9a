"""The comm-hook tests of torch's test_c10d_common.py and test_c10d_gloo.py, translated.

torch's ``ModuleForDdpCommHook`` is ``Task`` (``p = ones(2, 2)``, ``forward(x) = p + x``)
called as ``t0(x + rank)`` on 2 ranks; here 2 replicas on 2 local devices, each batch
row carrying ``x + rank``. A torch hook returns a ``torch.futures.Future``; a jdist hook
returns ``(buffer, new_state)`` or any Future with ``wait()`` (``jdist.rpc.Future``
here), so torch's future-chaining hooks run as written.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdist.collectives import functional as F
from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp import DistributedDataParallel as DDP
from jdist.ddp import hooks as H
from jdist.ddp._hookslot import HOOK_ONCE_MSG
from jdist.rpc import Future

WORLD = 2


def group(n=WORLD):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"torch_c10d{n}")


class Task(nnx.Module):
    def __init__(self):
        self.p = nnx.Param(jnp.ones((2, 2)))

    def __call__(self, x):
        return self.p[...] + x


def ranked_input(x):
    """Per replica ``x + rank`` (torch's ``forward(x, rank)``)."""
    return np.arange(WORLD, dtype=np.float32)[:, None] + np.float32(x)


def output_mean(module, batch):
    return jnp.mean(module(batch[0, 0]))


def simple_hook(state, bucket):
    """torch's ``_simple_hook``: a Future of ones, then ``t + ones_like(t)``."""
    fut = Future()
    fut.set_result(jnp.ones_like(bucket.buffer))

    def fut_then(fut):
        t = fut.value()
        return t + jnp.ones_like(t)

    return fut.then(fut_then)


def run_and_verify_hook(ddp, x, expected_grad):
    _, grads = ddp.value_and_grad(output_mean)(ranked_input(x))
    for g in jax.tree.leaves(grads):
        np.testing.assert_array_equal(np.asarray(g), expected_grad)


# ------------------------------------------------------------------ test_c10d_gloo.py
def test_ddp_comm_hook_future_passing_cpu():
    cpu_model = DDP(Task(), process_group=group())
    cpu_model.register_comm_hook(None, simple_hook)
    # without the comm hook the result would be 0.25 * ones(2, 2)
    run_and_verify_hook(cpu_model, 8, 2 * np.ones((2, 2)))
    plain = DDP(Task(), process_group=group())
    run_and_verify_hook(plain, 8, 0.25 * np.ones((2, 2)))


def test_ddp_comm_hook_future_passing_gpu_gloo():
    """torch's GPU variant registers through its ``_gpu_model_with_ddp_comm_hook`` helper;
    here through DDP's ``comm_hook=`` argument, on the default devices."""
    gpu_model = DDP(Task(), process_group=group(), comm_hook=(None, simple_hook))
    run_and_verify_hook(gpu_model, 8, 2 * np.ones((2, 2)))


def test_ddp_invalid_comm_hook_init():
    model = DDP(Task(), process_group=group())
    with pytest.raises(TypeError, match="Communication hook must be callable."):
        model.register_comm_hook(state=None, hook=1)

    def comm_hook(state: object, bucket: int) -> Future:
        return Future()

    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket."):
        model.register_comm_hook(state=None, hook=comm_hook)

    # jdist's own signature check: a hook that cannot take (state, bucket)
    with pytest.raises(TypeError, match=r"must take \(state, bucket\) positionally"):
        model.register_comm_hook(state=None, hook=lambda bucket: bucket)
    # a well-annotated hook is accepted after the refusals
    model.register_comm_hook(None, annotated_allreduce)


def annotated_allreduce(state: object, bucket: H.GradBucket) -> tuple[jax.Array, object]:
    return jax.lax.pmean(bucket.buffer, bucket.axis_name), state


def test_ddp_invalid_comm_hook_return_type():
    model = DDP(Task(), process_group=group())
    expected_err = "Communication hook: return annotation should be torch.futures.Future"

    def comm_hook(state: object, bucket: H.GradBucket) -> int:
        return Future()

    with pytest.raises(ValueError, match=expected_err):
        model.register_comm_hook(state=None, hook=comm_hook)
    # torch also checks the error was logged in _get_ddp_logging_data: no such log here

    def comm_hook_bad(state: object, bucket: H.GradBucket):
        return 1

    model.register_comm_hook(state=None, hook=comm_hook_bad)
    with pytest.raises(RuntimeError,
                       match="callback must return a torch.futures.Future object, but got"):
        model.value_and_grad(output_mean)(ranked_input(8))


def test_ddp_comm_hook_register_just_once():
    model = DDP(Task(), process_group=group())

    def dummy_hook(state, bucket):
        fut = Future()
        fut.set_result([bucket.buffer])
        return fut

    model.register_comm_hook(None, dummy_hook)
    with pytest.raises(RuntimeError, match=re.escape(
            "register_comm_hook or register_builtin_comm_hook can only be called once.")):
        model.register_comm_hook(None, dummy_hook)
    assert HOOK_ONCE_MSG == ("register_comm_hook or register_builtin_comm_hook can only be "
                             "called once.")


class EmbeddingBagMean(nnx.Module):
    """torch's ``SparseGradientModule``: EmbeddingBag(10, 10) (mean) then softmax."""

    def __init__(self):
        w = np.random.RandomState(1337).randn(10, 10).astype(np.float32)
        self.weight = nnx.Param(jnp.asarray(w))

    def __call__(self, idx):
        return jax.nn.softmax(jnp.mean(self.weight[...][idx], axis=1), axis=1)


def cross_entropy(module, batch):
    logits = module(batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def test_ddp_comm_hook_sparse_gradients():
    """The allreduce-then-divide hook with gradients of an embedding lookup: equal to
    the full batch's (JAX's embedding gradients are dense arrays, torch's sparse)."""
    pg = group()

    def allreduce_hook_gloo(state, bucket: H.GradBucket):
        def div_by_world_size(fut):
            return fut.wait()[0] / WORLD

        fut = Future()
        fut.set_result([F.all_reduce(bucket.buffer, F.ReduceOp.SUM, bucket.axis_name)])
        return fut.then(div_by_world_size)

    vanilla = EmbeddingBagMean()
    ddp = DDP(EmbeddingBagMean(), process_group=pg)
    ddp.register_comm_hook(None, allreduce_hook_gloo)
    mult = 2
    rng = np.random.RandomState(0)
    batch = {"x": rng.randint(0, 10, (mult * WORLD, 2)), "y": rng.randint(0, 10, mult * WORLD)}
    full = nnx.jit(nnx.grad(cross_entropy))(vanilla, batch)
    _, grads = ddp.value_and_grad(cross_entropy)(batch)
    np.testing.assert_allclose(np.asarray(grads["weight"]), np.asarray(full["weight"]),
                               rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- test_c10d_common.py
def test_invalid_powerSGD_state():
    for start_powerSGD_iter, use_error_feedback, warm_start in itertools.product(
            [0, 1], [True, False], [True, False]):
        if not use_error_feedback and not warm_start:
            continue
        with pytest.raises(
                ValueError,
                match="Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or "
                      "`warm_start` is enabled, because PowerSGD can only be applied after "
                      "the first two iterations in DDP."):
            H.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                            start_powerSGD_iter=start_powerSGD_iter,
                            use_error_feedback=use_error_feedback, warm_start=warm_start)


# ------------------------------------------ issue 39: results equal on every replica
def gather_mean_hook(state, bucket):
    """The mean from a plain ``jax.lax.all_gather``: equal on every replica, but typed
    per-replica (varying) by JAX."""
    return jnp.mean(jax.lax.all_gather(bucket.buffer, bucket.axis_name), axis=0), state


def ring_sum_hook(state, bucket):
    """A ring all-reduce of ``ppermute`` steps (varying-typed, equal values)."""
    n, total, cur = bucket.num_replicas, bucket.buffer, bucket.buffer
    for _ in range(n - 1):
        cur = jax.lax.ppermute(cur, bucket.axis_name, [(i, (i + 1) % n) for i in range(n)])
        total = total + cur
    return total / n, state


@pytest.mark.parametrize("hook", [gather_mean_hook, ring_sum_hook])
def test_hook_result_equal_on_every_replica_is_accepted(hook):
    rng = np.random.RandomState(3)
    batch = {"x": rng.randn(WORLD * 3, 10, 2).astype(np.float32)}
    module = lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0))  # noqa: E731
    loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)  # noqa: E731
    plain = DDP(module(), process_group=group())
    _, want = plain.value_and_grad(loss)(batch)
    ddp = DDP(module(), process_group=group(), comm_hook=hook)
    _, got = ddp.value_and_grad(loss)(batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# ------------------------------------------------- registration: what is accepted
class CallableHook:
    def __call__(self, state, bucket: H.GradBucket) -> tuple:
        return jax.lax.pmean(bucket.buffer, bucket.axis_name), state


def test_builtin_and_wrapped_hooks_pass_registration_checks():
    import functools

    from jdist.ddp.hooks._contract import check_hook

    for hook in (H.allreduce_hook, H.fp16_compress_hook, H.bf16_compress_hook,
                 H.powerSGD_hook, H.batched_powerSGD_hook, H.quantization_pertensor_hook,
                 H.quantization_perchannel_hook, H.fp16_compress_wrapper(H.powerSGD_hook),
                 functools.partial(H.quantization_perchannel_hook, bucket_size=4),
                 CallableHook(), simple_hook):
        check_hook(hook)


def test_register_ddp_comm_hook_wraps_powersgd_state():
    pg = group()
    ddp = DDP(Task(), process_group=pg)
    H.register_ddp_comm_hook(H.DDPCommHookType.POWER_SGD_RANK2, ddp, state=None)
    st = ddp.comm_hook_state
    assert isinstance(st, H.PowerSGDState)
    assert (st.matrix_approximation_rank, st.start_powerSGD_iter) == (2, 1_000)
    with pytest.raises(TypeError, match="expects a DDPCommHookType"):
        H.register_ddp_comm_hook("allreduce", DDP(Task(), process_group=pg))


def test_hook_returning_wrong_tuple_names_the_rule():
    model = DDP(Task(), process_group=group())
    model.register_comm_hook(None, lambda s, b: (b.buffer, s, 1))
    with pytest.raises(RuntimeError, match=r"but got a tuple of 3\. A jdist hook returns "
                                           r"\(reduced_buffer, new_state\)"):
        model.value_and_grad(output_mean)(ranked_input(8))
