"""One generated DDP training run, in torch DDP (gloo) or jdist DDP, on a pool's ranks.

A ``spec`` (JSON) describes a small model (front end: dense, conv or embedding; hidden
Linear layers; LayerNorm or BatchNorm; a layer applied twice; a layer never used; a side
branch on a stopped gradient), the loss, the optimizer, DDP's options (bucket cap,
broadcast_buffers, find_unused_parameters, gradient_as_bucket_view, a comm hook),
gradient accumulation under ``no_sync`` and the layout (jdist: processes x devices;
torch: that many processes).
Both sides build the torch model from the spec's seed; jdist converts its weights with
``jdist.testing.torch_to_nnx`` and returns its final state converted back, so results
compare as torch state dicts. Each rank returns its synced steps' losses (torch: local;
jdist: the replicas' mean) and its model's final state.
"""

from __future__ import annotations

import numpy as np

IN, OUT, CLASSES, VOCAB, IMG = 5, 3, 4, 11, 5
# Adam divides by |g| + eps: with torch's 1e-8, a gradient that is zero in exact
# arithmetic (a bias before BatchNorm) but 1e-6 of rounding noise in one framework moves
# its parameter by a whole learning rate. 1e-2 keeps the comparison about DDP, not noise
ADAM_EPS = 1e-2


def torch_model(spec):
    import torch
    from torch import nn

    torch.manual_seed(spec["seed"])
    act = torch.tanh if spec["act"] == "tanh" else torch.relu

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            widths, width = spec["widths"], IN
            if spec["frontend"] == "conv":
                self.front = nn.Conv2d(2, 4, 3, padding=1)
                width = 4
            elif spec["frontend"] == "embed":
                self.front = nn.Embedding(VOCAB, 4)
                width = 4
            self.hidden = nn.ModuleList()
            for w in widths:
                self.hidden.append(nn.Linear(width, w))
                width = w
            if spec["norm"] == "layernorm":
                self.norm = nn.LayerNorm(widths[0])
            elif spec["norm"] == "batchnorm":
                self.norm = nn.BatchNorm1d(widths[0])
            if spec["shared"]:
                self.twice = nn.Linear(width, width)
            if spec["unused"]:
                self.unused = nn.Linear(width, 2)
            out = CLASSES if spec["loss"] == "xent" else OUT
            self.head = nn.Linear(width, out)
            if spec["stop_grad"]:
                self.side = nn.Linear(width, out, bias=False)

        def forward(self, x):
            if spec["frontend"] == "conv":
                x = torch.relu(self.front(x)).mean(dim=(2, 3))
            elif spec["frontend"] == "embed":
                x = self.front(x).mean(dim=1)
            for i, lin in enumerate(self.hidden):
                x = act(lin(x))
                if i == 0 and spec["norm"]:
                    x = self.norm(x)
            if spec["shared"]:
                x = act(self.twice(act(self.twice(x))))
            y = self.head(x)
            if spec["stop_grad"]:
                y = y + self.side(x.detach())
            return y

    return Net()


def nnx_model(spec):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jdist.testing import TorchBatchNorm

    r = nnx.Rngs(0)
    act = jnp.tanh if spec["act"] == "tanh" else jax.nn.relu

    class Net(nnx.Module):
        def __init__(self):
            widths, width = spec["widths"], IN
            if spec["frontend"] == "conv":
                self.front = nnx.Conv(2, 4, (3, 3), padding=1, rngs=r)
                width = 4
            elif spec["frontend"] == "embed":
                self.front = nnx.Embed(VOCAB, 4, rngs=r)
                width = 4
            self.hidden = nnx.List()
            for w in widths:
                self.hidden.append(nnx.Linear(width, w, rngs=r))
                width = w
            if spec["norm"] == "layernorm":
                self.norm = nnx.LayerNorm(widths[0], epsilon=1e-5, rngs=r)
            elif spec["norm"] == "batchnorm":
                # torch's running variance (unbiased); nnx.BatchNorm folds the biased one
                self.norm = TorchBatchNorm(widths[0], momentum=0.9, epsilon=1e-5, rngs=r)
            if spec["shared"]:
                self.twice = nnx.Linear(width, width, rngs=r)
            if spec["unused"]:
                self.unused = nnx.Linear(width, 2, rngs=r)
            out = CLASSES if spec["loss"] == "xent" else OUT
            self.head = nnx.Linear(width, out, rngs=r)
            if spec["stop_grad"]:
                self.side = nnx.Linear(width, out, use_bias=False, rngs=r)

        def __call__(self, x):
            if spec["frontend"] == "conv":
                x = jax.nn.relu(self.front(x)).mean(axis=(1, 2))
            elif spec["frontend"] == "embed":
                x = self.front(x).mean(axis=1)
            for i, lin in enumerate(self.hidden):
                x = act(lin(x))
                if i == 0 and spec["norm"]:
                    x = self.norm(x)
            if spec["shared"]:
                x = act(self.twice(act(self.twice(x))))
            y = self.head(x)
            if spec["stop_grad"]:
                y = y + self.side(jax.lax.stop_gradient(x))
            return y

    return Net()


