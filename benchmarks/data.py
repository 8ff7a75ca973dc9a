"""Feeding a DDP step: samples per second from each jdist loader path vs torch's.

Run: ``PYTHONPATH=. python benchmarks/data.py [--quick] [--samples 16384] [--epochs 3]``

One process, one device, one compute thread in each framework (the loaders' workers
are extra processes), the same memory-mapped file of float32 features and the same
MLP. Each path trains whole epochs (one untimed warm-up epoch first: compilation,
worker start-up; then the paths take turns, one epoch each per round) and reports the
median time per step of its timed epochs and the samples per second over them:

* torch ``DataLoader`` (2 workers, ``forkserver``, persistent) with jdist's sampler and
  ``numpy_collate``, through ``ResumableLoader(place=ddp)`` into jdist's DDP step;
* grain (``grain_loader``, 2 workers, ``Batch``) through ``ResumableLoader`` (if grain
  is installed);
* ``ArrayLoader`` over the memory map (a background thread reads the next batch);
* the baseline: torch's ``DataLoader`` (2 workers, torch's ``DistributedSampler``,
  default collate) feeding torch DDP (gloo, world size 1) with the same model.

Ratios are jdist / torch step time (lower is better). A second table shows what prefetch
buys: ``ArrayLoader`` and the torch-loader path with ``prefetch=0`` (read and place each
batch when the step asks for it) and ``prefetch=1``, against the step alone on a batch
already on the device (the floor). The last line, ``BENCH_JSON {...}``, holds the numbers
for benchmarks/run_all.py.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time

import numpy as np

FEATURES, HIDDEN, CLASSES, BATCH = 512, 512, 10, 256


class MemmapRows:
    """A torch-style map dataset over the memory-mapped file (each process maps it when
    it unpickles the dataset, before any reader thread runs)."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n
        self._x = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        row = np.array(self._x[i])
        return {"x": row, "y": np.int32(int(row[0] * 1000) % CLASSES)}

    def __getstate__(self):
        return {"path": self.path, "n": self.n}

    def __setstate__(self, state):
        self.__init__(state["path"], state["n"])


