"""Train the DDP digits CNN from a torch DataLoader with two worker processes.

The same model and data as ``examples/train_ddp.py``; the batches come from a torch
``DataLoader`` over a torch ``Dataset``, as in a torch training script. What changes
from torch::

    sampler = torch.utils.data.DistributedSampler(ds)      -> jdist.sampler.DistributedSampler(ds)
    DataLoader(ds, B, sampler=sampler, num_workers=2)      -> the same, plus
                                                              collate_fn=numpy_collate
    for x, y in loader: ... loss.backward()                -> for batch in ResumableLoader(
                                                                  loader, place=ddp):
                                                                  loss = step(batch)

``ResumableLoader`` puts each batch on this process's devices the way DDP splits it (in
a background thread, one batch ahead) and its ``state_dict()`` is the sampler's
position at the batch in hand, for checkpoints. Workers start with ``forkserver`` (JAX
is running when the loader starts; forking it warns) and persist across epochs.

    jdist-run --nproc-per-node 2 --devices-per-proc 2 examples/train_ddp_torch_loader.py
    python examples/train_ddp_torch_loader.py --devices 4
    python examples/train_ddp_torch_loader.py --smoke --out /tmp/run   # a few steps (tests)
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys

import numpy as np

try:
    from torch.utils.data import Dataset
except ImportError:  # pragma: no cover - the example needs torch
    raise SystemExit("this example needs torch (pip install torch)") from None


class Digits(Dataset):
    """scikit-learn's 8x8 digits, sample ``i`` as ``{"x": 8x8x1 float32, "y": int32,
    "i": i}`` (``i`` lets a test check the order). Module level, so workers import it."""

    def __init__(self, images, labels) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.images[i], "y": self.labels[i], "i": np.int32(i)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="DDP digits CNN fed by a torch DataLoader")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="global batch (all processes)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--devices", type=int, default=4, help="virtual devices (1 process)")
    ap.add_argument("--smoke", action="store_true", help="2 epochs of 3 steps, for tests")
    ap.add_argument("--out", help="write this rank's results to OUT/rank<r>.json")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_ddp import _cnn_and_loss, _digits, _setup, _test_accuracy  # the demo's parts

    _setup(args.devices)

    import itertools

    import optax
    from flax import nnx
    from torch.utils.data import DataLoader

    import jdist
    from jdist.ddp import DistributedDataParallel
    from jdist.sampler import DistributedSampler, ResumableLoader, numpy_collate

    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not jdist.collectives.is_initialized():
        jdist.collectives.init_process_group()
        started = True
    rank = jdist.collectives.get_rank() if jdist.collectives.is_initialized() else 0
    world = jdist.collectives.get_world_size() if jdist.collectives.is_initialized() else 1

    CNN, loss_fn = _cnn_and_loss()

    images, labels = _digits(np)
    order = np.random.default_rng(0).permutation(len(images))
    test, train = order[:297], order[297:]
    train_set = Digits(images[train], labels[train])

    model = CNN(nnx.Rngs(0))
    ddp = DistributedDataParallel(model)
    step = ddp.train_step(loss_fn, nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param))
    local_devices = len(ddp.process_group.local_devices)
    per_process = args.batch // world

    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=0, drop_last=True)
    # workers fork from a clean server process that has torch and numpy loaded already
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["numpy", "torch"])
    loader = DataLoader(train_set, batch_size=per_process, sampler=sampler,
                        num_workers=args.workers, collate_fn=numpy_collate, drop_last=True,
                        persistent_workers=args.workers > 0,
                        multiprocessing_context=context if args.workers else None)
    feed = ResumableLoader(loader, place=ddp)  # checks per_process % local_devices
    epochs, max_steps = (2, 3) if args.smoke else (args.epochs, None)
    losses, seen, state = [], [], None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in itertools.islice(feed, max_steps):
            # batch["i"] sits on the devices like the rest (a global array over all
            # processes): read back this process's rows, for the record
            shards = sorted(batch.pop("i").addressable_shards, key=lambda s: s.index[0].start)
            seen.append(np.concatenate([np.asarray(s.data) for s in shards]).tolist())
            losses.append(float(step(batch)))
        state = feed.state_dict()  # what a checkpoint would store
        if rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}, sampler state {state}")

    accuracy, scored = _test_accuracy(ddp, images, labels, test, rank, world, local_devices)
    if rank == 0:
        print(f"test accuracy {accuracy:.4f} on {scored} images ({world} "
              f"process(es) x {local_devices} device(s), {args.workers} loader workers each)")
    if started:
        jdist.collectives.destroy_process_group()
    result = {"accuracy": accuracy, "losses": losses, "rank": rank, "world": world,
              "batches": seen, "state": state, "per_process": per_process}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
