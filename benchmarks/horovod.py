"""Horovod-style training: ``AllReduceOptimizer`` on 2 processes vs torch DDP (gloo).

Run: ``PYTHONPATH=. python benchmarks/horovod.py [--steps 30] [--quick]``.

Both sides train the same small CNN (conv 1->16 3x3, conv 16->32 3x3, linear 512->10;
6 arrays, 9,930 floats) on sklearn's 8x8 digits (random data without sklearn), global
batch 64 (32 per process), SGD, 2 processes x 1 device x 1 thread, gloo, in the same run.
jdist follows Horovod's sequence: every rank builds its own model, rank 0's parameters
and optimizer state are broadcast (``jdist.optim.broadcast_parameters`` /
``broadcast_optimizer_state``, placed on the group's mesh), then one jitted
``shard_map`` step per batch whose ``AllReduceOptimizer`` averages the gradients.

Rows (medians of timed steps after warm-up, every step blocked on its loss; torch and
jdist run in the same two processes, one step of each per round, so that the load of a
shared machine falls on both alike):

a) step time, jdist (its default on CPU across processes: each dtype's gradients in one
   flat buffer, one all-reduce) and jdist with ``flat=False`` (one operand per gradient,
   which gloo runs as one collective each) against torch DDP. Goal: <= 1.0x.
b) the gradient all-reduce alone, the issue's case: 8 arrays, 21,790 floats, one program
   per form on the same 2 processes: flat buffer vs one operand per array, and torch's
   gloo ``all_reduce`` of one tensor of that size (the communication floor).

The last line, ``BENCH_JSON {...}``, holds the same numbers for benchmarks/run_all.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

GLOBAL_BATCH, LR = 64, 0.05
SHAPES = [(3, 3, 1, 16), (16,), (3, 3, 16, 32), (32,), (512, 10), (10,), (700,), (11160,)]


def _median_ms(fn, steps, warmup=3):
    from benchmarks.ddp import _median_ms as median  # one timing loop for the benchmarks

    return median(fn, steps, warmup)


def digits(n, rank, world):
    """This rank's share (``n // world`` rows) of a global batch of 8x8 digits."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = d.data.astype(np.float32) / 16.0, d.target.astype(np.int32)
    except ImportError:
        rng = np.random.RandomState(0)
        x, y = rng.rand(n, 64).astype(np.float32), rng.randint(0, 10, n).astype(np.int32)
    per = n // world
    return x[rank * per:(rank + 1) * per].reshape(per, 8, 8, 1), y[rank * per:(rank + 1) * per]