def _context():
    """forkserver workers (JAX runs in this process), torch preloaded in the server."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "torch"])
    return ctx


def _labels(x: np.ndarray) -> np.ndarray:
    return (np.floor(x[:, 0] * 1000) % CLASSES).astype(np.int32)


def make_file(directory: str, n: int) -> str:
    path = os.path.join(directory, "features.npy")
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, FEATURES))
    for i in range(0, n, 4096):
        x[i:i + 4096] = np.random.default_rng(i).random((min(4096, n - i), FEATURES),
                                                        dtype=np.float32)
    x.flush()
    return path


def _interleaved(paths: dict, epochs: int) -> dict:
    """One warm-up epoch of every path, then ``epochs`` timed rounds, each running one
    epoch of every path in turn (so that load from other processes hits all alike):
    per path, the median step ms and the samples per second over its timed epochs."""
    for run_epoch in paths.values():
        run_epoch(0)
    steps = {name: [] for name in paths}
    spent = dict.fromkeys(paths, 0.0)
    for e in range(1, epochs + 1):
        for name, run_epoch in paths.items():
            start = time.perf_counter()
            steps[name] += run_epoch(e)
            spent[name] += time.perf_counter() - start
    return {name: {"ms": 1e3 * statistics.median(steps[name]),
                   "sps": len(steps[name]) * BATCH / spent[name]} for name in paths}


def _timed_loop(batches, step) -> list[float]:
    out, t = [], time.perf_counter()
    for b in batches:
        step(b)
        now = time.perf_counter()
        out.append(now - t)
        t = now
    return out


def jdist_paths(path: str, n: int, workers: int, out: dict) -> None:
    import jax
    import optax
    from flax import nnx
    from torch.utils.data import DataLoader

    from jdist.ddp import DistributedDataParallel
    from jdist.sampler import ArrayLoader, DistributedSampler, ResumableLoader, numpy_collate

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
            self.b = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    def loss_fn(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean()

    model = MLP(nnx.Rngs(0))
    ddp = DistributedDataParallel(model)
    train = ddp.train_step(loss_fn, nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param))

    def step(b):
        jax.block_until_ready(train(b))

    x = np.load(path, mmap_mode="r")
    data = {"x": x, "y": _labels(np.asarray(x[:, :1]))}

    def run(make, name):
        sampler = DistributedSampler(n, 1, 0, seed=0, drop_last=True)
        loader = make(sampler)

        def epoch(e):
            sampler.set_epoch(e)
            return _timed_loop(loader, step)

        out[name] = epoch

    def torch_loader(sampler, prefetch=1):
        return ResumableLoader(DataLoader(
            MemmapRows(path, n), batch_size=BATCH, sampler=sampler, num_workers=workers,
            collate_fn=numpy_collate, drop_last=True, persistent_workers=workers > 0,
            multiprocessing_context=_context() if workers else None),
            place=ddp, prefetch=prefetch)

    run(torch_loader, "torch DataLoader + jdist sampler")
    run(lambda s: torch_loader(s, prefetch=0), "torch DataLoader, prefetch=0")
    run(lambda s: ArrayLoader(s, data, BATCH, drop_last=True, place=ddp, prefetch=1),
        "ArrayLoader, prefetch=1")
    run(lambda s: ArrayLoader(s, data, BATCH, drop_last=True, place=ddp, prefetch=0),
        "ArrayLoader, prefetch=0")
    try:
        import grain
    except ImportError:
        grain = None
    if grain is not None:
        from jdist.sampler import grain_loader

        # one endless loader (grain streams epochs); each round takes one epoch of it
        sampler = DistributedSampler(n, 1, 0, seed=0, drop_last=True)
        loader = grain_loader(MemmapRows(path, n), sampler, worker_count=workers, epochs=None,
                              operations=[grain.transforms.Batch(BATCH, drop_remainder=True)])
        per_epoch = n // BATCH
        feed = iter(ResumableLoader(loader, place=ddp))

        def grain_epoch(e):
            return _timed_loop(itertools.islice(feed, per_epoch), step)

        out["grain + GrainSampler"] = grain_epoch
    # the floor: the step alone on a batch already on the device
    from jdist.sampler import batch_sharding
    from jdist.sampler._place import place

    ready = place({"x": np.asarray(x[:BATCH]), "y": data["y"][:BATCH]}, batch_sharding(ddp))
    out["step alone"] = lambda e: _timed_loop([ready] * (n // BATCH), step)


def torch_baseline(path: str, n: int, workers: int, out: dict):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.utils.data import DataLoader
    from torch.utils.data import DistributedSampler as TorchSampler

    torch.set_num_threads(1)  # like XLA below: one compute thread each (see main)
    store = tempfile.mktemp(prefix="jdist-bench-data-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = TorchDDP(nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
                                   nn.Linear(HIDDEN, CLASSES)))
    sampler = TorchSampler(range(n), 1, 0, seed=0, drop_last=True)
    st = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01),
          "loader": DataLoader(MemmapRows(path, n), batch_size=BATCH, sampler=sampler,
                               num_workers=workers, drop_last=True,
                               persistent_workers=workers > 0,
                               multiprocessing_context=_context() if workers else None)}
    del model

    def step(b):
        st["opt"].zero_grad()
        loss = nn.functional.cross_entropy(st["model"](b["x"]), b["y"].long())
        loss.backward()
        st["opt"].step()

    def epoch(e):
        sampler.set_epoch(e)
        return _timed_loop(st["loader"], step)

    out["torch DataLoader + torch DDP"] = epoch

    def close():
        st.clear()  # the DDP reducer goes before the group (torch can abort otherwise)
        import gc

        gc.collect()
        dist.destroy_process_group()
        if os.path.exists(store):
            os.remove(store)

    return close


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4096 samples, 2 timed rounds")
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--epochs", type=int, default=3, help="timed rounds (after a warm-up)")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes")
    a = p.parse_args(argv)
    n, epochs = (4096, 2) if a.quick else (a.samples, a.epochs)
    # one compute thread for XLA, as for torch: on a shared machine, spinning intra-op
    # pools of both frameworks measure contention instead of the loaders (torch with 2
    # threads on 2 busy cores ran its step 20x slower)
    os.environ.setdefault("JDIST_XLA_CPU_THREADS", "1")  # (spawned ranks read it too)
    from jdist._xla_threads import limit_from_env

    limit_from_env()
    if n < 2 * BATCH or epochs < 1:
        p.error(f"need --samples >= {2 * BATCH} and --epochs >= 1")
    with tempfile.TemporaryDirectory(prefix="jdist-bench-data-") as tmp:
        path = make_file(tmp, n)
        paths: dict = {}
        close = torch_baseline(path, n, a.workers, paths)
        try:
            jdist_paths(path, n, a.workers, paths)
            ours = _interleaved(paths, epochs)
        finally:
            close()
        base = ours.pop("torch DataLoader + torch DDP")
    print(f"{n} samples x {FEATURES} float32 (memory-mapped), batch {BATCH}, MLP "
          f"{FEATURES}-{HIDDEN}-{CLASSES}, {epochs} timed epoch(s), {a.workers} loader "
          f"workers, {os.cpu_count()} cpus")
    print(f"  {'torch DataLoader + torch DDP':36s} {base['ms']:8.2f} ms/step "
          f"{base['sps']:10.0f} samples/s   (baseline)")
    feed_rows, pf_rows = [], []
    for name in ("torch DataLoader + jdist sampler", "grain + GrainSampler",
                 "ArrayLoader, prefetch=1"):
        if name not in ours:
            continue
        r = ours[name]
        ratio = r["ms"] / base["ms"]
        print(f"  {name:36s} {r['ms']:8.2f} ms/step {r['sps']:10.0f} samples/s   "
              f"ratio {ratio:.2f}x")
        feed_rows.append((name, r, ratio))
    floor = ours["step alone"]
    print(f"prefetch (step time; the step alone on a ready batch: {floor['ms']:.2f} ms)")
    for label, name in (("torch DataLoader, prefetch=0", "torch DataLoader, prefetch=0"),
                        ("torch DataLoader, prefetch=1", "torch DataLoader + jdist sampler"),
                        ("ArrayLoader, prefetch=0", "ArrayLoader, prefetch=0"),
                        ("ArrayLoader, prefetch=1", "ArrayLoader, prefetch=1")):
        r = ours[name]
        print(f"  {label:36s} {r['ms']:8.2f} ms/step   vs step alone "
              f"{r['ms'] / floor['ms']:.2f}x")
        pf_rows.append((label, r))
    from benchmarks._parse import bench_json, row, table

    print(bench_json("data", [
        table(f"time per DDP step fed by each loader, batch {BATCH}, {n} samples",
              "torch DataLoader + torch DDP", "jdist / torch step time (lower is better)",
              [row(name, "ms", r["ms"], base["ms"], ratio,
                   f"{r['sps']:.0f} vs {base['sps']:.0f} samples/s")
               for name, r, ratio in feed_rows]),
        table("what prefetch hides: step time vs the step alone on a ready batch",
              "step alone", "step time / step alone (1 = the copy is hidden)",
              [row(label, "ms", r["ms"], floor["ms"], r["ms"] / floor["ms"])
               for label, r in pf_rows]),
    ]))


if __name__ == "__main__":
    sys.exit(main())
