"""pytorch/examples ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` in jdist.

A ``Trainer`` runs DDP over ``jdist-run``'s processes, each reading its share of the
dataset through a ``DistributedSampler``, and rank 0 saves a snapshot every
``save_every`` epochs; a restarted job loads it and resumes from that epoch, as the
tutorial does under ``torchrun --max-restarts``::

    jdist-run --nproc-per-node 2 --max-restarts 1 examples/ports/ddp_tutorial.py 3 1 \\
        [--batch_size 32] [--crash-after-epoch 1]

``--crash-after-epoch E`` makes rank 0 of a fresh run (one that found no snapshot) die
after epoch ``E``, so the restart resumes from the snapshot: the crash-and-resume path
of the tutorial in one command.

What changes from the torch program: the model is an ``nnx.Linear``; the DDP step is
``ddp.train_step(loss_fn, optimizer)`` instead of ``zero_grad/backward/step``; the
snapshot holds ``nnx.state(model)`` as numpy arrays (pickle instead of ``torch.save``);
the data loader is ``jdist.sampler.batches`` behind a small ``DataLoader`` (jdist has no
class with torch's ``len(loader)`` and ``loader.sampler``). Two deliberate changes,
made in the torch twin too: MSE instead of the tutorial's ``F.cross_entropy`` (on one
output column that loss is identically 0, so the tutorial trains nothing), and a
synthetic dataset from a numpy seed (``MyTrainDataset`` uses ``torch.rand``).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import time

import jax.numpy as jnp
import numpy as np
import optax
from _common import load_init, save
from _data import tutorial_dataset
from flax import nnx

import jdist
from jdist.ddp import DistributedDataParallel as DDP
from jdist.sampler import DistributedSampler, batches
from jdist.testing import state_dict_to_nnx


class DataLoader:
    """``torch.utils.data.DataLoader(dataset, batch_size, sampler=...)`` for arrays."""

    def __init__(self, dataset, batch_size: int, sampler):
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        return batches(self.sampler, self.dataset, self.batch_size, prefetch=False)


def loss_fn(model, batch):
    source, targets = batch
    return jnp.mean((model(source) - targets) ** 2)


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every: int, snapshot_path: str,
                 crash_after_epoch: int | None = None):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.crash_after_epoch = crash_after_epoch
        self.resumed = os.path.exists(snapshot_path)
        if self.resumed:
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.ddp = DDP(self.model)
        self.step = self.ddp.train_step(loss_fn, optimizer)
        self.losses, self.times = [], []

    def _load_snapshot(self, snapshot_path):
        with open(snapshot_path, "rb") as f:
            snapshot = pickle.load(f)
        state = nnx.state(self.model)
        state.replace_by_pure_dict(snapshot["MODEL_STATE"])
        nnx.update(self.model, state)
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        t0 = time.perf_counter()
        self.losses.append(float(self.step((source, targets))))
        self.times.append(time.perf_counter() - t0)

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": nnx.state(self.model).to_pure_dict(),
                    "EPOCHS_RUN": epoch}
        tmp = self.snapshot_path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(jax_to_numpy(snapshot), f)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            if self.gpu_id == 0 and not self.resumed and epoch == self.crash_after_epoch:
                print(f"rank 0 crashes after epoch {epoch} (--crash-after-epoch)", flush=True)
                os._exit(3)


def jax_to_numpy(tree):
    import jax

    return jax.tree.map(np.asarray, tree)


def load_train_objs(size: int, init: str | None):
    train_set = tutorial_dataset(size)
    model = nnx.Linear(20, 1, rngs=nnx.Rngs(0))
    if init:
        state_dict_to_nnx(load_init(init), model)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size,
                      sampler=DistributedSampler(len(dataset[0])))


def main(args) -> None:
    jdist.init_process_group()
    dataset, model, optimizer = load_train_objs(args.dataset_size, args.init)
    train_data = prepare_dataloader(dataset, args.batch_size)
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path,
                      args.crash_after_epoch)
    trainer.train(args.total_epochs)
    save(args.out, jdist.get_rank(), {
        "losses": trainer.losses, "times": trainer.times, "resumed": trainer.resumed,
        "params": {k: np.asarray(v) for k, v in nnx.state(model, nnx.Param).flat_state()}})
    jdist.destroy_process_group()


def parse(argv=None):
    p = argparse.ArgumentParser(description="simple distributed training job")
    p.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    p.add_argument("save_every", type=int, help="How often to save a snapshot")
    p.add_argument("--batch_size", default=32, type=int, help="Input batch size per process")
    p.add_argument("--dataset-size", type=int, default=2048)
    p.add_argument("--snapshot-path", default="snapshot.pkl")
    p.add_argument("--crash-after-epoch", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="256 samples (tests)")
    p.add_argument("--init", help="initial weights: a torch state dict as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args(argv)
    if args.smoke:
        args.dataset_size = 256
    return args


if __name__ == "__main__":
    main(parse())
