"""torch's multi-rank DDP tests of ``distributed_test.py``, run by
``test_dist_ddp_multiproc.py`` in ONE shared launch of 2 real processes (module level:
picklable). Each case returns plain values (numpy arrays, error class names and texts);
the assertions are in the test file. A case that raises returns ``{"error": ...}`` so
the other cases still run and the test names the failure."""

from __future__ import annotations

import traceback

import numpy as np

BATCH, DIM = 20, 10


def _grads(tree):
    import jax
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(tree))


def _error(e):
    return {"class": type(e).__name__, "message": str(e),
            "runtime": isinstance(e, RuntimeError)}


def broadcast_buffer(rank, world):
    """``test_ddp_broadcast_buffer``: rank 0 changes its buffer before each forward;
    after each step the buffers are rank 0's everywhere."""
    import jax.numpy as jnp
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    class NetWithBuffers(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(rank)  # torch.manual_seed(rank): different models per rank
            self.a = nnx.Linear(10, 10, use_bias=False, rngs=r)
            self.b = nnx.Linear(10, 1, use_bias=False, rngs=r)
            self.buffer = nnx.BatchStat(jnp.asarray(np.random.RandomState(rank).randn(1, 2),
                                                    jnp.float32))

        def __call__(self, x):
            return self.b(self.a(x))

    model = NetWithBuffers()
    ddp = DDP(model)
    vg = ddp.value_and_grad(lambda m, x: m(x).sum())
    inp = np.random.RandomState(rank).randn(2, 10).astype(np.float32)
    seen = []
    for _ in range(2):
        if rank == 0:
            model.buffer[...] = model.buffer[...] + 1
        vg(inp)
        seen.append(np.asarray(model.buffer[...]))
    return {"bufs": seen, "initial_rank0": np.random.RandomState(0).randn(1, 2)}


def init_sync_buffers_forward_sync_false(rank, world):
    """``test_ddp_init_sync_buffers_with_forward_sync_buffers_false``."""
    import jax.numpy as jnp
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    class NetWithBuffers(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(10, 10, use_bias=False, rngs=nnx.Rngs(rank))
            self.frozen_coeff = nnx.BatchStat(
                jnp.asarray(np.random.RandomState(rank).randn(10), jnp.float32))

        def __call__(self, x):
            return self.a(x) + self.frozen_coeff[...]

    model = NetWithBuffers()
    ddp = DDP(model, forward_sync_buffers=False)
    out = {"flag": ddp.forward_sync_buffers, "after_init": np.asarray(model.frozen_coeff[...])}
    if rank == 0:
        model.frozen_coeff[...] = model.frozen_coeff[...] + 1
    ddp.value_and_grad(lambda m, x: m(x).sum())(np.ones((2, 10), np.float32))
    out["after_step"] = np.asarray(model.frozen_coeff[...])
    return out


def _embedding_net(rank, diff_num_params=False):
    from flax import nnx

    class EmbeddingNetDifferentParams(nnx.Module):
        def __init__(self):
            dim = 500 if diff_num_params or rank == 0 else 50
            self.embedding = nnx.Embed(10, dim, rngs=nnx.Rngs(0))
            self.lin = nnx.Linear(dim, 1, rngs=nnx.Rngs(0))
            if diff_num_params:
                self.lin2 = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.lin(self.embedding(x))

    return EmbeddingNetDifferentParams()


def model_diff(rank, world):
    """``test_ddp_model_diff_shape_across_ranks`` / ``_num_params_``: DDP refuses to
    wrap models that differ across ranks."""
    from jdist.ddp import DistributedDataParallel as DDP

    out = {}
    for kind, diff_num in (("shape", False), ("num_params", True)):
        try:
            DDP(_embedding_net(rank, diff_num_params=diff_num and rank == 1))
            out[kind] = None
        except Exception as e:  # noqa: BLE001 - the test checks class and text
            out[kind] = _error(e)
    return out


def verify_model_after_change(rank, world):
    """``test_verify_model_across_rank_*``: the module's ``lin`` replaced after wrapping
    by layers of another shape on each rank; the next step must fail."""
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    net = _embedding_net(0)
    ddp = DDP(net)
    net.lin = nnx.Linear(100 if rank == 0 else 10, 1, rngs=nnx.Rngs(0))
    try:
        ddp.value_and_grad(lambda m, x: m(x).sum())(np.zeros((2,), np.int32))
        return None
    except Exception as e:  # noqa: BLE001
        return _error(e)


def _control_flow_model(rank, seed=0):
    import jax
    from flax import nnx

    class ToyModel(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(seed)
            self.lin1 = nnx.Linear(10, 10, use_bias=False, rngs=r)
            self.lin2 = nnx.Linear(10, 10, use_bias=False, rngs=r)

        def __call__(self, x, use_second_layer):
            if use_second_layer:
                return self.lin2(jax.nn.relu(self.lin1(x)))
            return jax.nn.relu(self.lin1(x))

    return ToyModel()


def control_flow_different(rank, world):
    """``test_ddp_control_flow_different_across_ranks``: lin2 is used on odd iterations
    by rank 1 only. torch checks its reducer's used-map ([world, 0] / [world, 1]); here
    the gradients show it: lin2's is zero on even iterations and rank 1's local gradient
    over the world size on odd ones. Without ``find_unused_parameters`` the first step
    raises on every rank."""
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    model = _control_flow_model(rank)
    ddp = DDP(model, find_unused_parameters=True)
    rand = np.random.RandomState(rank).randn(BATCH, DIM).astype(np.float32)
    ones = np.ones((BATCH, DIM), np.float32)
    losses = {f: (lambda m, x, f=f: m(x, f).sum()) for f in (False, True)}
    iters = []
    for i in range(6):
        use = i % 2 == 1 and rank == 1
        x = ones if i % 2 else rand
        local = _grads(nnx.grad(losses[use])(model, x))
        _, g = ddp.value_and_grad(losses[use])(x)
        iters.append({"ddp": _grads(g), "local": local})
    try:
        DDP(_control_flow_model(rank)).value_and_grad(losses[False])(rand)
        err = None
    except Exception as e:  # noqa: BLE001
        err = _error(e)
    return {"iters": iters, "error": err}


def different_graph(rank, world):
    """``test_different_graph_across_ranks``: rank 0 uses lin2, rank 1 does not; ten
    steps with ``find_unused_parameters=True`` (torch compares them with
    ``static_graph=True``; jdist needs no such switch)."""
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    model = _control_flow_model(rank, seed=31415)
    ddp = DDP(model, find_unused_parameters=True)
    x = np.random.RandomState(rank).randn(BATCH, DIM).astype(np.float32)
    loss = lambda m, b: m(b, rank == 0).sum()  # noqa: E731
    local = _grads(nnx.grad(loss)(model, x))
    grads = [_grads(ddp.value_and_grad(loss)(x)[1]) for _ in range(10)]
    return {"grads": grads, "local": local}


def grads_same_with_no_sync(rank, world):
    """``test_grads_same_across_ranks_with_no_sync``: rank 0 uses nn1 then nn2, rank 1
    nn3 then nn4; the first micro-batch under ``no_sync``; the synced gradients must be
    the same on every rank, with a value for every parameter."""
    import jax.numpy as jnp
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    class SimpleConditionalModel(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.nn1, self.nn2, self.nn3, self.nn4 = (nnx.Linear(1, 1, rngs=r)
                                                      for _ in range(4))

        def __call__(self, x, state):
            if state == 0:
                return self.nn1(x) if rank == 0 else self.nn3(x)
            return self.nn2(x) if rank == 0 else self.nn4(x)

    ddp = DDP(SimpleConditionalModel(), find_unused_parameters=True)
    rng = np.random.RandomState(rank)

    def mse(m, b, state):
        return jnp.mean((m(b[0], state) - b[1]) ** 2)

    losses = [lambda m, b: mse(m, b, 0), lambda m, b: mse(m, b, 1)]
    batch = lambda: (rng.rand(1, 1).astype(np.float32),  # noqa: E731
                     rng.rand(1, 1).astype(np.float32))
    with ddp.no_sync():
        ddp.value_and_grad(losses[0])(batch())
    _, grads = ddp.value_and_grad(losses[1])(batch())
    return _grads(grads)


def sync_module_states(rank, world):
    """``test_ddp_sync_module_states`` (departure: the source is rank 0, at wrap time):
    models built differently on each rank hold rank 0's values after ``DDP(...)``."""
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    model = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(rank))
    before = np.asarray(model.kernel[...])
    DDP(model, bucket_cap_mb=1)
    return {"before": before, "after": np.asarray(model.kernel[...])}


def syncbn_diff_input_sizes_running_value(rank, world):
    """``test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value``:
    rank i feeds (2, 10**(i+1), 2) values (features last). Departure: every process runs
    one compiled step, so shapes that differ beyond the batch size raise on every rank
    naming them (compiled separately, the programs' equal-sized statistics all-reduces
    could pair up in another order and mix the wrong values)."""
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.ddp import convert_sync_batchnorm

    class OnlySBN(nnx.Module):
        def __init__(self):
            # torch's momentum=0.99 weighs the new batch: flax's momentum=0.01
            self.bn = nnx.BatchNorm(2, momentum=0.01, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.bn(x)

    ddp = DDP(convert_sync_batchnorm(OnlySBN()))
    n = 10 ** (rank + 1)
    x = np.concatenate([np.ones((2, n, 1)) * 0.1 ** (rank - 1),
                        np.ones((2, n, 1)) * 0.3 ** (rank - 1)], axis=2).astype(np.float32)
    try:
        ddp.value_and_grad(lambda m, b: m(b).mean())(x)
        return None
    except Exception as e:  # noqa: BLE001
        return _error(e)


CASES = [broadcast_buffer, init_sync_buffers_forward_sync_false, model_diff,
         verify_model_after_change, control_flow_different, different_graph,
         grads_same_with_no_sync, sync_module_states, syncbn_diff_input_sizes_running_value]


def main():
    """The shared launch: every case on 2 processes, in order."""
    from tests.ddp.mp_cases import _finish, _init

    rank, world = _init()
    out = {}
    for case in CASES:
        try:
            out[case.__name__] = case(rank, world)
        except Exception:  # noqa: BLE001 - reported by the case's test
            out[case.__name__] = {"error": traceback.format_exc()}
    _finish()
    return out
