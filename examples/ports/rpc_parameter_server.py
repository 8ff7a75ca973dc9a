"""pytorch/examples ``distributed/rpc/parameter_server/rpc_parameter_server.py`` in jdist.

One parameter server holds the model (the MNIST ``Net``: two convolutions, dropout, two
linear layers, log-softmax); each trainer runs its forward pass on the server by RPC
inside a distributed autograd context and updates it with a ``DistributedOptimizer``::

    jdist-run --nproc-per-node 4 examples/ports/rpc_parameter_server.py [--smoke]

Rank 0 is the server (it only calls ``rpc.shutdown()``, which waits for the trainers);
ranks 1.. are trainers. The data is scikit-learn's 8x8 digits (no download), so the
first linear layer has 64 * 2 * 2 inputs instead of 9216. The lines a torch user
changes: the ``Net`` in NNX (channels-last convolutions, ``nnx.Dropout`` with
``broadcast_dims`` for ``Dropout2d``), run as one ``nnx.jit`` program on the server
(``run_model``; the RPC stays outside the jit), and so is the trainer's
``F.nll_loss`` (``nll``); ``dist_autograd.backward(cid, loss_fn, ...)``
runs the forward pass itself; ``optax.sgd`` with ``learning_rate=``; the parameter
RRefs come from ``nnx.variables`` (an NNX module has no ``parameters()``);
``ParameterServer`` is an ``nnx.Module`` as torch's is an ``nn.Module`` (a plain class
holding the model would work too: distributed autograd finds the modules inside it);
``call_method`` is marked ``@dist_autograd.pure``, so the server records the forward
pass as one compiled forward+VJP program instead of tracing it eagerly every step, and
so is ``nll_loss``, so the trainer runs the loss, its backward pass and the RPCs (as
host callbacks) as one compiled program from the second step on.
"""

from __future__ import annotations

import argparse
import os
import time
from threading import Lock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import load_init, save
from _data import digits, shuffled_batches
from flax import nnx

from jdist import rpc
from jdist.rpc import DistributedOptimizer, dist_autograd
from jdist.testing import state_dict_to_nnx


# --------- MNIST Network to train (8x8 digits here) -----
class Net(nnx.Module):
    def __init__(self, dropout=(0.25, 0.5), seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.conv1 = nnx.Conv(1, 32, (3, 3), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), padding="VALID", rngs=rngs)
        self.dropout1 = nnx.Dropout(dropout[0], broadcast_dims=(1, 2), rngs=rngs)  # 2d
        self.dropout2 = nnx.Dropout(dropout[1], rngs=rngs)
        self.fc1 = nnx.Linear(64 * 2 * 2, 128, rngs=rngs)
        self.fc2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = jnp.transpose(jnp.asarray(x), (0, 2, 3, 1))  # torch's NCHW -> NHWC
        x = nnx.relu(self.conv1(x))
        x = nnx.max_pool(self.conv2(x), (2, 2), strides=(2, 2))
        x = self.dropout1(x)
        x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)  # flatten as torch
        x = self.dropout2(nnx.relu(self.fc1(x)))
        return jax.nn.log_softmax(self.fc2(x), axis=1)


@nnx.jit
def run_model(model, x):
    """The model as one compiled program (jit the local part; the RPC stays outside)."""
    return model(x)


# --------- Helper Methods --------------------
@dist_autograd.pure  # under dist autograd: one compiled forward+VJP program on the server
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- Parameter Server --------------------
class ParameterServer(nnx.Module):
    def __init__(self, dropout, init=None):
        self.model = Net(dropout)
        if init is not None:
            state_dict_to_nnx(init, self.model)

    def forward(self, inp):
        return run_model(self.model, inp)

    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        cpu_grads = {}
        for k, v in grads.items():  # k: a ParamKey (hashable, like torch's tensor keys)
            cpu_grads[k] = np.asarray(v)
        return cpu_grads

    def get_param_rrefs(self):
        params = nnx.variables(self.model, nnx.Param)
        return [rpc.RRef(p) for p in jax.tree.leaves(
            params, is_leaf=lambda v: isinstance(v, nnx.Variable))]

    def get_weights(self):
        return {k: np.asarray(v) for k, v in nnx.state(self.model, nnx.Param).flat_state()}