# ----------------------------------------------------------------------------- torch
def torch_step(rank, world):
    """Torch DDP's step on this rank's half of the batch (the group is initialised)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.manual_seed(rank)
    model = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                          nn.Flatten(), nn.Linear(512, 10))
    st = {"ddp": TorchDDP(model)}  # DDP broadcasts rank 0's parameters at construction
    st["opt"] = torch.optim.SGD(st["ddp"].parameters(), lr=LR)
    xb, yb = digits(GLOBAL_BATCH, rank, world)
    x, y = torch.from_numpy(xb.transpose(0, 3, 1, 2).copy()), torch.from_numpy(yb).long()

    def step():
        st["opt"].zero_grad()
        loss = nn.functional.cross_entropy(st["ddp"](x), y)
        loss.backward()
        st["opt"].step()
        return float(loss.detach())

    return step, st


# ----------------------------------------------------------------------------- jdist
def cnn(seed):
    import jax.numpy as jnp
    from flax import nnx

    r = nnx.Rngs(seed)

    class CNN(nnx.Module):
        def __init__(self):
            self.c1 = nnx.Conv(1, 16, (3, 3), padding="VALID", rngs=r)
            self.c2 = nnx.Conv(16, 32, (3, 3), padding="VALID", rngs=r)
            self.fc = nnx.Linear(4 * 4 * 32, 10, rngs=r)

        def __call__(self, x):
            x = nnx.relu(self.c2(nnx.relu(self.c1(x))))
            return self.fc(jnp.reshape(x, (x.shape[0], -1)))

    return CNN()


def jdist_step(g, flat):
    """Horovod's sequence in jdist: own init, broadcast from rank 0, shard_map step."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdist.optim

    model = cnn(g.rank)  # each rank starts from its own values, as in Horovod
    opt = nnx.Optimizer(model, jdist.optim.AllReduceOptimizer(optax.sgd(LR), flat=flat),
                        wrt=nnx.Param)
    jdist.optim.broadcast_parameters(model, root_rank=0)
    jdist.optim.broadcast_optimizer_state(opt, root_rank=0)
    gdef, state = nnx.split((model, opt))
    leaves, treedef = jax.tree.flatten(state)  # the step takes the flat list: no nnx.State
    # flattening per call (a fixed cost of the Python loop, as torch's is)

    def loss_fn(m, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    def body(leaves, x, y):
        m, o = nnx.merge(gdef, jax.tree.unflatten(treedef, leaves))
        loss, grads = nnx.value_and_grad(loss_fn)(m, x, y)
        o.update(m, grads)
        return jax.tree.leaves(nnx.state((m, o))), loss[None]

    step = jax.jit(jax.shard_map(body, mesh=g.mesh, in_specs=(P(), P("dp"), P("dp")),
                                 out_specs=(P(), P("dp")), check_vma=False), donate_argnums=0)
    xb, yb = digits(GLOBAL_BATCH, g.rank, g.size())
    rows = NamedSharding(g.mesh, P("dp"))
    st = {"s": leaves}

    def one():  # a host batch every step, as a training loop feeds it
        x = jax.make_array_from_process_local_data(rows, xb)
        y = jax.make_array_from_process_local_data(rows, yb)
        st["s"], loss = step(st["s"], x, y)
        return float(loss.addressable_data(0)[0])

    return one


def step_worker(steps, variants):
    """Torch DDP and the jdist variants in the same two processes, one step of each per
    round (so a load spike on the shared machine hits every contender alike)."""
    import gc
    import tempfile

    import torch
    import torch.distributed as dist

    import jdist

    torch.set_num_threads(1)
    jdist.collectives.init_process_group()
    g = jdist.collectives.get_default_group()
    path = os.path.join(tempfile.gettempdir(), f"jdist_hvd_{os.environ['MASTER_PORT']}")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=g.rank,
                            world_size=g.size())
    runs = {"torch DDP": torch_step(g.rank, g.size())}
    runs.update({label: (jdist_step(g, flat), None) for label, flat in variants})
    first = {}
    for label, (fn, _) in runs.items():
        t = time.perf_counter()
        fn()
        first[label] = time.perf_counter() - t
    for _ in range(3):
        for fn, _ in runs.values():
            fn()
    times = {k: [] for k in runs}
    for _ in range(steps):
        for label, (fn, _) in runs.items():
            t = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t)
    out = {k: (1e3 * statistics.median(v), first[k]) for k, v in times.items()}
    runs["torch DDP"][1].clear()  # the reducer must go before the group (benchmarks/ddp.py)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    jdist.collectives.destroy_process_group()
    if g.rank == 0:  # torch's FileStore may have removed it already (the last to leave)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return out


