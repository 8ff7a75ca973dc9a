"""jdist.pipelining vs torch.distributed.pipelining: step time, and each schedule's idle
fraction against the bubble formula.

Step time: a pipeline of Linear(512, 512) + tanh stages, batch 256 in 8 micro-batches,
median of ``--steps`` steps after warm-up, jdist and torch in the same run (torch with
one thread, as jdist-run sets it): 4 stages in one process for the schedules that hold
several stages per rank (torch on its ``fake`` process group, as torch's own
single-process tests run), and 2 processes (torch on gloo) for GPipe, 1F1B and
Interleaved1F1B, where jdist runs on both of its transports (``transport="socket"``,
jdist's mailbox, the default on CPU; ``"xla"``, XLA's point-to-point) and also reports
each rank's measured idle share of the step.
Idle fraction of the orders: the share of idle time when every rank runs its order with
a forward taking one unit and a backward two, against (p - 1) / (m + p - 1) for GPipe
and 1F1B.

    python benchmarks/pipelining.py [--steps 30] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.collectives import _time_steps  # noqa: E402  (the median-step timer)

WIDTH, BATCH, STAGES, MB = 512, 256, 4, 8
MULTI = ("LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble")


def _median_step(step, steps: int) -> float:
    return _time_steps(step, steps, warmup=3)


def _jdist(name: str, steps: int) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jdist.pipelining as pp

    rngs = nnx.Rngs(0)
    mods = [nnx.Sequential(nnx.Linear(WIDTH, WIDTH, rngs=rngs), jnp.tanh)
            for _ in range(STAGES)]
    stages = [pp.PipelineStage(m, i, STAGES) for i, m in enumerate(mods)]
    sched = pp.get_schedule_class(name)(stages, MB, loss_fn=lambda o, t: jnp.mean((o - t) ** 2))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)

    def step():
        sched.step(x, target=y)
        jax.block_until_ready([st.grads for st in stages])

    return _median_step(step, steps)


def _torch(name: str, steps: int) -> float:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group(backend="fake", rank=0, world_size=1, store=FakeStore())
    mods = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
            for _ in range(STAGES)]
    stages = [tpp.PipelineStage(m, i, STAGES, torch.device("cpu")) for i, m in enumerate(mods)]
    sched = getattr(tpp, "Schedule" + name)(stages, MB, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step():
        for m in mods:
            m.zero_grad()
        sched.step(x, target=y)

    try:
        return _median_step(step, steps)
    finally:
        dist.destroy_process_group()


def _simulate(order: dict, n_stages: int) -> float:
    """Idle share of the ranks' time when each rank runs its order, a forward taking
    one unit and a backward two, each waiting for its input (the formula's model)."""
    from jdist.pipelining import Kind

    end: dict = {}
    free = dict.fromkeys(order, 0.0)
    todo = {r: [a for a in ops if a is not None] for r, ops in order.items()}
    while any(todo.values()):
        for r, ops in todo.items():
            while ops:
                a = ops[0]
                if a.kind is Kind.FORWARD:
                    dep = None if a.stage == 0 else (a.stage - 1, Kind.FORWARD, a.microbatch)
                elif a.stage == n_stages - 1:
                    dep = (a.stage, Kind.FORWARD, a.microbatch)
                else:
                    dep = (a.stage + 1, Kind.BACKWARD, a.microbatch)
                if dep is not None and dep not in end:
                    break
                start = max(free[r], end.get(dep, 0.0))
                free[r] = end[(a.stage, a.kind, a.microbatch)] = start + (
                    1.0 if a.kind is Kind.FORWARD else 2.0)
                ops.pop(0)
    span = max(free.values())
    busy = sum(1.0 if k is Kind.FORWARD else 2.0 for (_, k, _) in end)
    return 1 - busy / (len(order) * span)


def _jdist_mp(name: str, steps: int, transport: str) -> dict:
    """One rank of a 2-process pipeline (2 stages per rank for the multi-stage schedules):
    median step time, and the share of the step this rank's stages were not computing."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jdist
    import jdist.pipelining as pp

    jdist.init_process_group(timeout=600)
    rank = jdist.get_rank()
    n = 2 if name in ("GPipe", "1F1B") else 4
    rngs = nnx.Rngs(0)
    mods = [nnx.Sequential(nnx.Linear(WIDTH, WIDTH, rngs=rngs), jnp.tanh) for _ in range(n)]
    stages = [pp.PipelineStage(mods[s], s, n) for s in range(rank, n, 2)]
    busy = [0.0]
    for st in stages:  # time each computation to its end (benchmark-only wrapping)
        for meth in ("forward", "backward", "backward_input", "backward_weight"):
            def timed(*a, _f=getattr(st, meth), **k):
                t = time.perf_counter()
                out = jax.block_until_ready(_f(*a, **k))
                busy[0] += time.perf_counter() - t
                return out
            setattr(st, meth, timed)
    sched = pp.get_schedule_class(name)(stages, MB, loss_fn=lambda o, t: jnp.mean((o - t) ** 2),
                                        transport=transport)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    walls, idles = [], []
    for i in range(steps + 3):
        busy[0] = 0.0
        t = time.perf_counter()
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        jax.block_until_ready([st.grads for st in stages])
        wall = time.perf_counter() - t
        if i >= 3:
            walls.append(wall)
            idles.append(1 - busy[0] / wall)
    jdist.destroy_process_group()
    return {"step": statistics.median(walls), "idle": statistics.median(idles)}


def _torch_mp(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = 2 if name in ("GPipe", "1F1B") else 4
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
            for _ in range(n)]
    stages = [tpp.PipelineStage(mods[s], s, n, torch.device("cpu")) for s in range(rank, n, 2)]
    cls = getattr(tpp, "Schedule" + name)
    single = issubclass(cls, tpp.schedules.PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, MB, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step():
        for m in mods:
            m.zero_grad()
        sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == 1 else {}))

    try:
        return {"step": _median_step(step, steps)}
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _idle_rows() -> list[tuple]:
    from jdist.pipelining import _orders

    rows = []
    for name in ("gpipe", "one_f_one_b"):
        for p, m in ((4, 4), (4, 8), (4, 16)):
            idle = _simulate(_orders.ORDERS[name](p, 1, m), p)
            rows.append((f"{name} p={p} m={m}", idle, (p - 1) / (m + p - 1)))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    steps = 3 if args.smoke else args.steps
    from benchmarks._parse import bench_json, row, table

    times = []
    print(f"step time, {STAGES} stages of Linear({WIDTH}, {WIDTH}) in one process, batch "
          f"{BATCH} in {MB} micro-batches, median of {steps} steps:")
    for name in MULTI:
        j, t = _jdist(name, steps), _torch(name, steps)
        times.append(row(name, "ms", j * 1e3, t * 1e3, j / t))
        print(f"  {name:22s} jdist {j * 1e3:8.2f} ms  torch {t * 1e3:8.2f} ms  "
              f"ratio {j / t:.2f}", flush=True)
    from jdist.launch import spawn

    mod = __import__("benchmarks.pipelining", fromlist=["_jdist_mp"])
    procs, measured = [], []
    print(f"step time, 2 processes (GPipe/1F1B: 1 stage each; others: 2 each), batch "
          f"{BATCH} in {MB} micro-batches:")
    for name in ("GPipe", "1F1B", "Interleaved1F1B"):
        t = spawn(mod._torch_mp, args=(name, steps), nprocs=2, timeout=900,
                  env={"OMP_NUM_THREADS": "1"})
        ts = max(r["step"] for r in t)
        for transport, label in (("socket", "mailbox"), ("xla", "XLA p2p")):
            j = spawn(mod._jdist_mp, args=(name, steps, transport), nprocs=2, timeout=900,
                      env={"OMP_NUM_THREADS": "1"})
            js = max(r["step"] for r in j)
            procs.append(row(f"{name}, {label}", "ms", js * 1e3, ts * 1e3, js / ts))
            idle = [r["idle"] for r in j]
            if name in ("GPipe", "1F1B"):
                measured.append(row(f"{name}, {label}", "fraction", max(idle), 1 / (MB + 1),
                                    note="worst rank; formula (p-1)/(m+p-1), p=2"))
            print(f"  {name + ', ' + label:26s} jdist {js * 1e3:8.2f} ms  torch "
                  f"{ts * 1e3:8.2f} ms  ratio {js / ts:.2f}  (jdist idle share per rank "
                  f"{', '.join(f'{v:.2f}' for v in idle)})", flush=True)
    idle = _idle_rows()
    print("idle share of the ranks' time running each order (forward 1, backward 2 "
          "units) vs (p-1)/(m+p-1):")
    for case, got, want in idle:
        print(f"  {case:22s} {got:.3f} vs {want:.3f}")
    print(bench_json("pipelining", [
        table("pipeline step time, 4 stages in one process", "torch",
              "jdist / torch (lower is better; goal <= 1.0)", times),
        table("pipeline step time, 2 processes", "torch (gloo)",
              "jdist / torch (lower is better; goal <= 1.0)", procs),
        table("idle share measured on 2 processes (jdist) vs the bubble formula", "formula",
              "measured / formula", measured),
        table("idle share of the order vs the bubble formula", "formula",
              "order / formula", [row(c, "fraction", g, w, g / w) for c, g, w in idle])]))


if __name__ == "__main__":
    main()