param_server = None
global_lock = Lock()


def get_parameter_server(dropout, init=None):
    global param_server
    with global_lock:  # only one ParameterServer, whichever trainer asks first
        if not param_server:
            param_server = ParameterServer(dropout, init)
        return param_server


def run_parameter_server(rank, world_size):
    print("PS master initializing RPC")
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
    print("RPC initialized! Running parameter server...")
    rpc.shutdown()
    print("RPC shutdown on parameter server.")


# --------- Trainers --------------------
class TrainerNet:
    def __init__(self, dropout, init=None):
        self.param_server_rref = rpc.remote(
            "parameter_server", get_parameter_server, args=(dropout, init))

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def __call__(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


@jax.jit
def nll(model_output, target):
    """``F.nll_loss`` as one compiled program (the local part of the loss function)."""
    return -jnp.mean(jnp.take_along_axis(model_output, target[:, None], 1))


@dist_autograd.pure  # dist_autograd.backward runs it as one compiled program
def nll_loss(net, data, target):
    """The forward pass and ``F.nll_loss`` (dist_autograd.backward runs it)."""
    model_output = net(data)
    return nll(model_output, target)


def run_training_loop(rank, args):
    net = TrainerNet(args.dropout, load_init(args.init))
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optax.sgd, param_rrefs, learning_rate=0.03)
    x, y, x_test, y_test = digits()
    losses, times = [], []
    for i, idx in enumerate(shuffled_batches(len(x), 32, rank, args.steps)):
        data, target = x[idx], y[idx]
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            loss = dist_autograd.backward(cid, nll_loss, net, data, target)
            if i % 5 == 0:
                print(f"Rank {rank} training batch {i} loss {float(loss)}", flush=True)
            assert remote_method(ParameterServer.get_dist_gradients,
                                 net.param_server_rref, cid) != {}
            opt.step(cid)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    print("Training complete!")
    print("Getting accuracy....")
    accuracy = get_accuracy(x_test, y_test, net)
    weights = remote_method(ParameterServer.get_weights, net.param_server_rref)
    return {"losses": losses, "times": times, "accuracy": accuracy, "params": weights}


def get_accuracy(x_test, y_test, model):
    correct_sum = 0
    for i in range(0, len(x_test), 32):
        out = np.asarray(model(x_test[i:i + 32]))
        correct_sum += int((out.argmax(axis=1) == y_test[i:i + 32]).sum())
    print(f"Accuracy {correct_sum / len(x_test)}")
    return correct_sum / len(x_test)


def run_worker(rank, world_size, args):
    print(f"Worker rank {rank} initializing RPC")
    rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size)
    print(f"Worker {rank} done initializing RPC")
    result = run_training_loop(rank, args)
    rpc.shutdown()
    return result


def main():
    p = argparse.ArgumentParser(description="Parameter-Server RPC based training")
    p.add_argument("--steps", type=int, default=None, help="batches per trainer (all)")
    p.add_argument("--no-dropout", dest="dropout", action="store_const", const=(0.0, 0.0),
                   default=(0.25, 0.5), help="dropout rates 0 (deterministic, for tests)")
    p.add_argument("--smoke", action="store_true", help="6 batches")
    p.add_argument("--init", help="initial weights: a torch state dict as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args()
    if args.smoke:
        args.steps = 6
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size < 2:
        raise SystemExit(f"rpc_parameter_server needs a server and at least one trainer, got "
                         f"WORLD_SIZE={world_size}; run with jdist-run --nproc-per-node 2 or more")
    if rank == 0:
        run_parameter_server(0, world_size)
    else:
        save(args.out, rank, run_worker(rank, world_size, args))


if __name__ == "__main__":
    main()
