"""The torch twin of ``ddp_tutorial.py``: ``multigpu_torchrun.py`` on CPU/gloo.

The tutorial's program with the port's two changes (MSE loss, numpy dataset) and its
test flags (``--crash-after-epoch``, ``--init``, ``--out``)::

    torchrun --nproc-per-node 2 --max-restarts 1 examples/ports/ddp_tutorial_torch.py 3 1
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from _common import load_init, save
from _data import tutorial_dataset
from torch.distributed import destroy_process_group, get_rank, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path,
                 crash_after_epoch=None):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.crash_after_epoch = crash_after_epoch
        self.resumed = os.path.exists(snapshot_path)
        if self.resumed:
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)
        self.losses, self.times = [], []

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)  # the record: jdist's step gives the mean
        self.losses.append(float(mean) / torch.distributed.get_world_size())

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            if self.gpu_id == 0 and not self.resumed and epoch == self.crash_after_epoch:
                print(f"rank 0 crashes after epoch {epoch} (--crash-after-epoch)", flush=True)
                os._exit(3)


def load_train_objs(size, init):
    x, y = tutorial_dataset(size)
    train_set = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    model = torch.nn.Linear(20, 1)
    if init:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in load_init(init).items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      sampler=DistributedSampler(dataset))


def parse(argv=None):
    p = argparse.ArgumentParser(description="simple distributed training job")
    p.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    p.add_argument("save_every", type=int, help="How often to save a snapshot")
    p.add_argument("--batch_size", default=32, type=int, help="Input batch size per process")
    p.add_argument("--dataset-size", type=int, default=2048)
    p.add_argument("--snapshot-path", default="snapshot.pt")
    p.add_argument("--crash-after-epoch", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="256 samples (tests)")
    p.add_argument("--init", help="initial weights: a state dict as .npz")
    p.add_argument("--out", help="write this rank's results to OUT/rank<r>.pkl")
    args = p.parse_args(argv)
    if args.smoke:
        args.dataset_size = 256
    return args


def main(args) -> None:
    torch.set_num_threads(1)
    init_process_group(backend="gloo")
    dataset, model, optimizer = load_train_objs(args.dataset_size, args.init)
    train_data = prepare_dataloader(dataset, args.batch_size)
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path,
                      args.crash_after_epoch)
    trainer.train(args.total_epochs)
    save(args.out, get_rank(), {
        "losses": trainer.losses, "times": trainer.times, "resumed": trainer.resumed,
        "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}})
    destroy_process_group()


if __name__ == "__main__":
    main(parse())
