"""PyTorch's own DDP test cases, written for jdist (same inputs, same assertions).

``test_DistributedDataParallelCPU`` (torch's ``distributed_test.py``): a DDP model fed
its rank's slice of the batch, updated by hand with its gradients (``p += p.grad``), must
track a non-parallel model trained on the whole batch. Here the replicas are the 8
local devices of this process (the embedded default: each plays one of torch's ranks);
the multi-process form runs inside the launch of ``test_multiprocess.py``. The oracle is
torch itself: the non-parallel model is torch's ``Net`` with the same weights.

Also the ``no_sync`` departure the migration guide names: inside ``no_sync`` jdist's
``value_and_grad`` returns ``(loss, None)`` (no ``.grad`` to accumulate into), and the
first synced call returns the mean of the accumulated and new gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jdist.ddp import DistributedDataParallel as DDP


class TorchNet(torch.nn.Module):
    """torch's test ``Net``: three bias-free Linears, ReLU, softmax."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(2, 10, bias=False)
        self.fc2 = torch.nn.Linear(10, 50, bias=False)
        self.fc3 = torch.nn.Linear(50, 4, bias=False)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return torch.softmax(self.fc3(x), dim=1)


class Net(nnx.Module):
    def __init__(self, tnet: TorchNet):
        def lin(t):
            w = t.weight.detach().numpy().T.copy()
            layer = nnx.Linear(w.shape[0], w.shape[1], use_bias=False, rngs=nnx.Rngs(0))
            # committed to one device, as torch's model.to(device)
            layer.kernel[...] = jax.device_put(w, jax.local_devices()[0])
            return layer

        self.fc1, self.fc2, self.fc3 = lin(tnet.fc1), lin(tnet.fc2), lin(tnet.fc3)

    def __call__(self, x):
        x = jax.nn.relu(self.fc1(x))
        x = jax.nn.relu(self.fc2(x))
        return jax.nn.softmax(self.fc3(x), axis=1)


def _mse(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def ddp_cpu_case(rank: int, world: int, local_replicas: int, n_iter: int = 5) -> dict:
    """torch's ``_test_DDP_niter`` for ``test_DistributedDataParallelCPU``: returns the
    largest parameter difference to torch's non-parallel model after each iteration."""
    torch.manual_seed(0)
    base = TorchNet()
    model = Net(base)
    ddp = DDP(model)
    vg = ddp.value_and_grad(_mse)
    local_bs = 2 * local_replicas  # torch: local_bs = 2 per rank; here 2 per replica
    global_bs = local_bs * world
    inp, target = torch.randn(global_bs, 2), torch.randn(global_bs, 4)
    diffs = []
    for _ in range(n_iter):
        # non-parallel model, whole batch, p += p.grad
        base.zero_grad()
        torch.nn.functional.mse_loss(base(inp), target).backward()
        with torch.no_grad():
            for p in base.parameters():
                p += p.grad
        # DDP: this rank's slice, p + g with DDP's returned gradients
        rows = slice(rank * local_bs, (rank + 1) * local_bs)
        _, grads = vg((inp[rows].numpy(), target[rows].numpy()))
        for name in ("fc1", "fc2", "fc3"):
            layer = getattr(model, name)
            layer.kernel[...] = layer.kernel[...] + grads[name]["kernel"][...]
        diffs.append(max(
            float(np.max(np.abs(getattr(base, n).weight.detach().numpy().T
                                - np.asarray(getattr(model, n).kernel[...]))))
            for n in ("fc1", "fc2", "fc3")))
        # shuffle, as torch's test does, so that each replica sees other rows next time
        perm = torch.randperm(global_bs)
        inp, target = inp[perm], target[perm]
    return {"diffs": diffs}


def test_DistributedDataParallelCPU():
    out = ddp_cpu_case(rank=0, world=1, local_replicas=len(jax.devices()))
    assert len(out["diffs"]) == 5
    assert max(out["diffs"]) < 1e-5, out  # torch's assertEqual tolerance for float32


def test_grads_land_beside_single_device_params():
    """The gradients of a module whose parameters sit on one device are on that device
    (torch: ``p.grad`` lives beside ``p``); after a train step they stay replicated."""
    torch.manual_seed(0)
    model = Net(TorchNet())
    ddp = DDP(model)
    x = np.ones((16, 2), np.float32), np.zeros((16, 4), np.float32)
    _, grads = ddp.value_and_grad(_mse)(x)
    p, g = model.fc1.kernel[...], grads["fc1"]["kernel"][...]
    assert g.sharding.device_set == p.sharding.device_set and len(g.devices()) == 1
    np.testing.assert_allclose(np.asarray(p + g), np.asarray(p) + np.asarray(g))


def test_no_sync_value_and_grad_returns_none_then_the_mean():
    """The departure in docs/migration.md: ``(loss, None)`` inside ``no_sync``."""

    class Vec(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    ddp = DDP(Vec())
    n = ddp.process_group.num_replicas
    f = ddp.value_and_grad(lambda m, x: jnp.sum(m.w[...] * x))
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    with ddp.no_sync():
        loss, grads = f(x)
    assert grads is None and np.isfinite(float(loss))
    _, grads = f(x)
    # accumulated (x) + new (x), averaged over the replicas: 2 * mean of the rows
    np.testing.assert_allclose(np.asarray(grads["w"][...]), 2 * x.mean(axis=0), rtol=1e-6)
