"""Comm hooks and distributed optimizers: bytes per step, ZeRO time and memory.

One run, two tables (8 replicas; virtual CPU devices unless the machine has more):

1. Bytes per replica per DDP step for each comm hook on an MLP, read from the step's
   lowered program (what it asks for) and from the compiled program (what this backend
   runs: XLA:CPU promotes bf16 all-reduces to f32 and may merge all-reduces), with the
   ratio to DDP without a hook. PowerSGD lists its compressed branch (after
   ``start_powerSGD_iter``).
2. Adam with ZeRO-1 against plain data parallel (all-reduce + full Adam on every
   replica), both as one jitted ``shard_map`` step: median step time and per-replica
   optimizer-state bytes, and their ratios. DDP's own ``train_step`` with Adam is timed
   too, as the wrapper baseline.

    PYTHONPATH=. python benchmarks/hooks_optim.py            # full sizes
    PYTHONPATH=. python benchmarks/hooks_optim.py --smoke    # small model, few steps

The last line, ``BENCH_JSON {...}``, holds the same numbers for benchmarks/run_all.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import _parse as report  # noqa: E402
from jdist.collectives._group import ProcessGroup, make_mesh  # noqa: E402
from jdist.ddp import DistributedDataParallel as DDP  # noqa: E402
from jdist.ddp import hooks as H  # noqa: E402
from jdist.optim import DistributedOptimizer, ZeroRedundancyOptimizer  # noqa: E402

N = 8


class MLP(nnx.Module):
    def __init__(self, sizes, *, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                for a, b in zip(sizes, sizes[1:], strict=False)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _group():
    devs = tuple(jax.devices()[:N])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs, "dp"), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name="BENCH")


def _median(fn, iters):
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _ddp_reports(ddp, batch):
    eng = ddp._engine
    (key,) = [k for k in eng._programs if k[0] == "grad"]
    prog, seen = eng._programs[key], []
    eng._programs[key] = lambda *a: (seen.append(a), prog(*a))[1]
    try:
        ddp.value_and_grad(mse)(batch)
    finally:
        eng._programs[key] = prog
    lowered = prog.lower(*seen[0])
    return H.comm_report(lowered), H.comm_report(lowered.compile())


def hook_table(sizes, batch_n):
    rng = np.random.RandomState(0)
    batch = {"x": rng.randn(batch_n, sizes[0]).astype(np.float32),
             "y": rng.randn(batch_n, sizes[-1]).astype(np.float32)}
    cases = [
        ("no hook", None, None),
        ("allreduce_hook", H.allreduce_hook, None),
        ("fp16_compress_hook", H.fp16_compress_hook, None),
        ("bf16_compress_hook", H.bf16_compress_hook, None),
        ("powerSGD_hook r=1", H.powerSGD_hook, H.PowerSGDState(start_powerSGD_iter=2)),
        ("powerSGD_hook r=4", H.powerSGD_hook,
         H.PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=4)),
        ("batched_powerSGD r=1", H.batched_powerSGD_hook,
         H.PowerSGDState(start_powerSGD_iter=2)),
        ("fp16(powerSGD r=1)", H.fp16_compress_wrapper(H.powerSGD_hook),
         H.PowerSGDState(start_powerSGD_iter=2)),
    ]
    print(f"\n== bytes per replica per DDP step, MLP {sizes} "
          f"({sum(a * b + b for a, b in zip(sizes, sizes[1:], strict=False)):,} params), "
          f"{N} replicas ==")
    print(f"{'hook':<24}{'asked (lowered)':>16}{'ratio':>8}{'compiled (CPU)':>16}"
          f"{'collectives':>13}")
    base = None
    rows = []
    for name, hook, state in cases:
        ddp = DDP(MLP(sizes, rngs=nnx.Rngs(0)))
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        ddp.value_and_grad(mse)(batch)
        asked, ran = _ddp_reports(ddp, batch)
        b = asked.bytes_min  # PowerSGD: the compressed branch; others have no branches
        base = base or b
        print(f"{name:<24}{b:>16,}{base / b:>8.1f}{ran.bytes_min:>16,}{asked.count:>13}")
        rows.append(report.row(
            name, "bytes", b, base, base / b,
            f"compiled (CPU) {ran.bytes_min:,} bytes, {asked.count} collectives"))
    return report.table(
        f"Bytes per replica per DDP step, MLP {sizes}, {N} replicas (lowered program)",
        "no hook", "no hook / hook (compression; higher is better)", rows)


def zero_table(sizes, batch_n, steps):
    g = _group()
    mesh = g.mesh
    model = MLP(sizes, rngs=nnx.Rngs(0))
    gdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    rng = np.random.RandomState(0)
    batch = {"x": rng.randn(batch_n, sizes[0]).astype(np.float32),
             "y": rng.randn(batch_n, sizes[-1]).astype(np.float32)}
    row = NamedSharding(mesh, P("dp"))
    rep = NamedSharding(mesh, P())
    batch = jax.device_put(batch, row)

    def loss(p, b):
        return mse(nnx.merge(gdef, nnx.State(p)), b)

    def make(tx_like, state_specs):
        def body(p, s, b):
            grads = jax.grad(loss)(p, b)
            u, s = tx_like.update(grads, s, p)
            return optax.apply_updates(p, u), s

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), state_specs, P("dp")),
                                     out_specs=(P(), state_specs), check_vma=False),
                       donate_argnums=(0, 1))

    tx = optax.adam(1e-3)
    plain = DistributedOptimizer(tx, group=g)
    zero = ZeroRedundancyOptimizer(tx, group=g)
    p0 = jax.device_put(params, rep)
    s_plain = jax.device_put(jax.jit(plain.init)(params), rep)
    s_zero = zero.init(params)
    f_plain = make(plain, P())
    f_zero = make(zero, zero.state_partition_specs(s_zero))

    def state_bytes(s):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(s))

    b_plain, b_zero = state_bytes(s_plain), state_bytes(s_zero)
    res = {}
    for name, f, s in (("plain DP (all-reduce + Adam)", f_plain, s_plain),
                       ("ZeRO-1 (RS + shard Adam + AG)", f_zero, s_zero)):
        p = jax.tree.map(jnp.copy, p0)
        for _ in range(2):
            p, s = f(p, s, batch)
        jax.block_until_ready(p)
        box = [p, s]

        def one(f=f, box=box):
            box[0], box[1] = f(box[0], box[1], batch)
            return box[0]

        res[name] = _median(one, steps)
    # DDP's own train_step with Adam, the wrapper baseline
    ddp_model = MLP(sizes, rngs=nnx.Rngs(0))
    ddp = DDP(ddp_model)
    step = ddp.train_step(mse, nnx.Optimizer(ddp_model, tx, wrt=nnx.Param))
    host_batch = jax.device_get(batch)
    step(host_batch)
    step(host_batch)
    res["DDP train_step + Adam"] = _median(lambda: step(host_batch), steps)
    print(f"\n== Adam step, MLP {sizes}, {N} replicas, batch {batch_n}, median of {steps} ==")
    print(f"{'program':<32}{'step ms':>10}{'opt-state bytes/replica':>26}")
    for name, t in res.items():
        nb = b_zero if name.startswith("ZeRO") else b_plain
        print(f"{name:<32}{t * 1e3:>10.2f}{nb:>26,}")
    t_zero = res["ZeRO-1 (RS + shard Adam + AG)"]
    t_plain = res["plain DP (all-reduce + Adam)"]
    print(f"ZeRO / plain: time x{t_zero / t_plain:.2f}, state memory "
          f"x{b_zero / b_plain:.3f} (ideal 1/{N} = {1 / N:.3f})")
    zero, plain, ddp_name = ("ZeRO-1 (RS + shard Adam + AG)", "plain DP (all-reduce + Adam)",
                             "DDP train_step + Adam")
    rows = [
        report.row(f"step time: {zero}", "ms", t_zero * 1e3, t_plain * 1e3, t_zero / t_plain),
        report.row(f"optimizer state per replica: {zero}", "bytes", b_zero, b_plain,
                   b_zero / b_plain, f"ideal 1/{N} = {1 / N:.3f}"),
        report.row(f"step time: {ddp_name}", "ms", res[ddp_name] * 1e3, t_plain * 1e3),
    ]
    return report.table(f"Adam step, MLP {sizes}, {N} replicas, batch {batch_n}: ZeRO-1 and "
                        f"DDP vs plain data parallel", plain, "jdist / plain DP", rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", "--quick", action="store_true", help="small model, few steps")
    args = ap.parse_args()
    sizes = (64, 128, 128, 10) if args.smoke else (512, 1024, 1024, 1024, 10)
    print(f"backend {jax.default_backend()}, {len(jax.devices())} devices")
    tables = [hook_table(sizes, 64),
              zero_table(sizes, 256 if not args.smoke else 64, 5 if args.smoke else 20)]
    print(report.bench_json("hooks_optim", tables))


if __name__ == "__main__":
    main()
