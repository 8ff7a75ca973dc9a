"""ArrayLoader: memory-mapped and random-access data, DDP's layout, resume, memory bound."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.sampler import ArrayLoader, DistributedSampler

ROOT = Path(__file__).resolve().parents[2]


class Rows:
    """A random-access dataset that is not an array: sample ``i`` is a dict."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {"label": i % 7, "weight": np.float32(i) / 2}


def make_data(tmp_path, n=60):
    """A memory-mapped file read through a row-offset view (read from the file) and a
    strided view (indexed, pages released), an in-memory array and a ``Rows``."""
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32,
                                  shape=(n + 10, 5))
    x[:] = np.arange((n + 10) * 5, dtype=np.float32).reshape(n + 10, 5)
    x.flush()
    del x
    mm = np.load(tmp_path / "x.npy", mmap_mode="r")
    return {"x": mm[10:], "xs": mm[10:, ::2], "y": np.arange(n) * 3, "extra": Rows(n)}


def expected(data, order, size, drop_last):
    out = []
    for i in range(0, len(order), size):
        idx = np.asarray(order[i:i + size])
        if drop_last and len(idx) < size:
            break
        out.append({"x": np.asarray(data["x"])[idx], "xs": np.asarray(data["xs"])[idx],
                    "y": data["y"][idx],
                    "extra": {"label": idx % 7, "weight": idx.astype(np.float32) / 2}})
    return out


@pytest.mark.parametrize(("prefetch", "drop_last"), [(0, False), (1, True), (3, False)])
def test_batches_are_the_rows_in_sampler_order(tmp_path, prefetch, drop_last):
    data = make_data(tmp_path)
    sampler = DistributedSampler(60, 2, 1, seed=4)
    loader = ArrayLoader(sampler, data, 8, drop_last=drop_last, prefetch=prefetch)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        got = list(loader)
        want = expected(data, sampler.indices(), 8, drop_last)
        assert len(got) == len(want) == len(loader)
        for g, w in zip(got, want, strict=True):
            jax.tree.map(np.testing.assert_array_equal, g, w)
            assert isinstance(g["x"], np.ndarray) and not isinstance(g["x"], np.memmap)