def world(spec) -> int:
    procs, devs = spec["layout"]
    return procs * devs


def batches(spec):
    """Every micro-batch of the run, global (all replicas' rows), torch's layouts."""
    rng = np.random.default_rng(spec["seed"])
    rows = spec["rows"] * world(spec)
    out = []
    for _ in range(spec["steps"] * spec["accumulate"]):
        if spec["frontend"] == "conv":
            x = rng.standard_normal((rows, 2, IMG, IMG)).astype(np.float32)
        elif spec["frontend"] == "embed":
            x = rng.integers(0, VOCAB, (rows, 3))
        else:
            x = rng.standard_normal((rows, IN)).astype(np.float32)
        y = rng.integers(0, CLASSES, rows) if spec["loss"] == "xent" else \
            rng.standard_normal((rows, OUT)).astype(np.float32)
        out.append((x, y))
    return out


def _rows(b, lo, hi):
    return tuple(a[lo:hi] for a in b)


def _state(module):
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def _torch_bf16_hook(process_group, bucket):
    """torch's ``bf16_compress_hook`` without its NCCL-only guard (gloo reduces bf16)."""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


PSGD_START = 2  # torch's smallest start_powerSGD_iter with error feedback / warm start
# torch's Gram-Schmidt divides a zero column (a dead ReLU's gradient) by its zero norm
# and fills the bucket with NaNs when epsilon is 0 (jdist keeps it zero, on purpose):
# compared with torch's own remedy
PSGD_EPS = 1e-8


def _torch_powersgd(spec, model):
    """torch's PowerSGD hook, wrapped to report the Q factors it draws first (per
    parameter name, torch's ``(m, r)``): the same draws, replayed on a copy of the
    state's generator just before the hook makes them."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    state = P.PowerSGDState(process_group=None,
                            matrix_approximation_rank=spec["psgd_rank"],
                            start_powerSGD_iter=PSGD_START,
                            use_error_feedback=spec["psgd_ef"], warm_start=True,
                            min_compression_rate=spec["psgd_min_rate"],
                            orthogonalization_epsilon=PSGD_EPS, random_seed=spec["seed"])
    names = {id(p): n for n, p in model.named_parameters()}
    drawn: dict = {}

    def hook(st, bucket):
        if st.iter >= st.start_powerSGD_iter and bucket.index() not in st.p_memory_dict:
            by_shape: dict = {}  # torch draws them grouped by matrix shape
            for g, p in zip(bucket.gradients(), bucket.parameters(), strict=True):
                n, m = g.view(g.shape[0], -1).shape
                r = min(n, m, st.matrix_approximation_rank)
                if P._should_compress(n, m, r, st.min_compression_rate)[0]:
                    by_shape.setdefault((n, m), []).append((names[id(p)], m, r))
            rng = np.random.RandomState()
            rng.set_state(st.rng.get_state())
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(rng.randint(1_000_000_000))
                for items in by_shape.values():
                    for name, m, r in items:
                        drawn[name] = torch.randn(1, m, r)[0].numpy().tolist()
        return P.powerSGD_hook(st, bucket)

    return state, hook, drawn


def _jdist_q_loader(ddp, q_init):
    """A ``load_replica_hook_state`` loader that puts torch's first Q factors in place."""
    import jax

    def torch_name(path):
        *mod, leaf = path.split("/")
        return ".".join(mod + ["bias" if leaf == "bias" else "weight"])

    def load(state):
        qs = dict(state.q_memory_dict)
        for b in ddp.buckets:
            parts = [np.asarray(q_init[torch_name(p)], np.float32).reshape(-1)
                     for p in b.paths if torch_name(p) in q_init]
            if b.index in qs:
                flat = np.concatenate(parts)
                old = qs[b.index]
                assert old.shape[-1] == flat.size, (b.paths, old.shape, flat.size)
                full = np.broadcast_to(flat, old.shape)
                qs[b.index] = jax.make_array_from_callback(
                    old.shape, old.sharding, lambda idx, full=full: full[idx])
            else:
                assert not parts, b.paths
        return state.replace(q_memory_dict=qs)

    return load


