"""The same training in torch DDP (gloo) and jdist DDP, run in real processes.

Both sides build the torch models from the same seed; the jdist side converts their
initial weights with ``jdist.testing.torch_to_nnx`` and returns its final weights
converted back (``nnx_to_torch``), so results compare as torch state dicts.
"""

from __future__ import annotations

import numpy as np

STEPS = 5
ROWS = 8  # global batch; each of the 2 processes gets 4 rows


def torch_models():
    import torch
    from torch import nn

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                        nn.Linear(32, 4))

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(1, 4, 3, padding=1)
            self.c2 = nn.Conv2d(4, 8, 3)
            self.fc = nn.Linear(8, 10)

        def forward(self, x):  # NCHW
            h = torch.relu(self.c2(torch.relu(self.c1(x))))
            return self.fc(h.mean(dim=(2, 3)))

    return mlp, CNN()


def nnx_models():
    import jax.numpy as jnp
    from flax import nnx

    r = nnx.Rngs(0)

    class MLP(nnx.Module):
        def __init__(self):
            self.l1, self.l2, self.l3 = (nnx.Linear(16, 32, rngs=r), nnx.Linear(32, 32, rngs=r),
                                         nnx.Linear(32, 4, rngs=r))

        def __call__(self, x):
            return self.l3(jnp.tanh(self.l2(jnp.tanh(self.l1(x)))))

    class CNN(nnx.Module):
        def __init__(self):
            self.c1 = nnx.Conv(1, 4, (3, 3), padding=1, rngs=r)
            self.c2 = nnx.Conv(4, 8, (3, 3), padding="VALID", rngs=r)
            self.fc = nnx.Linear(8, 10, rngs=r)

        def __call__(self, x):  # NHWC
            h = nnx.relu(self.c2(nnx.relu(self.c1(x))))
            return self.fc(h.mean(axis=(1, 2)))

    return MLP(), CNN()


def batches(seed):
    rng = np.random.RandomState(seed)
    return [dict(x=rng.randn(ROWS, 16).astype(np.float32),
                 y=rng.randn(ROWS, 4).astype(np.float32),
                 img=rng.randn(ROWS, 1, 8, 8).astype(np.float32),
                 label=rng.randint(0, 10, ROWS)) for _ in range(STEPS)]


def _mine(b, rank, world):
    k = ROWS // world
    return {key: v[rank * k:(rank + 1) * k] for key, v in b.items()}


def _numpy_state(module):
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def torch_main():
    """torch DDP, gloo, one thread: MLP + CNN training, join 5 vs 3, no_sync numbers."""
    import os

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    del os
    out = {}
    mlp, cnn = torch_models()
    data = [_mine(b, rank, world) for b in batches(1)]
    for name, model, loss_of in [
        ("mlp", mlp, lambda m, b: ((m(torch.from_numpy(b["x"])) - torch.from_numpy(b["y"]))
                                   ** 2).mean()),
        ("cnn", cnn, lambda m, b: nn.functional.cross_entropy(
            m(torch.from_numpy(b["img"])), torch.from_numpy(b["label"]))),
    ]:
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        losses = []
        for b in data:
            opt.zero_grad()
            loss = loss_of(ddp, b)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        out[name] = (losses, _numpy_state(model))
    # join: rank 0 has 5 batches, rank 1 has 3
    lin = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(lin.weight)
    ddp = DDP(lin)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    with ddp.join():
        for i in range(5 if rank == 0 else 3):
            opt.zero_grad()
            x = torch.full((1, 3), float(rank + 1) * (i + 1))
            ddp(x).sum().backward()
            opt.step()
    out["join"] = lin.weight.detach().numpy().reshape(-1).copy()
    # no_sync: rank 0 grads [1,1]+[1,1], rank 1 [2,1]+[2,1]
    vec = nn.Linear(2, 1, bias=False)
    ddp = DDP(vec)
    x = torch.tensor([[1.0, 1.0]]) if rank == 0 else torch.tensor([[2.0, 1.0]])
    with ddp.no_sync():
        ddp(x).sum().backward()
    ddp(x).sum().backward()
    out["no_sync"] = vec.weight.grad.numpy().reshape(-1).copy()
    # Release every DDP reducer (and its gloo work) before the group goes away: a
    # reducer outliving destroy_process_group() has aborted torch at exit here
    # ("terminate called without an active exception").
    del ddp, opt
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return out


def jdist_main():
    """The same in jdist DDP: 2 processes x 1 device each."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.testing import nnx_to_torch, torch_to_nnx
    from tests.ddp import mp_cases

    rank, world = mp_cases._init()
    out = {}
    t_mlp, t_cnn = torch_models()
    n_mlp, n_cnn = nnx_models()
    torch_to_nnx(t_mlp, n_mlp)
    torch_to_nnx(t_cnn, n_cnn)
    data = [_mine(b, rank, world) for b in batches(1)]

    def mse(m, b):
        return jnp.mean((m(b["x"]) - b["y"]) ** 2)

    def xent(m, b):
        logits = m(jnp.transpose(b["img"], (0, 2, 3, 1)))
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]).mean()

    for name, model, torch_model, loss in [("mlp", n_mlp, t_mlp, mse),
                                           ("cnn", n_cnn, t_cnn, xent)]:
        ddp = DDP(model)
        step = ddp.train_step(loss, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
        losses = [float(step(b)) for b in data]
        nnx_to_torch(jax.tree.map(lambda x: x, model), torch_model)
        out[name] = (losses, _numpy_state(torch_model))
    out["join"] = mp_cases.join_linear(rank, world, 5 if rank == 0 else 3)
    out["no_sync"] = mp_cases.no_sync_vec(rank)
    mp_cases._finish()
    return out