def test_resume_mid_epoch_with_prefetch_ahead(tmp_path):
    data = make_data(tmp_path)
    sampler = DistributedSampler(60, 1, 0, seed=2)
    loader = ArrayLoader(sampler, data, 7, prefetch=3)
    sampler.set_epoch(3)
    head = [b["y"].tolist() for b in itertools.islice(loader, 4)]
    state = loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (3, 28)
    assert sampler.consumed() > 28  # the thread read ahead
    assert sampler.state_dict() == state  # the sampler reports the loop's position
    again = DistributedSampler(60, 1, 0, seed=2)
    resumed = ArrayLoader(again, data, 7, prefetch=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # a JSON round trip
    again.set_epoch(3)
    tail = [b["y"].tolist() for b in resumed]
    want = [b["y"].tolist() for b in expected(data, sampler.indices(), 7, False)]
    assert head + tail == want


def test_a_checkpoint_of_the_sampler_resumes_at_the_batch_in_hand(tmp_path):
    """jdist.checkpoint saves ``sampler.state_dict()``; while a loader reads the sampler,
    that is the loop's position, not the prefetch thread's."""
    from jdist.checkpoint import CheckpointManager

    data = make_data(tmp_path)
    sampler = DistributedSampler(60, 1, 0, seed=2)
    sampler.set_epoch(1)
    it = iter(ArrayLoader(sampler, data, 6, prefetch=2))
    head = [next(it)["y"].tolist() for _ in range(3)]
    assert sampler.consumed() > 18  # the thread read ahead
    assert sampler.state_dict()["consumed"] == 18
    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(3, {"sampler": sampler}, force=True)
    again = DistributedSampler(60, 1, 0, seed=2)
    assert manager.restore({"sampler": again})["sampler"] is again
    manager.close()
    it.close()
    again.set_epoch(1)
    tail = [b["y"].tolist() for b in ArrayLoader(again, data, 6)]
    want = [b["y"].tolist() for b in expected(data, sampler.indices(), 6, False)]
    assert head + tail == want
    sampler.set_epoch(2)  # a new epoch: the loader's count no longer applies
    assert sampler.state_dict()["consumed"] == 0


def test_batches_land_in_ddps_layout_and_train_like_host_batches(tmp_path, mesh8):
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel

    data = make_data(tmp_path, 64)
    data["x"] = np.ascontiguousarray(data["x"])  # one copy, for the model's 5 inputs

    def train(feed_placed: bool):
        model = nnx.Linear(5, 1, rngs=nnx.Rngs(0))
        ddp = DistributedDataParallel(model)
        step = ddp.train_step(
            lambda m, b: ((m(b["x"])[:, 0] - b["y"]) ** 2).mean(),
            nnx.Optimizer(model, optax.sgd(1e-5), wrt=nnx.Param))
        sampler = DistributedSampler(64, 1, 0, seed=1)
        loader = ArrayLoader(sampler, {"x": data["x"], "y": data["y"].astype(np.float32)},
                             16, place=ddp if feed_placed else None)
        losses, layouts = [], set()
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in loader:
                layouts.add(getattr(batch["x"], "sharding", None))
                losses.append(float(step(batch)))
        group = ddp.process_group
        return losses, layouts, NamedSharding(group.mesh, P(group.axis_name))

    placed, layouts, want = train(True)
    host, host_layouts, _ = train(False)
    assert layouts == {want} and len(next(iter(layouts)).addressable_devices) == 8
    assert host_layouts == {None}
    np.testing.assert_allclose(placed, host, rtol=1e-6)


def test_bad_inputs(tmp_path, mesh8):
    data = make_data(tmp_path)
    eight = NamedSharding(mesh8, P("dp"))
    sampler = DistributedSampler(60, 1, 0)
    with pytest.raises(ValueError, match=r"batch_size=12\) has 12 samples, which does not "
                                         r"split evenly over this process's 8 devices "
                                         r"\(12 % 8 = 4\)"):
        ArrayLoader(sampler, data, 12, place=eight)
    with pytest.raises(ValueError, match=r"last batch of an epoch \(60 samples per epoch, "
                                         r"batch_size=16.*drop_last=True"):
        ArrayLoader(sampler, data, 16, place=eight)
    ArrayLoader(DistributedSampler(60, 1, 0), data, 16, place=eight, drop_last=True)
    with pytest.raises(ValueError, match=r"over 61 samples but the data has 60 rows"):
        ArrayLoader(DistributedSampler(61, 1, 0), data, 4)
    with pytest.raises(ValueError, match="same number of rows"):
        ArrayLoader(DistributedSampler(60, 1, 0), {"a": np.zeros(60), "b": np.zeros(59)}, 4)
    with pytest.raises(TypeError, match=r"data\['a'\] is int, which has no __getitem__"):
        ArrayLoader(DistributedSampler(60, 1, 0), {"a": 3}, 4)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        ArrayLoader(DistributedSampler(60, 1, 0), data, 0)
    grows = Rows(60)
    sampler = DistributedSampler(grows, 1, 0)
    loader = ArrayLoader(sampler, grows, 10)
    list(loader)
    grows.n = 70  # the dataset's length changes between epochs
    sampler.set_epoch(1)
    with pytest.raises(ValueError, match="length changed from 60 to 70"):
        next(iter(loader))
    # a sampler shared by two loaders read together (here: through prefetch threads)
    sampler = DistributedSampler(60, 1, 0)
    one, two = (iter(ArrayLoader(sampler, data, 4, prefetch=1)) for _ in range(2))
    next(one)
    next(two)
    with pytest.raises(RuntimeError, match="read by two consumers"):
        list(one)


_CHILD = r"""
import gc, json, sys
import numpy as np
import optax
from flax import nnx
from jdist.ddp import DistributedDataParallel
from jdist.sampler import ArrayLoader, DistributedSampler

path, batch = sys.argv[1], int(sys.argv[2])

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

x = np.load(path, mmap_mode="r")
n, d = x.shape
model = nnx.Linear(d, 1, rngs=nnx.Rngs(0))
ddp = DistributedDataParallel(model)
step = ddp.train_step(lambda m, b: (m(b)[:, 0] ** 2).mean(),
                      nnx.Optimizer(model, optax.sgd(1e-9), wrt=nnx.Param))
step(np.zeros((batch, d), np.float32))  # compile before measuring
sampler = DistributedSampler(n, 1, 0, seed=0, drop_last=True)
loader = ArrayLoader(sampler, x, batch, drop_last=True, place=ddp, prefetch=2)
gc.collect()
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
steps = 0
for b in loader:
    loss = float(step(b))
    steps += 1
ours = status("VmHWM") - base
# the naive loop: fancy-index the memory map, keep nothing
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
total = 0.0
for i in range(0, n - batch + 1, batch):
    total += float(x[sampler.indices()[i:i + batch]][:, 0].sum())
naive = status("VmHWM") - base
print(json.dumps({"ours": ours, "naive": naive, "steps": steps, "loss": loss}))
"""


def test_a_memory_mapped_file_trains_with_peak_memory_of_a_few_batches(tmp_path):
    """A 256 MiB file, 4 MiB batches: peak resident memory grows by under 10 batches
    (the step's, the prefetched ones, allocator slack) while one epoch of 64 batches
    trains; the naive loop over the same memory map grows by about the file."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    rows, d, batch = 65536, 1024, 1024
    path = tmp_path / "big.npy"
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, d))
    for i in range(0, rows, 4096):
        x[i:i + 4096] = np.random.default_rng(i).random((4096, d), dtype=np.float32)
    x.flush()
    del x
    batch_bytes = batch * d * 4
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(batch)],
                             cwd=ROOT, capture_output=True, text=True, timeout=240,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        path.unlink()
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["steps"] == rows // batch and np.isfinite(res["loss"])
    file_bytes = rows * d * 4
    assert res["ours"] < 10 * batch_bytes, (res, batch_bytes)  # 64 batches in the file
    assert res["naive"] > file_bytes // 2, res  # the measure sees mapped pages
