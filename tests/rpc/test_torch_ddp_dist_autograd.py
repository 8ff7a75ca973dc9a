"""torch's ``ddp_under_dist_autograd_test.py`` on jdist: DDP inside a distributed
autograd pass (the HybridModel chapter) and DDP gradients under dist autograd vs local.

One launch of 4 real processes runs every case (each named after the torch test it
translates). torch's DdpUnderDistAutogradTest has 4 trainers, a remote worker and a
master (6 processes); here ranks 0-1 are the trainers, 2 the remote worker, 3 the
master: torch's training examples split over 2 trainers cancel in DDP's all-reduce in
the same way. DdpComparisonTest runs on ranks 0-1 as torch's 4 trainers. A DDP
module inside a pass is :func:`jdist.rpc.dist_autograd.ddp_stage` (its loss as the
pass's last stage); ``nn.Linear`` / ``nn.EmbeddingBag`` are NNX modules.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdist
from jdist import rpc
from jdist.algorithms.join import Join
from jdist.ddp import DistributedDataParallel
from jdist.rpc import RemoteModule, dist_autograd
from tests.helpers import run_procs

WS = 4
NUM_EM_ROW, D_SPARSE, D_DENSE, D_HID, D_OUT = 2, 3, 2, 3, 1
NUM_TRAINERS = 2
TRAINER_RANKS = list(range(NUM_TRAINERS))
REMOTE_WORKER_RANK = NUM_TRAINERS
MASTER_RANK = NUM_TRAINERS + 1
GROUPS: dict = {}


def worker_name(r: int) -> str:
    return f"worker{r}"


class Raises:
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


# ------------------------------------------------------------ the models
class FeatureSet(NamedTuple):
    dense_features: np.ndarray
    sparse_features: np.ndarray
    values: np.ndarray


class Linear(nnx.Module):
    """torch's ``nn.Linear`` (weight ``(d_out, d_in)``); ``weight`` given or seeded."""

    def __init__(self, d_in, d_out, bias=True, seed=0, weight=None):
        rs = np.random.RandomState(seed)
        bound = 1.0 / np.sqrt(d_in)
        if weight is None:
            weight = rs.uniform(-bound, bound, (d_out, d_in))
        self.weight = nnx.Param(jnp.asarray(weight, jnp.float32))
        self.bias = nnx.Param(jnp.asarray(rs.uniform(-bound, bound, d_out), jnp.float32)) \
            if bias else None

    def __call__(self, x):
        y = x @ self.weight[...].T
        return y if self.bias is None else y + self.bias[...]


def get_linear(d_in, d_out):
    """torch's getLinear: no bias, ones with ``w[0][0] = -1``."""
    w = np.ones((d_out, d_in), np.float32)
    w[0][0] = -1
    return Linear(d_in, d_out, bias=False, weight=w)


class RemoteEM(nnx.Module):
    """torch's RemoteEM: an EmbeddingBag of 0.5s, one index per bag."""

    def __init__(self, num_embeddings, embedding_dim):
        self.weight = nnx.Param(jnp.full((num_embeddings, embedding_dim), 0.5, jnp.float32))

    def forward(self, input):
        return self.weight[...][jnp.asarray(input)]


class RemoteNet(nnx.Module):
    def __init__(self, d_in, d_out):
        self.fc = get_linear(d_in, d_out)

    def forward(self, input):
        return jax.nn.relu(self.fc(input))


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args), kwargs=kwargs)


def _remote_method_async(method, rref, *args, **kwargs):
    return rpc.rpc_async(rref.owner(), _call_method, args=(method, rref, *args),
                         kwargs=kwargs)


def fc2_loss(module, x, values):
    return jnp.sum(module(x) * values)