def allreduce_worker(steps):
    """The gradient all-reduce alone: 8 arrays (21,790 floats), flat vs per operand."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdist
    from jdist.collectives import ReduceOp, all_reduce_flat

    jdist.collectives.init_process_group()
    g = jdist.collectives.get_default_group()
    rng = np.random.RandomState(g.rank)
    rows = NamedSharding(g.mesh, P("dp"))
    tree = [jax.make_array_from_process_local_data(
        rows, rng.randn(1, *s).astype(np.float32)) for s in SHAPES]
    import tempfile

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = os.path.join(tempfile.gettempdir(), f"jdist_hvd_ar_{os.environ['MASTER_PORT']}")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=g.rank,
                            world_size=g.size())
    flat_t = torch.from_numpy(np.concatenate([np.ravel(rng.randn(*s)) for s in SHAPES])
                              .astype(np.float32))
    out = {"torch": _median_ms(lambda: dist.all_reduce(flat_t), steps, warmup=5)}
    dist.destroy_process_group()
    if g.rank == 0:  # torch's FileStore may have removed it already (the last to leave)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    for flat in (True, False):
        def body(t, flat=flat):
            return all_reduce_flat(t, ReduceOp.AVG, "dp", flat=flat)

        f = jax.jit(jax.shard_map(body, mesh=g.mesh, in_specs=P("dp"), out_specs=P("dp")))
        out[flat] = _median_ms(lambda f=f: jax.block_until_ready(f(tree)), steps, warmup=5)
    jdist.collectives.destroy_process_group()
    return out


def _env():
    return {"OMP_NUM_THREADS": "1", "JDIST_XLA_CPU_THREADS": "1"}  # (jdist._xla_threads)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="5 steps (benchmarks/run_all.py)")
    args = ap.parse_args(argv)
    steps = 5 if args.quick else args.steps
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import horovod as me
    from benchmarks._parse import bench_json, row, table
    from jdist.launch import spawn

    def run(fn, *a):
        return spawn(fn, args=a, nprocs=2, timeout=600, env=_env())

    floats = sum(int(np.prod(s)) for s in SHAPES)
    print(f"(a) small CNN on 8x8 digits, 2 processes x 1 device, gloo, 1 thread each, "
          f"global batch {GLOBAL_BATCH}")
    variants = (("jdist AllReduceOptimizer", None),
                ("jdist AllReduceOptimizer (flat=False)", False))
    res = run(me.step_worker, steps, variants)
    ms = {k: max(r[k][0] for r in res) for k in res[0]}
    t_ms = ms["torch DDP"]
    print(f"  torch DDP                                 {t_ms:8.2f} ms")
    rows_a, series = [], {"torch DDP": t_ms}
    for label, _ in variants:
        j_ms, comp = ms[label], max(r[label][1] for r in res)
        print(f"  {label:41s} {j_ms:8.2f} ms   ratio {j_ms / t_ms:.2f}x   "
              f"(first step {comp:.2f} s)")
        series[label] = j_ms
        rows_a.append(row(label, "ms", j_ms, t_ms, j_ms / t_ms, f"first step {comp:.2f} s"))
    print(f"(b) gradient all-reduce alone: {len(SHAPES)} arrays, {floats:,} floats, 2 processes")
    ar = run(me.allreduce_worker, steps * 4)
    flat_ms, leaf_ms = max(r[True] for r in ar), max(r[False] for r in ar)
    print(f"  one flat buffer (all_reduce_flat)         {flat_ms:8.3f} ms")
    print(f"  one operand per array                     {leaf_ms:8.3f} ms   "
          f"flat / per-operand {flat_ms / leaf_ms:.2f}x")
    torch_ar = max(r["torch"] for r in ar)
    print(f"  torch.distributed.all_reduce, one tensor  {torch_ar:8.3f} ms   "
          f"flat / torch {flat_ms / torch_ar:.2f}x")
    tables = [table("(a) Horovod-style step, 2 processes (gloo): jdist AllReduceOptimizer vs "
                    "torch DDP", "torch DDP", "jdist / torch (lower is better; goal <= 1.0)",
                    rows_a),
              table("(b) gradient all-reduce, 2 processes: flat buffer vs per operand",
                    "per operand", "flat / per operand (lower is better)",
                    [row(f"{len(SHAPES)} arrays, {floats} floats", "ms", flat_ms, leaf_ms,
                         flat_ms / leaf_ms),
                     row(f"flat buffer vs torch gloo all_reduce of {floats} floats", "ms",
                         flat_ms, torch_ar, flat_ms / torch_ar, "baseline: torch")])]
    print(bench_json("horovod", tables, {"horovod": series}))


if __name__ == "__main__":
    main()