def run_torch(spec):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = torch_model(spec)
    ddp = DDP(model, bucket_cap_mb=spec["bucket_cap_mb"],
              broadcast_buffers=spec["broadcast_buffers"],
              find_unused_parameters=spec["find_unused"],
              gradient_as_bucket_view=spec.get("bucket_view", False))
    hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
            "bf16": _torch_bf16_hook}.get(spec["hook"])
    drawn = None
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    elif spec["hook"] == "powersgd":
        state, hook, drawn = _torch_powersgd(spec, model)
        ddp.register_comm_hook(state, hook)
    lr, name = spec["lr"], spec["optimizer"]
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=lr),
           "momentum": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
           "adam": lambda p: torch.optim.Adam(p, lr=lr, eps=ADAM_EPS),
           "adamw": lambda p: torch.optim.AdamW(p, lr=lr, eps=ADAM_EPS, weight_decay=0.05)
           }[name](
        ddp.parameters())
    k = spec["rows"]

    def loss_of(b):
        x, y = (torch.from_numpy(a) for a in _rows(b, rank * k, (rank + 1) * k))
        out = ddp(x)
        if spec["loss"] == "xent":
            return torch.nn.functional.cross_entropy(out, y)
        return ((out - y) ** 2).mean()

    losses, data = [], batches(spec)
    for s in range(spec["steps"]):
        micro = data[s * spec["accumulate"]:(s + 1) * spec["accumulate"]]
        opt.zero_grad()
        for b in micro[:-1]:
            with ddp.no_sync():
                loss_of(b).backward()
        loss = loss_of(micro[-1])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    state = _state(model)
    ddp = opt = None  # release the reducer before the next case's
    return {"losses": losses, "state": state, "q_init": drawn}


def run_jdist(spec):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel as DDP
    from jdist.ddp import hooks
    from jdist.testing import nnx_to_torch, torch_to_nnx

    procs, devs = spec["layout"]
    assert (jdist.get_world_size(), jax.local_device_count()) == (procs, devs)
    rank = jdist.get_rank()
    t_model, model = torch_model(spec), nnx_model(spec)
    torch_to_nnx(t_model, model)
    ddp = DDP(model, bucket_cap_mb=spec["bucket_cap_mb"],
              broadcast_buffers=spec["broadcast_buffers"],
              find_unused_parameters=spec["find_unused"],
              gradient_as_bucket_view=spec.get("bucket_view", False))
    hook = {"allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
            "bf16": hooks.bf16_compress_hook}.get(spec["hook"])
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    elif spec["hook"] == "powersgd":
        ddp.register_comm_hook(hooks.PowerSGDState(
            matrix_approximation_rank=spec["psgd_rank"], start_powerSGD_iter=PSGD_START,
            use_error_feedback=spec["psgd_ef"], warm_start=True,
            min_compression_rate=spec["psgd_min_rate"], orthogonalization_epsilon=PSGD_EPS,
            random_seed=spec["seed"]),
            hooks.powerSGD_hook)
        ddp.load_replica_hook_state(_jdist_q_loader(ddp, spec["q_init"]))
    lr, name = spec["lr"], spec["optimizer"]
    tx = {"sgd": lambda: optax.sgd(lr), "momentum": lambda: optax.sgd(lr, momentum=0.9),
          "adam": lambda: optax.adam(lr, eps=ADAM_EPS),
          "adamw": lambda: optax.adamw(lr, eps=ADAM_EPS, weight_decay=0.05)}[name]()

    def loss_fn(m, b):
        x, y = b
        if spec["frontend"] == "conv":
            x = jnp.transpose(x, (0, 2, 3, 1))
        out = m(x)
        if spec["loss"] == "xent":
            return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
        return jnp.mean((out - y) ** 2)

    step = ddp.train_step(loss_fn, nnx.Optimizer(model, tx, wrt=nnx.Param))
    k = spec["rows"] * devs
    losses, data = [], batches(spec)
    for s in range(spec["steps"]):
        micro = data[s * spec["accumulate"]:(s + 1) * spec["accumulate"]]
        for b in micro[:-1]:
            with ddp.no_sync():
                step(_rows(b, rank * k, (rank + 1) * k))
        losses.append(float(step(_rows(micro[-1], rank * k, (rank + 1) * k))))
    nnx_to_torch(model, t_model)
    return {"losses": losses, "state": _state(t_model)}