class Trainer:
    """torch's Trainer. Modes: "none" (no DDP), "inside" (fc2 is a DDP stage),
    "outside" (the whole local model under DDP: fc1 a DDP layer, fc2 a DDP stage)."""

    def __init__(self, remote_em_rref, remote_net_rref, ddp_mode, rank):
        self.rank, self.ddp_mode = rank, ddp_mode
        self.remote_em_rref, self.remote_net_rref = remote_em_rref, remote_net_rref
        self.fc1, self.fc2 = get_linear(D_DENSE, D_DENSE), get_linear(D_HID, D_OUT)
        self.stage = None
        self.ddps, self.layer = [], None
        if ddp_mode in ("inside", "outside"):
            ddp = DistributedDataParallel(self.fc2, process_group=GROUPS["trainers"])
            self.fc2 = ddp.module
            self.stage = dist_autograd.ddp_stage(ddp, fc2_loss)
            self.ddp_params, self.non_ddp_params = [self.fc2.weight], [self.fc1.weight]
            self.ddps.append(ddp)  # its DDP step comes first in a pass (the loss)
        if ddp_mode == "outside":
            ddp = DistributedDataParallel(self.fc1, process_group=GROUPS["trainers"])
            self.fc1 = ddp.module
            self.layer = dist_autograd.ddp_layer(ddp)
            self.ddp_params, self.non_ddp_params = [self.fc2.weight, self.fc1.weight], []
            self.ddps.append(ddp)  # its DDP step: in the backward pass
        if ddp_mode == "none":
            self.ddp_params, self.non_ddp_params = [], [self.fc1.weight, self.fc2.weight]

    def forward_loss(self, fc1, fc2, b, values):
        sparse = _remote_method(RemoteEM.forward, self.remote_em_rref, b.sparse_features)
        assert sparse.shape[0] == b.dense_features.shape[0]
        dense = fc1(b.dense_features) if self.layer is None else \
            self.layer(b.dense_features)
        x = jnp.concatenate((dense, sparse), 1)
        x = _remote_method(RemoteNet.forward, self.remote_net_rref, x)
        # torch's (output * mini_batch.values): output (b, 1) times all n values; the
        # values as (b, n) rows (the same sum) give DDP a batch of b rows
        values = np.broadcast_to(values, (x.shape[0], values.shape[0]))
        if self.stage is not None:
            return self.stage(x, values)
        return fc2_loss(fc2, x, values)

    def train_batch(self, mini_batch, trainer_has_less_inputs, simulate_uneven_inputs):
        grads_dict = None
        batches = [mini_batch]
        if simulate_uneven_inputs:
            batches = [FeatureSet(*(a[i:i + 2] for a in mini_batch))
                       for i in range(0, len(mini_batch.values), 2)]
            if trainer_has_less_inputs:
                batches = batches[:len(batches) // 2]
        with Join(self.ddps) if simulate_uneven_inputs else contextlib.nullcontext():
            for b in batches:
                with dist_autograd.context() as context_id:
                    fc1 = self.fc1 if self.layer is None else None
                    fc2 = self.fc2 if self.stage is None else None
                    dist_autograd.backward(context_id, self.forward_loss, fc1, fc2, b,
                                           mini_batch.values)
                    grads_dict = dist_autograd.get_gradients(context_id)
                    out = ([np.asarray(grads_dict[p]) for p in self.ddp_params],
                           [np.asarray(grads_dict[p]) for p in self.non_ddp_params])
        return out


def get_training_examples():
    n = 16
    dense, sparse, values = np.zeros((n, D_DENSE), np.float32), np.zeros(n, np.int32), \
        np.zeros(n, np.float32)
    idx = 0
    # every example has a twin with the same features and the opposite value: their
    # gradients cancel in DDP's all-reduce
    for value in (-1, 1):
        for x in (-1.0 * value, 1.0 * value):
            for y in (1.0 * value, -1.0 * value):
                for z in (0, 1):
                    dense[idx, :] = (x, y)
                    sparse[idx], values[idx] = z, value
                    idx += 1
    per = n // NUM_TRAINERS
    return [FeatureSet(dense[s:s + per], sparse[s:s + per], values[s:s + per])
            for s in range(0, n, per)]


def _do_test_on_master(ddp_mode, simulate_uneven_inputs=False):
    remote = worker_name(REMOTE_WORKER_RANK)
    em = rpc.remote(remote, RemoteEM, args=(NUM_EM_ROW, D_SPARSE))
    net = rpc.remote(remote, RemoteNet, args=(D_DENSE + D_SPARSE, D_HID))
    trainers = [rpc.remote(worker_name(r), Trainer, args=(em, net, ddp_mode, r))
                for r in TRAINER_RANKS]
    examples = get_training_examples()
    for _ in range(3):
        futures = [_remote_method_async(Trainer.train_batch, t, examples[i],
                                        simulate_uneven_inputs and i < len(trainers) // 2,
                                        simulate_uneven_inputs)
                   for i, t in enumerate(trainers)]
        for f in futures:
            ddp_grads, non_ddp_grads = f.wait()
            if not simulate_uneven_inputs:
                for g in ddp_grads:
                    np.testing.assert_array_equal(
                        g, np.zeros_like(g), err_msg="The grad for any ddp parameter should "
                        "be zeros, because the training examples' grads cancel each other.")
            for g in non_ddp_grads:
                assert np.any(g != 0), "The grad for any non-ddp parameter shouldn't be zeros"


class HybridCases:
    """DdpUnderDistAutogradTest: the master drives; the others serve RPCs."""

    @staticmethod
    def test_backward_no_ddp(env):
        if env.rank == MASTER_RANK:
            _do_test_on_master("none")

    @staticmethod
    def test_backward_ddp_outside(env):
        if env.rank == MASTER_RANK:
            _do_test_on_master("outside")

    @staticmethod
    def test_backward_ddp_outside_uneven_inputs(env):
        if env.rank == MASTER_RANK:
            _do_test_on_master("outside", simulate_uneven_inputs=True)

    @staticmethod
    def test_backward_ddp_inside(env):
        if env.rank == MASTER_RANK:
            _do_test_on_master("inside")


# ------------------------------------------------------------ DdpComparisonTest
def norm_loss(module, x):
    return jnp.linalg.norm(module(x))


def sum_loss(module, x):
    return jnp.sum(module(x))


class EmbeddingBag(nnx.Module):
    """torch's ``nn.EmbeddingBag(num, dim)`` (mode "mean"), bags given per index."""

    def __init__(self, num, dim, seed=0):
        self.weight = nnx.Param(jnp.asarray(np.random.RandomState(seed).randn(num, dim),
                                            jnp.float32))

    def __call__(self, indices, bags, num_bags=2):
        rows = self.weight[...][indices]
        sums = jax.ops.segment_sum(rows, bags, num_segments=num_bags)
        counts = jax.ops.segment_sum(jnp.ones(indices.shape[0]), bags, num_segments=num_bags)
        return sums / counts[:, None]


def bag_loss(module, indices, bags):
    return jnp.sum(module(indices, bags))


def bag_loss_batch(module, batch):
    return bag_loss(module, *batch)


def get_remote_grads(rref, context_id):
    return np.asarray(dist_autograd.get_gradients(context_id)[rref.local_value().weight])


def _arr(v):
    return np.asarray(v[...] if isinstance(v, nnx.Variable) else v)


def _close(a, b, msg=""):
    np.testing.assert_allclose(_arr(a), _arr(b), rtol=1e-5, atol=1e-6,
                               err_msg=msg)


def _params(m):
    return [m.weight] + ([] if m.bias is None else [m.bias])


def _run_test_ddp_comparison(env, simulate_uneven_inputs=False):
    rs = np.random.RandomState(env.rank)  # each trainer its own seed (torch.manual_seed)
    net = Linear(2, 3, seed=env.rank)
    ddp_net = DistributedDataParallel(net, process_group=GROUPS["trainers"])
    stage = dist_autograd.ddp_stage(ddp_net, norm_loss)
    local = ddp_net.value_and_grad(norm_loss)
    num_inputs = 1 + (2 if simulate_uneven_inputs and env.rank % 2 == 0 else 0)
    inputs_list = [rs.rand(3, 2).astype(np.float32) for _ in range(num_inputs)]
    with ddp_net.join(simulate_uneven_inputs):
        for i, inputs in enumerate(inputs_list):
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, stage, inputs)
                grads_dict = dist_autograd.get_gradients(context_id)
            _, grads = local(inputs)
            for param, g in zip(_params(ddp_net.module), (grads["weight"], grads["bias"]),
                                strict=True):
                assert param in grads_dict, f"Param is not in dist_auto grad dict, it {i}"
                _close(grads_dict[param], g, f"grads under local and dist autograd, it {i}")


