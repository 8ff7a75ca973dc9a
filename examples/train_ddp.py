"""Train a small CNN on scikit-learn's digits with DistributedDataParallel.

The torch recipe, line for line::

    init_process_group()                         jdist.init_process_group()
    model = DDP(model)                           ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(train_set)      sampler = DistributedSampler(n_train)
    for epoch ...: sampler.set_epoch(epoch)      (same)
        loss = loss_fn(model(x), y)              loss = step(batch)   # forward, backward
        loss.backward(); opt.step()              # with bucketed all-reduce, update

Each process reads its own samples (``DistributedSampler``) and DDP splits them over the
process's devices; gradients are averaged over every device of every process from
inside the backward pass. The data is scikit-learn's bundled 8x8 digits (no download);
the last 297 shuffled images are the test set.

Run it on 2 processes with 2 virtual CPU devices each, or as one process::

    jdist-run --nproc-per-node 2 --devices-per-proc 2 examples/train_ddp.py
    python examples/train_ddp.py --devices 4
    python examples/train_ddp.py --smoke          # a few steps (tests)
    srun -n 2 python examples/train_ddp.py --devices 2   # or mpirun -n 2 (docs/cluster.md)
"""

from __future__ import annotations

import argparse
import os
import sys


def _setup(devices: int) -> None:
    """Single-process runs: ask XLA for ``devices`` virtual CPU devices."""
    if "jax" in sys.modules or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return  # configured already (pytest, or jdist-run's --devices-per-proc)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jdist.launch import xla_flags_with_devices  # imports no JAX

    os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices)


def _digits(np):
    """scikit-learn's bundled 8x8 digits as (images NHWC in [0, 1], labels)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("this example needs scikit-learn (pip install scikit-learn)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data",
                        "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return data[:, :-1].reshape(-1, 8, 8, 1) / 16.0, data[:, -1].astype(np.int32)


def _cnn_and_loss():
    """The demo's model class and loss (flax and optax load here, after ``_setup``)."""
    import optax
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
            self.fc = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.conv1(x))
            x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
            return self.fc(x.reshape(x.shape[0], -1))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return CNN, loss_fn


def _test_accuracy(ddp, images, labels, test, rank: int, world: int, local_devices: int):
    """Exact test accuracy: each process scores its share of ``test`` (padded to its
    devices) and the counts are summed over processes. Returns ``(accuracy, images)``."""
    import jax.numpy as jnp
    import numpy as np

    import jdist

    share = test[rank::world]
    pad = (-len(share)) % local_devices
    x = np.concatenate([images[share], np.zeros((pad, *images.shape[1:]), images.dtype)])
    logits = np.asarray(ddp(jnp.asarray(x)))[:len(share)]
    counts = np.array([(logits.argmax(-1) == labels[share]).sum(), len(share)], np.int64)
    if world > 1:
        counts = np.asarray(jdist.collectives.all_reduce(counts))
    return float(counts[0]) / float(counts[1]), int(counts[1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="DDP digits CNN")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="global batch (all processes)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--devices", type=int, default=4, help="virtual devices (1 process)")
    ap.add_argument("--smoke", action="store_true", help="a few steps, for tests")
    args = ap.parse_args(argv)
    _setup(args.devices)

    import numpy as np
    import optax
    from flax import nnx
    from tqdm import tqdm

    import jdist
    from jdist.ddp import DistributedDataParallel
    from jdist.sampler import DistributedSampler

    started = False
    if not jdist.collectives.is_initialized():  # finds its job: jdist-run, srun, mpirun...
        jdist.collectives.init_process_group()
        started = True
    if jdist.collectives.is_initialized():
        rank, world = jdist.collectives.get_rank(), jdist.collectives.get_world_size()
    else:
        rank, world = 0, 1

    CNN, loss_fn = _cnn_and_loss()

    images, labels = _digits(np)
    order = np.random.default_rng(0).permutation(len(images))
    test, train = order[:297], order[297:]

    model = CNN(nnx.Rngs(0))
    ddp = DistributedDataParallel(model)
    step = ddp.train_step(loss_fn, nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param))
    local_devices = len(ddp.process_group.local_devices)
    per_process = args.batch // world
    if per_process % local_devices:
        raise SystemExit(f"--batch {args.batch} gives {per_process} samples per process, "
                         f"not a multiple of its {local_devices} devices")

    sampler = DistributedSampler(len(train), num_replicas=world, rank=rank, shuffle=True,
                                 seed=0, drop_last=True)
    epochs, max_steps = (1, 3) if args.smoke else (args.epochs, None)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        mine = train[np.asarray(list(sampler))]
        n_steps = len(mine) // per_process
        if max_steps:
            n_steps = min(n_steps, max_steps)
        bar = tqdm(range(n_steps), desc=f"epoch {epoch}", disable=rank != 0,
                   dynamic_ncols=True)
        for i in bar:
            idx = mine[i * per_process:(i + 1) * per_process]
            loss = float(step({"x": images[idx], "y": labels[idx]}))
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.4f}")

    accuracy, scored = _test_accuracy(ddp, images, labels, test, rank, world, local_devices)
    if rank == 0:
        print(f"test accuracy {accuracy:.4f} on {scored} images "
              f"({world} process(es) x {local_devices} device(s), "
              f"{len(ddp.buckets.buckets)} gradient bucket(s))")
    if started:
        jdist.collectives.destroy_process_group()
    return {"accuracy": accuracy, "losses": losses, "rank": rank, "world": world}


if __name__ == "__main__":
    main()