def _trainers_only(fn):
    def run(env):
        if env.rank in TRAINER_RANKS:
            fn(env)

    run.__name__ = fn.__name__
    return staticmethod(run)


class ComparisonCases:
    """DdpComparisonTest: torch's 4 trainers are ranks 0-1 here."""

    @_trainers_only
    def test_ddp_comparison(env):
        _run_test_ddp_comparison(env)

    @_trainers_only
    def test_ddp_comparison_uneven_inputs(env):
        _run_test_ddp_comparison(env, simulate_uneven_inputs=True)

    @_trainers_only
    def test_ddp_dist_autograd_sparse_grads(env):
        # torch: EmbeddingBag(10, 3, sparse=True) (mean of 2 bags, offsets [0, 4]); JAX's
        # gradient of the table is dense: the same values, zeros where no index points
        rs = np.random.RandomState(env.rank)
        model = EmbeddingBag(10, 3, seed=env.rank)
        ddp_model = DistributedDataParallel(model, process_group=GROUPS["trainers"])
        indices = rs.randint(0, 10, size=10).astype(np.int32)
        bags = np.searchsorted(np.array([0, 4])[1:], np.arange(10), side="right")
        _, local = ddp_model.value_and_grad(bag_loss_batch)((indices, bags))
        stage = dist_autograd.ddp_stage(ddp_model, bag_loss)
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, stage, indices, bags)
            grads_dict = dist_autograd.get_gradients(context_id)
            assert len(grads_dict) == 1
            _close(local["weight"], grads_dict[ddp_model.module.weight])

    @_trainers_only
    def test_ddp_dist_autograd_local_vs_remote(env):
        rs = np.random.RandomState(env.rank)
        for remote_device in ("worker0/cpu", "worker0"):
            _local_vs_remote(env, rs, remote_device)


def _local_vs_remote(env, rs, remote_device):
    remote_layer1 = RemoteModule(remote_device, Linear, (10, 5, False, env.rank))
    layer1 = remote_layer1.module_rref.to_here()  # the same parameters
    layer2 = Linear(5, 1, seed=100 + env.rank)
    inputs = rs.rand(10, 10).astype(np.float32)
    ddp_model = DistributedDataParallel(layer2, process_group=GROUPS["trainers"])
    # local case: DDP's averaged layer2 gradient; layer1's through this replica
    _, g2 = ddp_model.value_and_grad(sum_loss)(np.asarray(layer1(inputs)))
    g1 = nnx.grad(lambda l1: sum_loss(ddp_model.module, l1(inputs)))(layer1)
    stage = dist_autograd.ddp_stage(ddp_model, sum_loss)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, lambda: stage(remote_layer1(inputs)))
        grads_dict = dist_autograd.get_gradients(context_id)
        jdist.barrier(group=GROUPS["trainers"])
        _close(g2["weight"], grads_dict[ddp_model.module.weight])
        _close(g1["weight"], rpc.rpc_sync("worker0", get_remote_grads,
                                          args=(remote_layer1.module_rref, context_id)))


class CudaComparisonCases:
    """CudaDdpComparisonTest, on CPU devices: remote, DDP, remote, DDP layers."""

    @_trainers_only
    def test_ddp_dist_autograd_local_vs_remote_gpu(env):
        rs = np.random.RandomState(env.rank)
        remote_layer1 = RemoteModule("worker0/cpu", Linear, (10, 7, False, env.rank))
        layer1 = remote_layer1.module_rref.to_here()
        ddp_layer2 = DistributedDataParallel(Linear(7, 5, seed=100 + env.rank),
                                            process_group=GROUPS["trainers"])
        remote_layer3 = RemoteModule("worker0/cpu", Linear, (5, 3, False, 200 + env.rank))
        layer3 = remote_layer3.module_rref.to_here()
        ddp_layer4 = DistributedDataParallel(Linear(3, 1, seed=300 + env.rank),
                                            process_group=GROUPS["trainers"])
        inputs = rs.rand(10, 10).astype(np.float32)
        # local case: torch's loss.backward() through the DDP layers: every layer's local
        # gradient, DDP's layers' averaged over the ranks
        l2, l4 = ddp_layer2.module, ddp_layer4.module

        def chain(l1, l2, l3, l4):
            return jnp.sum(l4(l3(l2(l1(inputs)))))

        g1, g2, g3, g4 = nnx.grad(chain, argnums=(0, 1, 2, 3))(layer1, l2, layer3, l4)
        avg2, avg4 = (np.asarray(jdist.all_reduce(_arr(g["weight"]), op=jdist.ReduceOp.AVG,
                                                     group=GROUPS["trainers"]))
                      for g in (g2, g4))
        layer2 = dist_autograd.ddp_layer(ddp_layer2)
        stage4 = dist_autograd.ddp_stage(ddp_layer4, sum_loss)
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, lambda: stage4(
                remote_layer3(layer2(remote_layer1(inputs)))))
            grads_dict = dist_autograd.get_gradients(context_id)
            jdist.barrier(group=GROUPS["trainers"])
            for rl, g in ((remote_layer1, g1), (remote_layer3, g3)):
                _close(g["weight"], rpc.rpc_sync("worker0", get_remote_grads,
                                                 args=(rl.module_rref, context_id)))
            _close(grads_dict[l2.weight], avg2)
            _close(grads_dict[l4.weight], avg4)

CASES = [getattr(c, n) for c in (HybridCases, ComparisonCases, CudaComparisonCases)
         for n in vars(c)
         if n.startswith("test_")]


def run() -> dict:
    rank = int(os.environ["RANK"])
    jdist.init_process_group()
    GROUPS["trainers"] = jdist.new_group(TRAINER_RANKS)  # every process calls it
    env = type("Env", (), {"rank": rank})()
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=WS,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=120))
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
            jdist.barrier()  # the next case starts together (the master's cases)
    finally:
        rpc.shutdown()
        jdist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def results():
    return run_procs(run, WS, timeout=400)


@pytest.mark.parametrize("name", [f.__name__ for f in CASES])
def test_case(results, name):
    for rank, res in enumerate(results):
        assert res.get(name) == "ok", f"rank {rank}: {res.get(name)}"
